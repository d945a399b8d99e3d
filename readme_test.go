package loom_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// goBlock matches a fenced Go code block of a Markdown file.
var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

// TestReadmeSnippetsAreExamples: every Go snippet of the README is a run of
// lines of some runnable Example function, so that the README cannot show
// code that does not compile or no longer works.
func TestReadmeSnippetsAreExamples(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlock.FindAllSubmatch(readme, -1)
	if len(blocks) == 0 {
		t.Fatal("README.md has no Go snippets")
	}
	bodies := exampleBodies(t)
	for _, b := range blocks {
		snippet := normalize(string(b[1]))
		found := false
		for _, body := range bodies {
			if strings.Contains(body, snippet) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("README snippet is in no Example function (copy it from one, or add the Example):\n%s", b[1])
		}
	}
}

// exampleBodies returns the normalized source of every Example function in
// the module's test files.
func exampleBodies(t *testing.T) []string {
	t.Helper()
	var bodies []string
	fset := token.NewFileSet()
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(fset, path, src, parser.ParseComments)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !strings.HasPrefix(fn.Name.Name, "Example") || fn.Body == nil {
				continue
			}
			lo, hi := fset.Position(fn.Body.Lbrace).Offset, fset.Position(fn.Body.Rbrace).Offset
			bodies = append(bodies, normalize(string(src[lo+1:hi])))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return bodies
}

// normalize folds every line's white space (indentation, gofmt's alignment
// of comments) and drops blank lines.
func normalize(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.Join(strings.Fields(l), " "); l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
