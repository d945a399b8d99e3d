package tp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Tensor parallelism (and sequence parallelism) of a transformer block
// computes the serial loss and gradients, on odd and even tp with uneven
// sequence and hidden shards, with and without dp.
func TestTensorParallelBlockMatchesSerial(t *testing.T) {
	wantLoss, want := ptest.GradsOf(t, 1, 1, false, false)
	for _, c := range []struct {
		dp, tp int
		sp     bool
	}{{1, 2, false}, {1, 3, false}, {2, 2, false}, {1, 2, true}, {1, 3, true}, {2, 3, true}} {
		t.Run(fmt.Sprintf("dp=%d,tp=%d,sp=%v", c.dp, c.tp, c.sp), func(t *testing.T) {
			loss, got := ptest.GradsOf(t, c.dp, c.tp, c.sp, true)
			if math.Abs(loss-wantLoss) > 1e-9*math.Abs(wantLoss) {
				t.Errorf("loss %v, serial %v", loss, wantLoss)
			}
			for name, w := range want {
				g := got[name]
				if len(g) != len(w) {
					t.Errorf("%s: %d values, want %d", name, len(g), len(w))
					continue
				}
				for i := range w {
					if math.Abs(g[i]-w[i]) > 1e-9*(1+math.Abs(w[i])) {
						t.Errorf("%s[%d] = %v, serial %v", name, i, g[i], w[i])
						break
					}
				}
			}
		})
	}
}

// Colwise sharding of a fused q|k|v projection gives each rank matching
// slices of q, k and v (its heads), not a slice of the fused dim.
func TestColwiseFusedShardsEachChunk(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := ptest.NewBlock(m)
		if err != nil {
			return err
		}
		if err := tp.Parallelize(ctx, b, "tp", tp.Plan{{Pattern: "attn.qkv", Style: tp.ColwiseParallel{}}}); err != nil {
			return err
		}
		w := b.Attn.QKV.Weight
		if got := fmt.Sprint(w.Spec().Shape(), w.Data().LocalShape()); got != fmt.Sprint([]int{3, ptest.BlkD, ptest.BlkD}, []int{3, ptest.BlkD / 2, ptest.BlkD}) {
			return fmt.Errorf("fused weight global/local shapes %s", got)
		}
		return nil
	})
}

func TestParallelizeErrors(t *testing.T) {
	cases := []struct {
		name string
		plan tp.Plan
		want string
	}{
		{"no match", tp.Plan{{Pattern: "attn.qvk", Style: tp.ColwiseParallel{}}}, "matches no module"},
		{"wrong module", tp.Plan{{Pattern: "ln1", Style: tp.ColwiseParallel{}}}, "applies to *Linear"},
		{"twice", tp.Plan{{Pattern: "mlp.fc", Style: tp.ColwiseParallel{}}, {Pattern: "mlp.fc", Style: tp.RowwiseParallel{}}}, "already"},
		{"rowwise fused", tp.Plan{{Pattern: "attn.qkv", Style: tp.RowwiseParallel{}}}, "fused"},
		{"no axis", nil, "no axis"},
		{"nil style", tp.Plan{{Pattern: "ln1"}}, "no style"},
		{"empty layout", tp.Plan{{Pattern: "ln1", Style: tp.PrepareModuleInput{}}}, "without a layout"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				b, _, err := ptest.NewBlock(m)
				if err != nil {
					return err
				}
				axis, plan := "tp", c.plan
				if plan == nil {
					axis, plan = "model", tp.Plan{{Pattern: "mlp.fc", Style: tp.ColwiseParallel{}}}
				}
				err = tp.Parallelize(ctx, b, axis, plan)
				if !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
					return fmt.Errorf("got %v, want ErrInvalid mentioning %q", err, c.want)
				}
				return nil
			})
		})
	}
}

// Parallelizing after training started is refused: the gradient would stay
// in the parameter's old layout.
func TestParallelizeAfterBackward(t *testing.T) {
	placementtest.Run(t, []int{1, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, tape, err := ptest.NewBlock(m)
		if err != nil {
			return err
		}
		l, err := b.Loss(ctx, tape, m, false)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return err
		}
		err = tp.Parallelize(ctx, b, "tp", ptest.BlockPlan(false))
		if !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "already has a gradient") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
}

