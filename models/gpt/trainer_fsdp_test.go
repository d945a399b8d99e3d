package gpt_test

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// trainFull trains the small GPT for steps steps on a mesh of shape and
// names and returns the losses and the final parameters.
func trainFull(t *testing.T, steps int, shape []int, names []string, opts ...gpt.TrainOption) ([]float64, map[string][]float32) {
	t.Helper()
	run := small()
	run.B = 8
	c := gpt.FromReference(run)
	var mu sync.Mutex
	var losses []float64
	var params map[string][]float32
	placementtest.Run(t, shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := gpt.NewTrainer(ctx, m, c, append([]gpt.TrainOption{gpt.WithRun(run), gpt.WithModel(gpt.WithSeed(5))}, opts...)...)
		if err != nil {
			return err
		}
		var ls []float64
		for range steps {
			_, l, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			ls = append(ls, l)
		}
		full, err := tr.Full(ctx)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			mu.Lock()
			losses, params = ls, full
			mu.Unlock()
		}
		return nil
	})
	return losses, params
}

// TestTrainerFSDP: the Trainer's FSDP layouts (fsdp alone, HSDP, over TP
// with SP, ZeRO-1/2, reshard policies, bf16 gathers) train like one rank
// (float32: 2e-5 on losses and parameters over 20 AdamW steps, from the
// order of the reductions; bf16 gathers round the parameters the forward
// sees, so 2e-2), and activation checkpointing changes nothing, bit for
// bit, on top of any of them.
func TestTrainerFSDP(t *testing.T) {
	const steps = 20
	wantL, wantP := trainFull(t, steps, []int{1}, []string{"dp"})
	for _, c := range []struct {
		name  string
		shape []int
		names []string
		tol   float64
		opts  []gpt.TrainOption
	}{
		{"fsdp=2", []int{2}, []string{"fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp")}},
		{"fsdp=4 reshard 2", []int{4}, []string{"fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp", fsdp.WithReshardTo(2))}},
		{"hsdp dp=2×fsdp=2", []int{2, 2}, []string{"dp", "fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithDataParallel("dp"), gpt.WithFullyShard("fsdp")}},
		{"fsdp=2×tp=2", []int{2, 2}, []string{"fsdp", "tp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp"), gpt.WithTensorParallel("tp")}},
		{"fsdp=4 no prefetch", []int{4}, []string{"fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp", fsdp.WithPrefetch(false))}},
		{"fsdp=2×tp=2 sp", []int{2, 2}, []string{"fsdp", "tp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp"), gpt.WithTensorParallel("tp"), gpt.WithSequenceParallel()}},
		{"zero-1", []int{2}, []string{"fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp", fsdp.WithZeROStage(1))}},
		{"zero-2", []int{2}, []string{"fsdp"}, 2e-5, []gpt.TrainOption{gpt.WithFullyShard("fsdp", fsdp.WithZeROStage(2), fsdp.WithReshard(false))}},
		{"bf16", []int{2}, []string{"fsdp"}, 2e-2, []gpt.TrainOption{gpt.WithFullyShard("fsdp", fsdp.WithMixedPrecision(comm.BFloat16))}},
	} {
		t.Run(c.name, func(t *testing.T) {
			gotL, gotP := trainFull(t, steps, c.shape, c.names, c.opts...)
			if err := near(gotL, gotP, wantL, wantP, c.tol); err != nil {
				t.Errorf("vs one rank: %v", err)
			}
			for _, ac := range [][]autograd.CheckpointOption{nil, {autograd.WithKeepMatrixProducts()}} {
				acL, acP := trainFull(t, steps, c.shape, c.names, append(c.opts, gpt.WithCheckpointing(ac...))...)
				if err := near(acL, acP, gotL, gotP, 0); err != nil {
					t.Errorf("checkpointing %v: not bit for bit: %v", ac, err)
				}
			}
		})
	}
}

// near compares losses and parameters within tol (0: bit for bit).
func near(gotL []float64, gotP map[string][]float32, wantL []float64, wantP map[string][]float32, tol float64) error {
	if len(gotL) != len(wantL) || len(gotP) != len(wantP) {
		return fmt.Errorf("%d losses and %d parameters, want %d and %d", len(gotL), len(gotP), len(wantL), len(wantP))
	}
	for i := range wantL {
		if d := math.Abs(gotL[i] - wantL[i]); !(d <= tol) {
			return fmt.Errorf("step %d loss %v, want %v", i+1, gotL[i], wantL[i])
		}
	}
	for name, w := range wantP {
		g := gotP[name]
		if len(g) != len(w) {
			return fmt.Errorf("%s: %d values, want %d", name, len(g), len(w))
		}
		for i := range w {
			if d := math.Abs(float64(g[i]) - float64(w[i])); !(d <= tol) {
				return fmt.Errorf("%s[%d] = %v, want %v", name, i, g[i], w[i])
			}
		}
	}
	return nil
}
