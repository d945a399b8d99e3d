package tp_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// vceTargets returns n targets in [0, v) that hit every class.
func vceTargets(n, v int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = int64((3*i + 1) % v)
	}
	return out
}

// vceRun records a loss on a fresh tape from logits laid out by places
// (global values from seed), runs Backward and returns the loss's
// placements and global value and the logits' global gradient.
func vceRun(ctx context.Context, m *mesh.Mesh, dt comm.DType, shape []int, places, tplaces []placement.Placement, vocab bool) (string, float64, []float64, error) {
	s, err := placement.NewSpec(m, shape, dt, places)
	if err != nil {
		return "", 0, nil, err
	}
	x, err := placement.FromFull(s, placementtest.Random(shape, dt, 11))
	if err != nil {
		return "", 0, nil, err
	}
	ix, err := autograd.IndicesFromFull(m, shape[:1], tplaces, vceTargets(shape[0], shape[1]))
	if err != nil {
		return "", 0, nil, err
	}
	tape := autograd.NewTape()
	v, err := tape.Param("logits", x)
	if err != nil {
		return "", 0, nil, err
	}
	var loss *autograd.Value
	if vocab {
		loss, err = tp.VocabParallelCrossEntropy(ctx, v, ix, "tp")
	} else {
		loss, err = autograd.CrossEntropy(v, ix)
	}
	if err != nil {
		return "", 0, nil, err
	}
	l, err := vceFull(ctx, loss.Data())
	if err != nil {
		return "", 0, nil, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return "", 0, nil, err
	}
	g, err := vceFull(ctx, v.Grad())
	if err != nil {
		return "", 0, nil, err
	}
	return fmt.Sprint(loss.Spec().Placements()), l[0], g, nil
}

// vceFull gathers a tensor's global value as float64.
func vceFull(ctx context.Context, dt *placement.DTensor) ([]float64, error) {
	f, err := dt.Full(ctx)
	if err != nil {
		return nil, err
	}
	switch d := f.(type) {
	case []float64:
		return d, nil
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out, nil
	}
	return nil, fmt.Errorf("data of type %T", f)
}

