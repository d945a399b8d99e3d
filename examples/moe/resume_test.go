package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// moeLosses runs the example with args on a small MoE GPT trained on
// data and returns its losses (-json) and output.
func moeLosses(t *testing.T, data string, args ...string) ([]float64, string, error) {
	t.Helper()
	js := filepath.Join(t.TempDir(), "run.json")
	base := []string{"-layers", "1", "-width", "32", "-heads", "2", "-ff", "32", "-seq", "16", "-batch", "8", "-experts", "4",
		"-data", data, "-every", "2", "-threads", "1", "-json", js}
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

// -data, -checkpoint and -resume in the MoE example: 6 steps straight on
// ep=2 equal 3 steps, a save and 3 resumed steps, bit for bit on ep=2
// and within the layout tolerance on ep=4 (each rank loading its experts
// by their global index); the validation loss is printed.
func TestResume(t *testing.T) {
	var b strings.Builder
	for i := range 300 {
		b.WriteString("experts route tokens to the few that know them best; ")
		b.WriteByte(byte('a' + i%26))
	}
	data := filepath.Join(t.TempDir(), "text.txt")
	if err := os.WriteFile(data, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	straight, out, err := moeLosses(t, data, "-ep", "2", "-steps", "6")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "validation loss") {
		t.Errorf("no validation loss in the output:\n%s", out)
	}
	for _, c := range []struct {
		name  string
		ep    string
		exact bool
		more  []string
	}{{"ep=2 → ep=2", "2", true, nil}, {"ep=2 → ep=4, async", "4", false, []string{"-async-save"}}} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ck")
			first, _, err := moeLosses(t, data, append([]string{"-ep", "2", "-steps", "3", "-checkpoint", dir}, c.more...)...)
			if err != nil {
				t.Fatal(err)
			}
			second, out, err := moeLosses(t, data, "-ep", c.ep, "-steps", "6", "-checkpoint", dir, "-resume")
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "resumed from step 3") {
				t.Errorf("the first line does not say where it resumed:\n%s", out)
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
		})
	}
}
