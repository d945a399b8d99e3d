package gpt_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The batch dim sharded over both mesh axes in (b, a) order reaches
// CrossEntropy with the targets in the same order as the logits.
func TestForwardKeepsANestedBatchOrder(t *testing.T) {
	c := small()
	b := randomBatch(c, 5)
	placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(gpt.RandomInit(gpt.FromReference(c), 1)))
		if err != nil {
			return err
		}
		s0 := placement.Shard(0)
		places := []placement.Placement{s0, s0}
		x, err := autograd.IndicesFromFull(m, []int{b.B, b.T}, places, b.X, placement.WithOrder(0, "b", "a"))
		if err != nil {
			return err
		}
		y, err := autograd.IndicesFromFull(m, []int{b.B, b.T}, places, b.Y, placement.WithOrder(0, "b", "a"))
		if err != nil {
			return err
		}
		if _, err := md.Forward(ctx, tape, x, y); err != nil {
			return fmt.Errorf("Forward with x and y laid out alike: %v", err)
		}
		return nil
	})
}

func TestNilIndicesDoNotPanic(t *testing.T) {
	defer func() {
		if r := recover(); r != nil {
			t.Fatalf("panic: %v", r)
		}
	}()
	var ix *autograd.Indices
	if ix.Shape() != nil || ix.Placements() != nil || ix.String() != "indices (invalid)" {
		t.Error("nil Indices accessors")
	}
	zero := &autograd.Indices{}
	if zero.LocalShape() != nil || zero.Order(0) != nil {
		t.Error("zero Indices accessors")
	}
}

// NewTrainer rejects, before any communication, an axis name the mesh
// lacks (a misspelt dp axis would silently replicate the work), one axis
// named twice, and layouts Forward cannot run (heads or batch rows that do
// not split over the ranks), each with an error wrapping ErrConfig.
func TestNewTrainerRejectsBadLayouts(t *testing.T) {
	c := small() // H=2, B=4
	placementtest.Run(t, []int{1, 3}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		dp, tp := gpt.WithDataParallel, gpt.WithTensorParallel
		for _, tc := range []struct {
			want string
			opts []gpt.TrainOption
		}{
			{`no axis "data"`, []gpt.TrainOption{dp("data"), tp("tp")}},
			{`no axis "model"`, []gpt.TrainOption{dp("dp"), tp("model")}},
			{"both data and", []gpt.TrainOption{dp("tp"), tp("tp")}},
			{"heads (2) must be divisible by tp (3); tp can be 1 or 2", []gpt.TrainOption{dp("dp"), tp("tp")}},
			{"dp (3) must divide the batch (4 sequences); dp can be 1, 2 or 4", []gpt.TrainOption{dp("tp")}},
			{"needs a tensor-pa", []gpt.TrainOption{dp("dp"), gpt.WithSequenceParallel()}},
		} {
			opts := append(tc.opts, gpt.WithRun(c), gpt.WithModel(gpt.WithSeed(1)))
			_, err := gpt.NewTrainer(ctx, m, gpt.FromReference(c), opts...)
			if !errors.Is(err, gpt.ErrConfig) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				return fmt.Errorf("got %v, want an ErrConfig mentioning %q", err, tc.want)
			}
		}
		return nil
	})
}

// A plan rule for the "h" container reaches hooks that Forward runs.
func TestBlocksContainerHooksRun(t *testing.T) {
	c := small()
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(gpt.RandomInit(gpt.FromReference(c), 1)))
		if err != nil {
			return err
		}
		n := 0
		if err := tp.Parallelize(ctx, md, "tp", tp.Plan{{Pattern: "h", Style: countInputs{&n}}}); err != nil {
			return err
		}
		x, y, err := md.Inputs(randomBatch(c, 2), nil)
		if err != nil {
			return err
		}
		if _, err := md.Forward(ctx, tape, x, y); err != nil {
			return err
		}
		tape.Reset()
		if n != 1 {
			return fmt.Errorf("the h container's input hook ran %d times, want 1", n)
		}
		return nil
	})
}

type countInputs struct{ n *int }

func (s countInputs) Apply(_ context.Context, m parallel.Module, _ string) error {
	m.Boundary().OnInput(func(_ context.Context, v *autograd.Value) (*autograd.Value, error) {
		*s.n++
		return v, nil
	})
	return nil
}

// WithDDP reaches the trainer's DDP: tiny buckets (one per parameter)
// reduce the same sums as the default ones, so the losses are equal.
func TestTrainerDDPOptions(t *testing.T) {
	c := small()
	losses := func(opts ...gpt.TrainOption) []float64 {
		var out []float64
		placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			opts := append([]gpt.TrainOption{gpt.WithRun(c), gpt.WithDataParallel("dp"), gpt.WithModel(gpt.WithSeed(2))}, opts...)
			tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(c), opts...)
			if err != nil {
				return err
			}
			var ls []float64
			for range 3 {
				_, l, err := tr.Step(ctx)
				if err != nil {
					return err
				}
				ls = append(ls, l)
			}
			if m.Rank() == 0 {
				out = ls
			}
			return nil
		})
		return out
	}
	def, tiny := losses(), losses(gpt.WithDDP(ddp.WithFirstBucket(4), ddp.WithBucketCap(4)))
	if len(def) != 3 || !slices.Equal(def, tiny) {
		t.Errorf("losses with default buckets %v, with one bucket per parameter %v", def, tiny)
	}
}