// TestVocabParallelCrossEntropyMatchesCrossEntropy compares the loss and
// the logits' gradient with autograd.CrossEntropy on the same logits with
// a whole vocab dim, checks the gradient by finite differences, and
// checks float32 against float64, on ("dp","tp") meshes 1x2, 2x2, 1x3 and
// 2x3 with rows replicated or sharded on dp (unevenly) and uneven and
// empty vocab shards.
func TestVocabParallelCrossEntropyMatchesCrossEntropy(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	for _, c := range []struct {
		mesh  []int
		shape []int // [N, V]
		dp    placement.Placement
	}{
		{[]int{1, 2}, []int{6, 5}, R},
		{[]int{1, 2}, []int{4, 1}, R}, // V = 1: one rank's vocab slice is empty
		{[]int{2, 2}, []int{6, 5}, S0},
		{[]int{2, 2}, []int{5, 4}, S0}, // 3 + 2 rows
		{[]int{2, 2}, []int{6, 5}, R},
		{[]int{1, 3}, []int{6, 5}, R}, // 2 + 2 + 1 classes
		{[]int{1, 3}, []int{6, 4}, R}, // 2 + 2 + 0: an empty vocab slice
		{[]int{2, 3}, []int{3, 7}, S0},
	} {
		t.Run(fmt.Sprintf("%v/%v/%v", c.mesh, c.shape, c.dp), func(t *testing.T) {
			placementtest.Run(t, c.mesh, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				vp, whole, tpl := pl{c.dp, S1}, pl{c.dp, R}, pl{c.dp, R}
				wantP, wantL, wantG, err := vceRun(ctx, m, comm.Float64, c.shape, whole, tpl, false)
				if err != nil {
					return err
				}
				gotP, gotL, gotG, err := vceRun(ctx, m, comm.Float64, c.shape, vp, tpl, true)
				if err != nil {
					return err
				}
				if gotP != wantP {
					return fmt.Errorf("loss placements %s, CrossEntropy's %s", gotP, wantP)
				}
				if math.Abs(gotL-wantL) > 1e-12*max(1, math.Abs(wantL)) {
					return fmt.Errorf("loss %v, CrossEntropy's %v", gotL, wantL)
				}
				for i := range wantG {
					if math.Abs(gotG[i]-wantG[i]) > 1e-12 {
						return fmt.Errorf("gradient element %d: %v, CrossEntropy's %v", i, gotG[i], wantG[i])
					}
				}
				_, l32, g32, err := vceRun(ctx, m, comm.Float32, c.shape, vp, tpl, true)
				if err != nil {
					return err
				}
				if math.Abs(l32-wantL) > 1e-5*max(1, math.Abs(wantL)) {
					return fmt.Errorf("float32 loss %v, float64 %v", l32, wantL)
				}
				for i := range wantG {
					if math.Abs(g32[i]-wantG[i]) > 1e-6 {
						return fmt.Errorf("float32 gradient element %d: %v, float64 %v", i, g32[i], wantG[i])
					}
				}
				s, err := placement.NewSpec(m, c.shape, comm.Float64, vp)
				if err != nil {
					return err
				}
				x, err := placement.FromFull(s, placementtest.Random(c.shape, comm.Float64, 5))
				if err != nil {
					return err
				}
				ix, err := autograd.IndicesFromFull(m, c.shape[:1], tpl, vceTargets(c.shape[0], c.shape[1]))
				if err != nil {
					return err
				}
				return autograd.CheckGrad(ctx, func(tape *autograd.Tape, ps []*autograd.Value) (*autograd.Value, error) {
					return tp.VocabParallelCrossEntropy(ctx, ps[0], ix, "tp")
				}, x)
			})
		})
	}
}

// TestVocabParallelCrossEntropyCommunication: the forward issues two
// collectives on the vocab axis (the max, then the pairs), the backward
// none, and nothing runs on the dp axis.
func TestVocabParallelCrossEntropyCommunication(t *testing.T) {
	placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
		s, err := placement.NewSpec(m, []int{6, 5}, comm.Float64, []placement.Placement{S0, S1})
		if err != nil {
			return err
		}
		x, err := placement.FromFull(s, placementtest.Random([]int{6, 5}, comm.Float64, 3))
		if err != nil {
			return err
		}
		ix, err := autograd.IndicesFromFull(m, []int{6}, []placement.Placement{S0, R}, vceTargets(6, 5))
		if err != nil {
			return err
		}
		tpc, err := m.Comm(ctx, "tp")
		if err != nil {
			return err
		}
		dpc, err := m.Comm(ctx, "dp")
		if err != nil {
			return err
		}
		count := func() [2]uint64 {
			return [2]uint64{tpc.Recorder().Snapshot().Total, dpc.Recorder().Snapshot().Total}
		}
		tape := autograd.NewTape()
		v, _ := tape.Param("logits", x)
		c0 := count()
		loss, err := tp.VocabParallelCrossEntropy(ctx, v, ix, "tp")
		if err != nil {
			return err
		}
		c1 := count()
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		c2 := count()
		if got := [2]uint64{c1[0] - c0[0], c1[1] - c0[1]}; got != [2]uint64{2, 0} {
			return fmt.Errorf("forward: %d collectives on tp and %d on dp, want 2 and 0", got[0], got[1])
		}
		if got := [2]uint64{c2[0] - c1[0], c2[1] - c1[1]}; got != [2]uint64{0, 0} {
			return fmt.Errorf("backward: %d collectives on tp and %d on dp, want none", got[0], got[1])
		}
		if got := fmt.Sprint(v.Grad().Spec().Placements()); got != "[S(0) S(1)]" {
			return fmt.Errorf("logits gradient %s, want [S(0) S(1)]", got)
		}
		return nil
	})
}

