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
			if strings.Contains(body.src, snippet) {
				found = true
				break
			}
		}
		if !found {
			t.Errorf("README snippet is in no Example function (copy it from one, or add the Example):\n%s", b[1])
		}
	}
}

// example is one Example function: the file it is in and its normalized
// body.
type example struct{ file, src string }

// exampleBodies returns every Example function in the module's test files.
func exampleBodies(t *testing.T) []example {
	t.Helper()
	var bodies []example
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
			bodies = append(bodies, example{file: filepath.ToSlash(path), src: normalize(string(src[lo+1 : hi]))})
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

// mdLink matches a Markdown link to a file of the repository (not a URL
// or an anchor), capturing the path.
var mdLink = regexp.MustCompile(`\]\(([^)#:]+)(#[^)]*)?\)`)

// TestReadmeLinksExamples: the README's code is reachable as files a user
// can open, since go doc does not show Example functions. The text just
// before each Go snippet links the file of an Example function that
// contains it; every file with Example functions and every program under
// examples/ is linked; and every link to a file of the repository
// resolves.
func TestReadmeLinksExamples(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	linked := map[string]bool{}
	for _, m := range mdLink.FindAllStringSubmatch(readme, -1) {
		p := strings.TrimSuffix(m[1], "/")
		linked[p] = true
		if _, err := os.Stat(p); err != nil {
			t.Errorf("README links %s, which does not exist: %v", m[1], err)
		}
	}
	bodies := exampleBodies(t)
	prev := 0
	for _, loc := range goBlock.FindAllStringSubmatchIndex(readme, -1) {
		intro, snippet := readme[prev:loc[0]], normalize(readme[loc[2]:loc[3]])
		prev = loc[1]
		var files []string
		ok := false
		for _, b := range bodies {
			if strings.Contains(b.src, snippet) {
				files = append(files, b.file)
				ok = ok || strings.Contains(intro, "]("+b.file+")")
			}
		}
		if !ok && len(files) > 0 {
			t.Errorf("the text before the README snippet starting %q links none of the files of its Example, %v", firstLine(readme[loc[2]:loc[3]]), files)
		}
	}
	for _, b := range bodies {
		if !linked[b.file] {
			t.Errorf("the README links no %s, which has Example functions", b.file)
			linked[b.file] = true // once per file
		}
	}
	dirs, err := os.ReadDir("examples")
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if !d.IsDir() {
			continue
		}
		found := false
		for p := range linked {
			found = found || p == "examples/"+d.Name() || strings.HasPrefix(p, "examples/"+d.Name()+"/")
		}
		if !found {
			t.Errorf("the README links no file of examples/%s", d.Name())
		}
	}
}

// firstLine returns s up to its first newline.
func firstLine(s string) string {
	l, _, _ := strings.Cut(s, "\n")
	return l
}
