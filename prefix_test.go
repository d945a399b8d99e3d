package loom_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestNoDoubledPrefix: where a package's sentinel already says the
// package's name ("parallel: invalid argument"), no fmt.Errorf of that
// package puts the name before it again, which printed "parallel:
// FullyShard: parallel: invalid argument: ..." (issue 28). It reads the
// source: for each sentinel made by loom.NewSentinel (or errors.New) with
// a "pkg: " prefix, a call fmt.Errorf("pkg: ...", ..., Sentinel, ...) in
// the same package is an error naming the file and line.
func TestNoDoubledPrefix(t *testing.T) {
	fset := token.NewFileSet()
	pkgs := map[string][]*ast.File{} // directory -> non-test files
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && path != "." {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(fset, path, src, 0)
		if err != nil {
			return err
		}
		pkgs[filepath.Dir(path)] = append(pkgs[filepath.Dir(path)], f)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, files := range pkgs {
		prefixed := map[string]string{} // sentinel -> its "pkg: " prefix
		for _, f := range files {
			ast.Inspect(f, func(n ast.Node) bool {
				vs, ok := n.(*ast.ValueSpec)
				if !ok {
					return true
				}
				for i, v := range vs.Values {
					if p := sentinelPrefix(v); p != "" && i < len(vs.Names) {
						prefixed[vs.Names[i].Name] = p
					}
				}
				return true
			})
		}
		if len(prefixed) == 0 {
			continue
		}
		for _, f := range files {
			ast.Inspect(f, func(n ast.Node) bool {
				call, ok := n.(*ast.CallExpr)
				if !ok || !isSel(call.Fun, "fmt", "Errorf") || len(call.Args) < 2 {
					return true
				}
				format := stringLit(call.Args[0])
				for _, a := range call.Args[1:] {
					id, ok := a.(*ast.Ident)
					if !ok {
						continue
					}
					if p, ok := prefixed[id.Name]; ok {
						checked++
						if strings.HasPrefix(format, p) {
							t.Errorf("%v: fmt.Errorf(%q, ..., %s) says %q twice (%s's text begins with it)", fset.Position(call.Pos()), format, id.Name, p, id.Name)
						}
					}
				}
				return true
			})
		}
	}
	if checked == 0 {
		t.Fatal("no call wraps a prefixed sentinel: the scan finds nothing to check")
	}
}

// sentinelPrefix returns "pkg: " when e is loom.NewSentinel("pkg: ...", ...)
// or errors.New("pkg: ..."), else "".
func sentinelPrefix(e ast.Expr) string {
	call, ok := e.(*ast.CallExpr)
	if !ok || len(call.Args) == 0 || !(isSel(call.Fun, "loom", "NewSentinel") || isSel(call.Fun, "errors", "New")) {
		return ""
	}
	s := stringLit(call.Args[0])
	if i := strings.Index(s, ": "); i > 0 && !strings.Contains(s[:i], " ") {
		return s[:i+2]
	}
	return ""
}

func isSel(e ast.Expr, pkg, name string) bool {
	sel, ok := e.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != name {
		return false
	}
	id, ok := sel.X.(*ast.Ident)
	return ok && id.Name == pkg
}

func stringLit(e ast.Expr) string {
	lit, ok := e.(*ast.BasicLit)
	if !ok || lit.Kind != token.STRING {
		return ""
	}
	s, err := strconv.Unquote(lit.Value)
	if err != nil {
		return ""
	}
	return s
}