// The plan is checked before any module changes: a later rule that matches
// nothing, an axis the mesh lacks (even for styles that only install
// hooks) and a nil child are errors that leave the model as it was.
func TestParallelizeChecksFirst(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := ptest.NewBlock(m)
		if err != nil {
			return err
		}
		err = tp.Parallelize(ctx, b, "tp", tp.Plan{{Pattern: "ln1", Style: tp.SequenceParallel{}}, {Pattern: "mlp.fc", Style: tp.ColwiseParallel{}}, {Pattern: "mlp.prj", Style: tp.RowwiseParallel{}}})
		if !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "matches no module") {
			return fmt.Errorf("misspelt rule: got %v", err)
		}
		if !b.MLP.FC.Weight.Spec().Placements()[0].IsReplicate() || b.LN1.Count() != 0 {
			return fmt.Errorf("a failed plan changed the model: fc %v, %d ln1 hooks", b.MLP.FC.Weight.Spec(), b.LN1.Count())
		}
		if err := tp.Parallelize(ctx, b, "model", tp.Plan{{Pattern: "ln1", Style: tp.SequenceParallel{}}}); !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "no axis") || strings.Count(err.Error(), "tp:") != 1 {
			return fmt.Errorf("unknown axis: got %v", err)
		}
		b.Attn.Proj = nil
		if err := tp.Parallelize(ctx, b, "tp", tp.Plan{{Pattern: "attn", Style: tp.SequenceParallel{}}}); !errors.Is(err, parallel.ErrInvalid) || !strings.Contains(err.Error(), "nil") {
			return fmt.Errorf("nil child: got %v", err)
		}
		emb := &parallel.Embedding{Table: b.LN1.Weight}
		if err := tp.Parallelize(ctx, &twin{a: emb, b: b.LN2}, "tp", tp.Plan{{Pattern: "a", Style: tp.SequenceParallel{}}}); !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "Embedding") {
			return fmt.Errorf("SequenceParallel on an Embedding (no input hooks): got %v", err)
		}
		if _, err := (&parallel.Linear{}).Forward(ctx, nil); !errors.Is(err, parallel.ErrInvalid) {
			return fmt.Errorf("Linear without a weight: got %v", err)
		}
		return nil
	})
}

// twin holds two children that may be the same module.
type twin struct {
	parallel.Hooks
	a, b parallel.Module
}

func (w *twin) Children() []parallel.Child {
	return []parallel.Child{{Name: "a", Module: w.a}, {Name: "b", Module: w.b}}
}

// A module reachable at two paths gets a style once; a parameter shared by
// two modules (tied weights) stays one leaf, the same Value, laid out once
// when both lay it out alike, and
// is an error when they do not or when one of them keeps it replicated.
func TestParallelizeSharedModulesAndTiedParams(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := ptest.NewBlock(m)
		if err != nil {
			return err
		}
		if err := tp.Parallelize(ctx, &twin{a: b.LN1, b: b.LN1}, "tp", tp.Plan{{Pattern: "*", Style: tp.SequenceParallel{}}}); err != nil {
			return err
		}
		if b.LN1.Count() != 1 {
			return fmt.Errorf("a module at two paths got %d input hooks, want 1", b.LN1.Count())
		}

		w := b.Attn.Proj.Weight
		tied := &parallel.Linear{Weight: w}
		if err := tp.Parallelize(ctx, &twin{a: b.Attn.Proj, b: tied}, "tp", tp.Plan{{Pattern: "*", Style: tp.RowwiseParallel{}}}); err != nil {
			return err
		}
		if b.Attn.Proj.Weight != w || tied.Weight != w || !w.Spec().Placements()[0].IsShard() {
			return fmt.Errorf("tied weight: %p and %p after Parallelize (was %p), laid out %v", b.Attn.Proj.Weight, tied.Weight, w, w.Spec())
		}

		w = b.MLP.FC.Weight
		err = tp.Parallelize(ctx, &twin{a: b.MLP.FC, b: &parallel.Linear{Weight: w}}, "tp", tp.Plan{{Pattern: "a", Style: tp.ColwiseParallel{}}, {Pattern: "b", Style: tp.RowwiseParallel{}}})
		if !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "tied") {
			return fmt.Errorf("tied weight laid out two ways: got %v", err)
		}
		w = b.MLP.Proj.Weight
		err = tp.Parallelize(ctx, &twin{a: b.MLP.Proj, b: &parallel.Linear{Weight: w}}, "tp", tp.Plan{{Pattern: "a", Style: tp.RowwiseParallel{}}})
		if !errors.Is(err, tp.ErrInvalid) || !strings.Contains(err.Error(), "shared") {
			return fmt.Errorf("tied weight left replicated in one module: got %v", err)
		}
		return nil
	})
}
