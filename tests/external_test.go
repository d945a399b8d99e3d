package tests

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// shBlock matches a fenced shell block of a Markdown file.
var shBlock = regexp.MustCompile("(?s)```sh\n(.*?)```")

// readmeSection returns the text of README.md's section headed "## title",
// up to the next second-level heading.
func readmeSection(t *testing.T, readme, title string) string {
	t.Helper()
	head := "\n## " + title + "\n"
	i := strings.Index(readme, head)
	if i < 0 {
		t.Fatalf("README.md has no section %q", title)
	}
	rest := readme[i+len(head):]
	if j := strings.Index(rest, "\n## "); j >= 0 {
		rest = rest[:j]
	}
	return rest
}

// firstProgram turns the README's first program (an Example body that ends
// with its "// Output:" comment) into a main package, and returns it with
// the output it promises.
func firstProgram(t *testing.T, readme string) (src, want string) {
	t.Helper()
	blocks := goBlockRE.FindAllStringSubmatch(readmeSection(t, readme, "A first program"), -1)
	if len(blocks) == 0 {
		t.Fatal(`README.md's "A first program" has no Go block`)
	}
	body, out, ok := strings.Cut(blocks[0][1], "// Output: ")
	if !ok {
		t.Fatal(`README.md's first program has no "// Output:" line`)
	}
	return `package main

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
)

func main() {
` + body + "}\n", strings.TrimSpace(out)
}

var goBlockRE = regexp.MustCompile("(?s)```go\n(.*?)```")

// TestReadmeInstall runs the shell blocks of README.md's Install section as
// written, each on a scratch folder outside the repository: the clone is
// this repository (a symbolic link named as `git clone` would name it, the
// one line not run), and hello/main.go is the README's first program in a
// main function, as the section says. Each block must end by running it
// and printing the output the README promises. The go command runs offline
// (GOPROXY=off, GOSUMDB=off: the module cache already holds loom's
// dependencies) and with no GOFLAGS or GOWORK of the caller's. Skipped
// under -short only (it compiles a program per block).
func TestReadmeInstall(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles and runs a program per install route")
	}
	for _, tool := range []string{"go", "sh"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("the README's install commands need %s: %v", tool, err)
		}
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	src, want := firstProgram(t, readme)
	blocks := shBlock.FindAllStringSubmatch(readmeSection(t, readme, "Install"), -1)
	routes := map[string]bool{"go work init": false, "-replace=": false}
	for _, b := range blocks {
		for r := range routes {
			routes[r] = routes[r] || strings.Contains(b[1], r)
		}
	}
	for r, found := range routes {
		if !found {
			t.Errorf("README.md's Install section has no shell block with %q", r)
		}
	}
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOWORK=") {
			env = append(env, kv)
		}
	}
	// Last, so that they win over the caller's.
	env = append(env, "GOPROXY=off", "GOSUMDB=off", "GOFLAGS=", "GOTOOLCHAIN=local", "LOOM_COSTMODEL=off")
	for i, b := range blocks {
		var script []string
		cloned := false
		for _, line := range strings.Split(strings.TrimSpace(b[1]), "\n") {
			if strings.HasPrefix(line, "git clone ") {
				// The clone's folder is the last part of its URL, less .git.
				if !strings.HasSuffix(line, "/loom.git") && !strings.HasSuffix(line, "/loom") {
					t.Fatalf("block %d clones something other than loom into ./loom: %q", i, line)
				}
				cloned = true
				continue
			}
			script = append(script, line)
		}
		if !cloned {
			t.Errorf("block %d does not clone loom:\n%s", i, b[1])
			continue
		}
		dir := t.TempDir()
		if err := os.Symlink(root, filepath.Join(dir, "loom")); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(dir, "hello"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "hello", "main.go"), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command("sh", "-e", "-c", strings.Join(script, "\n"))
		cmd.Dir = dir
		cmd.Env = env
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Errorf("block %d failed: %v\n%s\nstderr:\n%s", i, err, b[1], stderr.String())
			continue
		}
		if got := strings.TrimSpace(stdout.String()); got != want {
			t.Errorf("block %d printed %q, the README promises %q", i, got, want)
		}
	}
}
