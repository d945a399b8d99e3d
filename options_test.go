package loom_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestOptionsAreWithX: the module has one option idiom, functional options
// named WithX (issue 28 found 64 WithX and 29 bare names such as
// fsdp's Reshard, which collided with the reshard function). It reads the
// source: in every package, an option type is a named type whose name ends
// in "Option", or a func type that some function takes variadically
// (opts ...T); an exported function (not a method) whose results are one
// option type, from its package or another (optionally with an error), must
// be named With followed by an upper-case letter.
func TestOptionsAreWithX(t *testing.T) {
	bad, n, err := bareOptions(".")
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("found no option constructors: the scan is broken")
	}
	for _, b := range bad {
		t.Errorf("%s: option constructor %s is not named WithX", b.pos, b.name)
	}
}

// TestOptionsGuardCatchesBare: the scan of TestOptionsAreWithX reports a
// bare option constructor, a func-type option and a cross-package one,
// and accepts WithX, methods and non-option results.
func TestOptionsGuardCatchesBare(t *testing.T) {
	dir := t.TempDir()
	files := map[string]string{
		"a/a.go": `package a

type Option func(*config)
type config struct{ n int }

// Opt is a func type used as an option without the name.
type Opt func(*config)

func New(opts ...Opt) {}

func WithN(n int) Option          { return func(c *config) { c.n = n } }
func Bare(n int) Option           { return func(c *config) { c.n = n } }
func BareOpt() Opt                { return func(*config) {} }
func BareErr() (Option, error)    { return nil, nil }
func Withdrawn() Option           { return nil }
func (c *config) Method() Option  { return nil }
func helper() Option              { return nil }
func Many() []Option              { return nil }
`,
		"b/b.go": `package b

import "example.com/a"

func Cross() a.Option    { return nil }
func WithCross() a.Option { return nil }
`,
	}
	for name, src := range files {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bad, _, err := bareOptions(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, b := range bad {
		got = append(got, b.name)
	}
	slices.Sort(got)
	want := []string{"a.Bare", "a.BareErr", "a.BareOpt", "a.Withdrawn", "b.Cross"}
	if !slices.Equal(got, want) {
		t.Errorf("reported %v, want %v", got, want)
	}
}

type bareOption struct {
	pos  string
	name string // pkg.Func
}

// bareOptions parses the non-test Go files under root (skipping testdata
// and hidden folders) and returns the exported option constructors not
// named WithX, and how many option constructors it saw.
func bareOptions(root string) ([]bareOption, int, error) {
	fset := token.NewFileSet()
	type pkg struct {
		name  string
		files []*ast.File
	}
	pkgs := map[string]*pkg{}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		dir := filepath.Dir(path)
		if pkgs[dir] == nil {
			pkgs[dir] = &pkg{name: f.Name.Name}
		}
		pkgs[dir].files = append(pkgs[dir].files, f)
		return nil
	})
	if err != nil {
		return nil, 0, err
	}
	// Option types by package name: a type named *Option, or a func type
	// some function takes as opts ...T.
	options := map[string]map[string]bool{}
	for _, p := range pkgs {
		set := options[p.name]
		if set == nil {
			set = map[string]bool{}
			options[p.name] = set
		}
		funcTypes := map[string]bool{}
		for _, f := range p.files {
			for _, decl := range f.Decls {
				g, ok := decl.(*ast.GenDecl)
				if !ok || g.Tok != token.TYPE {
					continue
				}
				for _, s := range g.Specs {
					ts := s.(*ast.TypeSpec)
					if strings.HasSuffix(ts.Name.Name, "Option") {
						set[ts.Name.Name] = true
					}
					if _, ok := ts.Type.(*ast.FuncType); ok {
						funcTypes[ts.Name.Name] = true
					}
				}
			}
		}
		for _, f := range p.files {
			ast.Inspect(f, func(n ast.Node) bool {
				ft, ok := n.(*ast.FuncType)
				if !ok || ft.Params == nil {
					return true
				}
				for _, fld := range ft.Params.List {
					if el, ok := fld.Type.(*ast.Ellipsis); ok {
						if id, ok := el.Elt.(*ast.Ident); ok && funcTypes[id.Name] {
							set[id.Name] = true
						}
					}
				}
				return true
			})
		}
	}
	isOption := func(pkgName string, e ast.Expr) bool {
		switch x := e.(type) {
		case *ast.Ident:
			return options[pkgName][x.Name]
		case *ast.SelectorExpr:
			q, ok := x.X.(*ast.Ident)
			return ok && (options[q.Name][x.Sel.Name] || strings.HasSuffix(x.Sel.Name, "Option"))
		}
		return false
	}
	var bad []bareOption
	n := 0
	for _, p := range pkgs {
		for _, f := range p.files {
			for _, decl := range f.Decls {
				fd, ok := decl.(*ast.FuncDecl)
				if !ok || fd.Recv != nil || !fd.Name.IsExported() || fd.Type.Results == nil {
					continue
				}
				var res []ast.Expr
				for _, r := range fd.Type.Results.List {
					for range max(len(r.Names), 1) {
						res = append(res, r.Type)
					}
				}
				if len(res) == 2 {
					if id, ok := res[1].(*ast.Ident); ok && id.Name == "error" {
						res = res[:1]
					}
				}
				if len(res) != 1 || !isOption(p.name, res[0]) {
					continue
				}
				n++
				name := fd.Name.Name
				if rest, ok := strings.CutPrefix(name, "With"); ok && rest != "" && rest[0] >= 'A' && rest[0] <= 'Z' {
					continue
				}
				bad = append(bad, bareOption{pos: fset.Position(fd.Pos()).String(), name: fmt.Sprintf("%s.%s", p.name, name)})
			}
		}
	}
	slices.SortFunc(bad, func(a, b bareOption) int { return strings.Compare(a.pos, b.pos) })
	return bad, n, nil
}