// TestVocabParallelTiedEmbedding is Megatron's tied vocab-parallel
// embedding and output layer: the table [V, D] is Shard(0) on tp, the
// lookup is Partial(sum) on tp and all-reduced, the logits are the colwise
// product with the same table (Shard(1) on tp) and the loss never gathers
// them. Finite differences check the table's gradient, which arrives
// Shard(0) from both uses.
func TestVocabParallelTiedEmbedding(t *testing.T) {
	placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		R, S0 := placement.Replicate(), placement.Shard(0)
		const v, d = 5, 3
		s, err := placement.NewSpec(m, []int{v, d}, comm.Float64, []placement.Placement{R, S0})
		if err != nil {
			return err
		}
		wte, err := placement.FromFull(s, placementtest.Random([]int{v, d}, comm.Float64, 2))
		if err != nil {
			return err
		}
		rows := []placement.Placement{S0, R}
		ids, err := autograd.IndicesFromFull(m, []int{6}, rows, []int64{0, 4, 2, 2, 1, 3})
		if err != nil {
			return err
		}
		targets, err := autograd.IndicesFromFull(m, []int{6}, rows, []int64{4, 2, 2, 1, 3, 0})
		if err != nil {
			return err
		}
		f := func(tape *autograd.Tape, ps []*autograd.Value) (*autograd.Value, error) {
			h, err := autograd.Embedding(ps[0], ids) // [6 3] [S(0) P(sum)]
			if err != nil {
				return nil, err
			}
			hs, err := h.Spec().With(rows)
			if err != nil {
				return nil, err
			}
			if h, err = autograd.Redistribute(ctx, h, hs); err != nil {
				return nil, err
			}
			logits, err := autograd.Linear(h, ps[0], nil) // colwise: [6 5] [S(0) S(1)]
			if err != nil {
				return nil, err
			}
			return tp.VocabParallelCrossEntropy(ctx, logits, targets, "tp")
		}
		tape := autograd.NewTape()
		p, _ := tape.Param("wte", wte)
		loss, err := f(tape, []*autograd.Value{p})
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if got := fmt.Sprint(p.Grad().Spec().Placements()); got != "[P(sum) S(0)]" {
			return fmt.Errorf("table gradient %s, want [P(sum) S(0)]", got)
		}
		return autograd.CheckGrad(ctx, f, wte)
	})
}

