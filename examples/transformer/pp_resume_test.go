package main

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// -data, -checkpoint and -resume on a pipeline: 6 steps straight equal 3
// steps, a save and 3 resumed steps, bit for bit on the same pipeline
// (in the background with -async-save too) and within 1e-4 (the layout
// tests' loss tolerance) when the run resumes on another split
// (interleaved, two stages a rank), on one rank without a pipeline, from
// one rank onto the pipeline, or from stages on dp=2 to stages sharded
// by FSDP.
func TestResumePipeline(t *testing.T) {
	data := resumeText(t)
	model := []string{"-layers", "4", "-steps", "6"}
	pp2 := []string{"-pp", "2", "-schedule", "1f1b", "-microbatches", "4"}
	inter := []string{"-pp", "2", "-schedule", "interleaved", "-microbatches", "4", "-stages-per-rank", "2"}
	one := []string{"-dp", "1", "-tp", "1"}
	straightPP, out, err := runLosses(t, data, append(slices.Clone(model), pp2...)...)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "on pp=2") {
		t.Fatalf("not a pipelined run:\n%s", out)
	}
	straightOne, _, err := runLosses(t, data, append(slices.Clone(model), one...)...)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name          string
		saver, loader []string
		straight      []float64
		exact         bool
	}{
		{"pp=2", pp2, pp2, straightPP, true},
		{"pp=2 async", append(slices.Clone(pp2), "-async-save"), pp2, straightPP, true},
		{"pp=2 → interleaved", pp2, inter, straightPP, false},
		{"pp=2 → one rank", pp2, one, straightPP, false},
		{"one rank → pp=2", one, pp2, straightOne, false},
		// Stages composed with data parallelism, then sharded by FSDP.
		{"pp=2×dp=2 → pp=2×fsdp=2", []string{"-pp", "2", "-microbatches", "2", "-dp", "2"}, []string{"-pp", "2", "-microbatches", "2", "-fsdp", "2"}, straightPP, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "ck")
			args := append(append(slices.Clone(model), c.saver...), "-steps", "3", "-checkpoint", dir, "-save-every", "2", "-keep", "1")
			first, out, err := runLosses(t, data, args...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "checkpoints: 2 saved") {
				t.Errorf("no report of 2 saves (steps 2 and 3):\n%s", out)
			}
			args = append(append(slices.Clone(model), c.loader...), "-checkpoint", dir, "-resume", "-keep", "1")
			second, out, err := runLosses(t, data, args...)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(out, "resuming from") || !strings.Contains(out, "step    6  loss") {
				t.Errorf("no resume line, or the last step not numbered 6:\n%s", out)
			}
			got := append(first, second...)
			if len(got) != len(c.straight) {
				t.Fatalf("%d losses, want %d", len(got), len(c.straight))
			}
			for i := range got {
				if c.exact && math.Float64bits(got[i]) != math.Float64bits(c.straight[i]) || !(math.Abs(got[i]-c.straight[i]) <= 1e-4) {
					t.Errorf("step %d: loss %.9g resumed, %.9g straight", i+1, got[i], c.straight[i])
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
	if _, _, err := runLosses(t, data, append(slices.Clone(model), append(pp2, "-checkpoint", filepath.Join(t.TempDir(), "none"), "-resume")...)...); err == nil || !strings.Contains(err.Error(), "no checkpoint to resume from") {
		t.Errorf("-pp -resume without a checkpoint: %v", err)
	}
}
