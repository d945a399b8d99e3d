package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// resumeText writes an ASCII text file for -data.
func resumeText(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for i := range 400 {
		b.WriteString("the quick brown fox jumps over the lazy dog ")
		b.WriteByte(byte('a' + i%26))
		b.WriteString(". ")
	}
	path := filepath.Join(t.TempDir(), "text.txt")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// runLosses runs the example with args (a small model on data) and
// returns its losses (-json) and its output.
func runLosses(t *testing.T, data string, args ...string) ([]float64, string, error) {
	t.Helper()
	js := filepath.Join(t.TempDir(), "run.json")
	base := []string{"-layers", "1", "-width", "32", "-heads", "4", "-ff", "64", "-seq", "16", "-batch", "4", "-data", data, "-every", "2", "-json", js}
	var out bytes.Buffer
	if err := run(context.Background(), append(base, args...), &out); err != nil {
		return nil, out.String(), err
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var r result
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r.Losses, out.String(), nil
}

// -data, -checkpoint and -resume: 6 steps straight equal 3 steps, a save
// and 3 resumed steps, bit for bit on one rank and within the layout
// tests' tolerance when the saving run was dp=2 × tp=2; the validation
// loss is printed; -resume without a checkpoint and a checkpoint of
// another model are refused, and the folder is left as it was.
func TestResume(t *testing.T) {
	data := resumeText(t)
	straight, out, err := runLosses(t, data, "-dp", "1", "-tp", "1", "-steps", "6")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "validation loss") {
		t.Errorf("no validation loss in the output:\n%s", out)
	}
	for _, c := range []struct {
		name  string
		saver []string
		exact bool
	}{
		{"one rank", []string{"-dp", "1", "-tp", "1"}, true},
		{"dp=2×tp=2 → one rank", []string{"-dp", "2", "-tp", "2"}, false},
		{"fsdp=2, async → one rank", []string{"-dp", "1", "-tp", "1", "-fsdp", "2", "-async-save"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ck")
			first, _, err := runLosses(t, data, append(c.saver, "-steps", "3", "-checkpoint", dir, "-save-every", "2", "-keep", "1")...)
			if err != nil {
				t.Fatal(err)
			}
			second, out, err := runLosses(t, data, "-dp", "1", "-tp", "1", "-steps", "6", "-checkpoint", dir, "-resume", "-keep", "1")
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "step    6  validation loss") {
				t.Errorf("no validation loss at step 6:\n%s", out)
			}
			got := append(first, second...)
			if len(got) != len(straight) {
				t.Fatalf("%d losses, want %d", len(got), len(straight))
			}
			for i := range got {
				if c.exact && math.Float64bits(got[i]) != math.Float64bits(straight[i]) || !(math.Abs(got[i]-straight[i]) <= 1e-4) {
					t.Errorf("step %d: loss %.9g resumed, %.9g straight", i+1, got[i], straight[i])
				}
			}
			entries, err := os.ReadDir(dir)
			if err != nil {
				t.Fatal(err)
			}
			var steps []string
			for _, e := range entries {
				if strings.HasPrefix(e.Name(), "step-") {
					steps = append(steps, e.Name())
				}
			}
			if want := []string{"step-0000000006"}; !slices.Equal(steps, want) {
				t.Errorf("-keep 1 left %v, want %v", steps, want)
			}
		})
	}

	dir := filepath.Join(t.TempDir(), "ck")
	if _, _, err := runLosses(t, data, "-dp", "1", "-tp", "1", "-steps", "2", "-checkpoint", filepath.Join(t.TempDir(), "none"), "-resume"); err == nil || !strings.Contains(err.Error(), "no checkpoint to resume from") {
		t.Errorf("-resume without a checkpoint: %v", err)
	}
	if _, _, err := runLosses(t, data, "-dp", "1", "-tp", "1", "-steps", "2", "-checkpoint", dir); err != nil {
		t.Fatal(err)
	}
	before, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = runLosses(t, data, "-dp", "1", "-tp", "1", "-steps", "4", "-checkpoint", dir, "-resume", "-width", "64")
	if err == nil || !strings.Contains(err.Error(), "shape") {
		t.Errorf("resuming another model: %v, want an error naming the shapes", err)
	}
	after, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(before) != len(after) {
		t.Errorf("the refused resume changed the folder: %v, then %v", before, after)
	}
}
