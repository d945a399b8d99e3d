package gpt_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// trainMemory trains cfg for two steps on a mesh of shape and names with
// opts and returns rank 0's view of the second step's memory (the
// maximum over ranks).
func trainMemory(t *testing.T, c gpt.Config, shape []int, names []string, opts ...gpt.TrainOption) memory.Report {
	t.Helper()
	run := small()
	run.B = 8
	var rep memory.Report
	placementtest.Run(t, shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := gpt.NewTrainer(ctx, m, c, append([]gpt.TrainOption{gpt.WithRun(run)}, opts...)...)
		if err != nil {
			return err
		}
		for range 2 {
			if _, _, err := tr.Step(ctx); err != nil {
				return err
			}
		}
		r, err := tr.Memory(ctx)
		if m.Rank() == 0 {
			rep = r
		}
		return err
	})
	return rep
}

// TestTrainerMemory: with DDP every rank holds the whole model, its
// gradients (DDP's buckets) and AdamW's two moments, all float32; the
// peak is at most the sum of the kinds' peaks and at least the state
// that persists; checkpointing every block lowers the activations' peak.
func TestTrainerMemory(t *testing.T) {
	c := gpt.FromReference(small())
	c.Layers = 4
	n := int64(c.NumParams()) * 4
	ddp := trainMemory(t, c, []int{2}, []string{"dp"}, gpt.WithDataParallel("dp"))
	if ddp.Params != n || ddp.Grads != n || ddp.Optim != 2*n || ddp.Comm != 0 {
		t.Errorf("DDP memory %+v; want params %d, grads %d, optim %d, comm 0", ddp, n, n, 2*n)
	}
	if ddp.Activations <= 0 || ddp.Peak > ddp.Total() || ddp.Peak < 4*n {
		t.Errorf("DDP activations %d, peak %d (total of peaks %d, state %d)", ddp.Activations, ddp.Peak, ddp.Total(), 4*n)
	}
	for _, ac := range []struct {
		name string
		opts []autograd.CheckpointOption
		max  float64
	}{{"full", nil, 0.5}, {"selective", []autograd.CheckpointOption{autograd.WithKeepMatrixProducts()}, 0.9}} {
		r := trainMemory(t, c, []int{2}, []string{"dp"}, gpt.WithDataParallel("dp"), gpt.WithCheckpointing(ac.opts...))
		ratio := float64(r.Activations) / float64(ddp.Activations)
		t.Logf("-ac %s: activations %d vs %d (%.2f×)", ac.name, r.Activations, ddp.Activations, ratio)
		if ratio > ac.max {
			t.Errorf("-ac %s: activations' peak %.2f× of no checkpointing; want at most %.1f×", ac.name, ratio, ac.max)
		}
		if r.Params != ddp.Params || r.Grads != ddp.Grads || r.Optim != ddp.Optim {
			t.Errorf("-ac %s changed the state: %+v vs %+v", ac.name, r, ddp)
		}
	}
	one := trainMemory(t, c, []int{1}, []string{"dp"})
	if one.Params != n || one.Grads != n || one.Optim != 2*n {
		t.Errorf("one rank: %+v", one)
	}
	if fmt.Sprint(one.Activations) == "0" {
		t.Error("one rank: no activations counted")
	}
}

// TestFSDPMemory: on a model of 32 blocks and fsdp=4, a rank's parameters,
// gradients and optimizer state (each at its peak during a step) are at
// most 0.3× of what DDP holds for the same model; ZeRO-1 and ZeRO-2 sit
// in between. The table is logged (go test -v -run FSDPMemory).
func TestFSDPMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: trains a 32-block model four ways")
	}
	c := gpt.FromReference(small())
	c.Layers, c.Width, c.MLPWidth = 32, 32, 128
	state := func(r memory.Report) int64 { return r.Params + r.Grads + r.Optim }
	ddp := trainMemory(t, c, []int{4}, []string{"dp"}, gpt.WithDataParallel("dp"))
	t.Logf("%-8s %10s %10s %10s %10s %8s", "", "params", "grads", "optim", "sum", "vs DDP")
	row := func(name string, r memory.Report) float64 {
		ratio := float64(state(r)) / float64(state(ddp))
		t.Logf("%-8s %10d %10d %10d %10d %7.2f×", name, r.Params, r.Grads, r.Optim, state(r), ratio)
		return ratio
	}
	row("DDP", ddp)
	var ratios [4]float64
	for _, stage := range []int{1, 2, 3} {
		r := trainMemory(t, c, []int{4}, []string{"fsdp"}, gpt.WithFullyShard("fsdp", fsdp.WithZeROStage(stage)))
		ratios[stage] = row(fmt.Sprintf("ZeRO-%d", stage), r)
	}
	if ratios[3] > 0.3 {
		t.Errorf("ZeRO-3 holds %.2f× of DDP's parameters, gradients and optimizer state; want at most 0.3×", ratios[3])
	}
	if !(ratios[3] < ratios[2] && ratios[2] <= ratios[1] && ratios[1] < 1) {
		t.Errorf("want ZeRO-3 < ZeRO-2 ≤ ZeRO-1 < DDP, got %.2f, %.2f, %.2f", ratios[3], ratios[2], ratios[1])
	}
}
