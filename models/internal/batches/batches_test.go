package batches

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/internal/randtok"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

var errTest = errors.New("batches test: invalid configuration")

// windowsOf returns the windows of t tokens of a small text file on one
// rank.
func windowsOf(t *testing.T, tokens int) *train.Windows {
	t.Helper()
	path := filepath.Join(t.TempDir(), "text.txt")
	if err := os.WriteFile(path, []byte(strings.Repeat("to be or not to be. ", 20)), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := train.OpenTokens(path, 256)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	w, err := local.NewWorld(1)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mesh.New(w.Comm(0), []int{1}, []string{"dp"})
	if err != nil {
		t.Fatal(err)
	}
	win, err := train.NewWindows(f, tokens, m)
	if err != nil {
		t.Fatal(err)
	}
	return win
}

// TestSelect: each choice gives its batches (the file's windows, random
// tokens from the seed, the corpus), and a nil token file or one of
// windows of another length is refused with the caller's sentinel.
func TestSelect(t *testing.T) {
	data := tinygpt.Default()
	data.B, data.T = 3, 6
	win6, win8 := windowsOf(t, 6), windowsOf(t, 8)
	for _, c := range []struct {
		name    string
		choice  Choice
		refused string // "" when the choice is valid
	}{
		{"file", Choice{Windows: win6, File: true}, ""},
		{"nil file", Choice{File: true}, "nil windows"},
		{"file of other windows", Choice{Windows: win8, File: true}, "windows of 8 tokens for a model of sequence length 6"},
		{"random", Choice{Random: true, Seed: 5}, ""},
		{"corpus", Choice{}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			src, err := Select(data, c.choice, errTest)
			if c.refused != "" {
				if !errors.Is(err, errTest) || !strings.Contains(err.Error(), c.refused) {
					t.Fatalf("err %v, want %q wrapping the sentinel", err, c.refused)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			b, err := src.Next()
			if err != nil {
				t.Fatal(err)
			}
			if b.B != data.B || b.T != data.T {
				t.Fatalf("batch of %d×%d, want %d×%d", b.B, b.T, data.B, data.T)
			}
			want := randtok.New(5, data.B, data.T, data.V).Next()
			if same := slices.Equal(b.X, want.X); same != c.choice.Random {
				t.Errorf("the batch equals randtok's from seed 5: %v, want %v", same, c.choice.Random)
			}
		})
	}
}
