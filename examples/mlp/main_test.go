package main

import (
	"bytes"
	"context"
	"io"
	"math"
	"strings"
	"testing"
)

// TestLayoutsMatchOneRank trains the example for 12 steps on one rank,
// on dp=2 × tp=2, fsdp=4, tp=4 and dp=2 × fsdp=2 (HSDP), and checks that
// every step's loss and every evaluation's metrics agree with the
// one-rank run. The tolerance is 1e-6 relative (measured: 1.2e-7): the
// parameters are float32 and the layouts differ only in the order of
// their sums (tensor parallelism splits the hidden
// layer's dot products, data parallelism sums the ranks' gradient
// contributions), which over a few steps of AdamW moves the losses by a
// few float32 roundings; dropout draws the serial run's masks on every
// layout, so anything larger is a bug.
func TestLayoutsMatchOneRank(t *testing.T) {
	ctx := context.Background()
	base := options{dp: 1, tp: 1, fsdp: 1, steps: 12, batch: 64}
	want, err := run(ctx, io.Discard, base)
	if err != nil {
		t.Fatal(err)
	}
	if len(want.Steps) != 12 || len(want.Evals) != 4 || want.Steps[11].Loss >= want.Steps[0].Loss {
		t.Fatalf("one rank: %d steps, %d evals, loss %v → %v: want 12 falling steps and 4 evals", len(want.Steps), len(want.Evals), want.Steps[0].Loss, want.Steps[len(want.Steps)-1].Loss)
	}
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-6*math.Max(1, math.Abs(b)) }
	for _, c := range []struct {
		name         string
		dp, tp, fsdp int
	}{{"dp2xtp2", 2, 2, 1}, {"fsdp4", 1, 1, 4}, {"tp4", 1, 4, 1}, {"hsdp2x2", 2, 1, 2}} {
		t.Run(c.name, func(t *testing.T) {
			o := base
			o.dp, o.tp, o.fsdp = c.dp, c.tp, c.fsdp
			got, err := run(ctx, io.Discard, o)
			if err != nil {
				t.Fatal(err)
			}
			if len(got.Steps) != len(want.Steps) || len(got.Evals) != len(want.Evals) {
				t.Fatalf("%d steps and %d evals; one rank had %d and %d", len(got.Steps), len(got.Evals), len(want.Steps), len(want.Evals))
			}
			worst := 0.0
			for i, s := range got.Steps {
				worst = math.Max(worst, math.Abs(s.Loss-want.Steps[i].Loss))
				if !near(s.Loss, want.Steps[i].Loss) || s.LR != want.Steps[i].LR {
					t.Errorf("step %d: loss %v lr %v; one rank %v lr %v", i+1, s.Loss, s.LR, want.Steps[i].Loss, want.Steps[i].LR)
				}
			}
			for i, e := range got.Evals {
				for k, v := range want.Evals[i].Metrics {
					if !near(e.Metrics[k], v) {
						t.Errorf("eval %d %s: %v; one rank %v", i, k, e.Metrics[k], v)
					}
				}
			}
			t.Logf("largest loss difference from one rank: %.3g", worst)
		})
	}
}

// TestProgressOutput checks the example's printed lines: a progress line
// every 10 steps and the last, and an evaluation line.
func TestProgressOutput(t *testing.T) {
	var out bytes.Buffer
	if _, err := run(context.Background(), &out, options{dp: 2, tp: 1, fsdp: 1, steps: 12, batch: 32}); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{"step 10/12  loss ", "step 12/12  loss ", "samples/s", "eval at step 12:  accuracy "} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
}