// TestVocabParallelCrossEntropyRejects covers the layout and argument
// errors, all returned before any communication.
func TestVocabParallelCrossEntropyRejects(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	for _, c := range []struct {
		name    string
		shape   []int
		places  pl
		tplaces pl
		targets []int64
		axis    string
		rule    bool
		text    string
	}{
		{name: "not sharded", shape: []int{4, 5}, places: pl{R, R}, tplaces: pl{R, R}, axis: "tp", rule: true,
			text: `the logits are R on mesh axis "tp"; they must be S(1) (vocab sharded) there`},
		{name: "rows on axis", shape: []int{4, 5}, places: pl{R, S0}, tplaces: pl{R, S0}, axis: "tp", rule: true,
			text: `the logits are S(0) on mesh axis "tp"; they must be S(1)`},
		{name: "two vocab axes", shape: []int{4, 5}, places: pl{S1, S1}, tplaces: pl{R, R}, axis: "tp", rule: true,
			text: `the vocab dim is sharded over mesh axes [dp tp]; only "tp" may shard it`},
		{name: "partial", shape: []int{4, 5}, places: pl{placement.Partial(comm.Sum), S1}, tplaces: pl{R, R}, axis: "tp", rule: true,
			text: `the logits are P(sum) on mesh axis "dp"; cross entropy is nonlinear`},
		{name: "targets layout", shape: []int{4, 5}, places: pl{S0, S1}, tplaces: pl{R, R}, axis: "tp", rule: true,
			text: `the logits are S(0) but the targets are R on mesh axis "dp"`},
		{name: "targets on axis", shape: []int{4, 5}, places: pl{R, S1}, tplaces: pl{R, S0}, axis: "tp", rule: true,
			text: `the logits are R but the targets are S(0) on mesh axis "tp"`},
		{name: "target range", shape: []int{4, 5}, places: pl{R, S1}, tplaces: pl{R, R}, targets: []int64{0, 5, 1, 2}, axis: "tp",
			text: "target 5 out of range for 5 classes"},
		{name: "unknown axis", shape: []int{4, 5}, places: pl{R, S1}, tplaces: pl{R, R}, axis: "vocab",
			text: `has no axis "vocab"`},
		{name: "1-d", shape: []int{5}, places: pl{R, S0}, tplaces: pl{R, R}, axis: "tp",
			text: "want logits [N, V] or [..., V]; got [5]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				s, err := placement.NewSpec(m, c.shape, comm.Float64, c.places)
				if err != nil {
					return err
				}
				x, err := placementtest.Distribute(s, placementtest.Random(c.shape, comm.Float64, 1), 2)
				if err != nil {
					return err
				}
				tg := c.targets
				if tg == nil {
					tg = make([]int64, c.shape[0])
				}
				ix, err := autograd.IndicesFromFull(m, c.shape[:1], c.tplaces, tg)
				if err != nil {
					return err
				}
				tape := autograd.NewTape()
				v, _ := tape.Param("logits", x)
				_, err = tp.VocabParallelCrossEntropy(ctx, v, ix, c.axis)
				if !errors.Is(err, tp.ErrInvalid) || (c.rule && !errors.Is(err, autograd.ErrRule)) || !strings.Contains(err.Error(), c.text) {
					return fmt.Errorf("error %v, want ErrInvalid (ErrRule: %v) containing %q", err, c.rule, c.text)
				}
				return nil
			})
		})
	}
}

// TestVocabParallelCrossEntropyNestedRows: rows sharded over two axes in
// mesh order match autograd.CrossEntropy; in another order they are an
// error (the loss's local functions lay rows out in mesh order).
func TestVocabParallelCrossEntropyNestedRows(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	placementtest.Run(t, []int{2, 2, 2}, []string{"dp", "cp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		shape := []int{7, 5}
		_, wantL, wantG, err := vceRun(ctx, m, comm.Float64, shape, pl{S0, S0, R}, pl{S0, S0, R}, false)
		if err != nil {
			return err
		}
		_, gotL, gotG, err := vceRun(ctx, m, comm.Float64, shape, pl{S0, S0, S1}, pl{S0, S0, R}, true)
		if err != nil {
			return err
		}
		if math.Abs(gotL-wantL) > 1e-12 {
			return fmt.Errorf("loss %v, CrossEntropy's %v", gotL, wantL)
		}
		for i := range wantG {
			if math.Abs(gotG[i]-wantG[i]) > 1e-12 {
				return fmt.Errorf("gradient element %d: %v, CrossEntropy's %v", i, gotG[i], wantG[i])
			}
		}
		s, err := placement.NewSpec(m, shape, comm.Float64, pl{S0, S0, S1}, placement.WithOrder(0, "cp", "dp"))
		if err != nil {
			return err
		}
		x, err := placement.FromFull(s, placementtest.Random(shape, comm.Float64, 1))
		if err != nil {
			return err
		}
		ix, err := autograd.IndicesFromFull(m, shape[:1], pl{S0, S0, R}, vceTargets(7, 5), placement.WithOrder(0, "cp", "dp"))
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		v, _ := tape.Param("logits", x)
		if _, err := tp.VocabParallelCrossEntropy(ctx, v, ix, "tp"); !errors.Is(err, autograd.ErrRule) || !strings.Contains(err.Error(), "dim 0 is sharded over mesh axes [cp dp], not in mesh order") {
			return fmt.Errorf("rows in another order: %v", err)
		}
		return nil
	})
}
