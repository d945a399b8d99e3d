package autograd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// nnCases builds one fdCase per placement list, with the given shapes.
func nnCases(mesh []int, shapes [][]int, op func(context.Context, []*Value) (*Value, error), places ...[]pl) []fdCase {
	var out []fdCase
	for _, p := range places {
		out = append(out, fdCase{mesh: mesh, shapes: shapes, places: p, op: op})
	}
	return out
}

func TestGradLinear(t *testing.T) {
	withB := func(_ context.Context, ps []*Value) (*Value, error) { return Linear(ps[0], ps[1], ps[2]) }
	noB := func(_ context.Context, ps []*Value) (*Value, error) { return Linear(ps[0], ps[1], nil) }
	x2, x3, w, b := []int{5, 4}, []int{2, 3, 4}, []int{3, 4}, []int{3}
	var cases []fdCase
	cases = append(cases, nnCases([]int{2}, [][]int{x2, w, b}, withB,
		[]pl{{R}, {R}, {R}},
		[]pl{{S0}, {R}, {R}},   // data parallel
		[]pl{{R}, {S0}, {S0}},  // colwise
		[]pl{{S1}, {S1}, {R}},  // rowwise: bias on coordinate 0
		[]pl{{Psum}, {R}, {R}}, // partial x
	)...)
	cases = append(cases, nnCases([]int{2}, [][]int{x3, w, b}, withB,
		[]pl{{S1}, {R}, {R}},
		[]pl{{placement.Shard(2)}, {S1}, {R}},
	)...)
	cases = append(cases, nnCases([]int{2}, [][]int{x2, w}, noB, []pl{{R}, {S0}}, []pl{{S1}, {S1}})...)
	cases = append(cases, nnCases([]int{4}, [][]int{x2, w, b}, withB,
		[]pl{{S0}, {R}, {R}},
		[]pl{{R}, {S0}, {S0}}, // 3 outputs over 4 ranks: one empty shard
		[]pl{{S1}, {S1}, {R}},
	)...)
	cases = append(cases, nnCases([]int{2, 2}, [][]int{x3, w, b}, withB,
		[]pl{{S0, placement.Shard(2)}, {R, S1}, {R, R}}, // dp + rowwise
		[]pl{{S1, R}, {R, S0}, {R, S0}},                 // dp + colwise
		[]pl{{placement.Shard(2), placement.Shard(2)}, {S1, S1}, {R, R}},
		[]pl{{R, R}, {S0, S0}, {S0, S0}},
	)...)
	runFD(t, cases)
}

// TestGradMegatronMLP: fc colwise, GELU, proj rowwise on tp, batch on dp,
// both with biases; the proj output is Partial(sum) on tp and reduced
// explicitly.
func TestGradMegatronMLP(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		mk := func(shape []int, p pl, seed uint64) *placement.DTensor {
			d, err := random(m, shape, p, seed)
			if err != nil {
				t.Fatal(err)
			}
			return d
		}
		x := mk([]int{4, 3}, pl{S0, R}, 1)
		w1, b1 := mk([]int{4, 3}, pl{R, S0}, 2), mk([]int{4}, pl{R, S0}, 3)
		w2, b2 := mk([]int{3, 4}, pl{R, S1}, 4), mk([]int{3}, pl{R, R}, 5)
		f := func(tp *Tape, ps []*Value) (*Value, error) {
			h, err := Linear(ps[0], ps[1], ps[2]) // [S0, S1]
			if err != nil {
				return nil, err
			}
			if h, err = GELU(h); err != nil {
				return nil, err
			}
			y, err := Linear(h, ps[3], ps[4]) // [S0, P(sum)]
			if err != nil {
				return nil, err
			}
			if got := fmt.Sprint(y.Spec().Placements()); got != "[S(0) P(sum)]" {
				return nil, fmt.Errorf("proj output %s", got)
			}
			ys, err := y.Spec().With(pl{S0, R})
			if err != nil {
				return nil, err
			}
			if y, err = Redistribute(ctx, y, ys); err != nil {
				return nil, err
			}
			return probe(ctx, y)
		}
		return CheckGrad(ctx, f, x, w1, b1, w2, b2)
	})
}

func TestGradShapeOps(t *testing.T) {
	var cases []fdCase
	tr := func(_ context.Context, ps []*Value) (*Value, error) { return Transpose(ps[0], 0, -1) }
	perm := func(_ context.Context, ps []*Value) (*Value, error) { return Permute(ps[0], 1, 2, 0) }
	sh := [][]int{{4, 3, 2}}
	cases = append(cases, nnCases([]int{2}, sh, tr, []pl{{R}}, []pl{{S0}}, []pl{{placement.Shard(2)}}, []pl{{Psum}})...)
	cases = append(cases, nnCases([]int{2, 2}, sh, perm, []pl{{S0, S1}}, []pl{{S1, Psum}})...)
	cases = append(cases, nnCases([]int{4}, sh, perm, []pl{{S0}})...)
	// Reshape: split and merge a sharded leading dim, keep a sharded
	// trailing dim.
	split := func(_ context.Context, ps []*Value) (*Value, error) { return Reshape(ps[0], 4, 3, -1) }
	merge := func(_ context.Context, ps []*Value) (*Value, error) { return Reshape(ps[0], 12, 2) }
	cases = append(cases, nnCases([]int{2}, [][]int{{12, 2}}, split, []pl{{S0}}, []pl{{S1}}, []pl{{Psum}})...)
	cases = append(cases, nnCases([]int{4}, [][]int{{12, 2}}, split, []pl{{S0}})...)
	cases = append(cases, nnCases([]int{2, 2}, [][]int{{4, 3, 2}}, merge, []pl{{S0, placement.Shard(2)}}, []pl{{S0, S0}})...)
	runFD(t, cases)
}

func TestGradNonlinear(t *testing.T) {
	gelu := func(_ context.Context, ps []*Value) (*Value, error) { return GELU(ps[0]) }
	sm := func(_ context.Context, ps []*Value) (*Value, error) { return Softmax(ps[0], -1) }
	sm0 := func(_ context.Context, ps []*Value) (*Value, error) { return Softmax(ps[0], 0) }
	lsm := func(_ context.Context, ps []*Value) (*Value, error) { return LogSoftmax(ps[0], 1) }
	ln := func(_ context.Context, ps []*Value) (*Value, error) { return LayerNorm(ps[0], ps[1], ps[2], 1e-5) }
	sh := [][]int{{5, 4}}
	var cases []fdCase
	cases = append(cases, nnCases([]int{2}, sh, gelu, []pl{{R}}, []pl{{S0}}, []pl{{S1}})...)
	cases = append(cases, nnCases([]int{4}, sh, gelu, []pl{{S1}})...)
	cases = append(cases, nnCases([]int{2}, sh, sm, []pl{{R}}, []pl{{S0}})...)
	cases = append(cases, nnCases([]int{2}, sh, sm0, []pl{{S1}})...)
	cases = append(cases, nnCases([]int{4}, sh, lsm, []pl{{S0}})...)
	cases = append(cases, nnCases([]int{2, 2}, sh, lsm, []pl{{S0, S0}}, []pl{{R, S0}})...)
	lnSh := [][]int{{5, 4}, {4}, {4}}
	cases = append(cases, nnCases([]int{2}, lnSh, ln, []pl{{R}, {R}, {R}}, []pl{{S0}, {R}, {R}})...)
	cases = append(cases, nnCases([]int{4}, lnSh, ln, []pl{{S0}, {R}, {R}})...)
	cases = append(cases, nnCases([]int{2, 2}, [][]int{{2, 3, 4}, {4}, {4}}, ln, []pl{{S0, S1}, {R, R}, {R, R}})...)
	runFD(t, cases)
}

func TestGradEmbedding(t *testing.T) {
	// Rows 2 and 5 of the table are never used: their gradient is exactly 0.
	full := []int64{0, 3, 1, 3, 4, 0}
	var cases []fdCase
	for _, c := range []struct {
		mesh []int
		ids  pl
	}{{[]int{2}, pl{R}}, {[]int{2}, pl{S0}}, {[]int{2}, pl{S1}}, {[]int{4}, pl{S1}}, {[]int{2, 2}, pl{S0, S1}}} {
		ids := c.ids
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{{6, 3}}, places: []pl{replicated(len(c.mesh))},
			op: func(_ context.Context, ps []*Value) (*Value, error) {
				ix, err := IndicesFromFull(ps[0].Spec().Mesh(), []int{2, 3}, ids, full)
				if err != nil {
					return nil, err
				}
				return Embedding(ps[0], ix)
			}})
	}
	runFD(t, cases)
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		tab, err := random(m, []int{6, 3}, pl{R}, 3)
		if err != nil {
			return err
		}
		tp := NewTape()
		p, _ := tp.Param("wte", tab)
		ix, err := IndicesFromFull(m, []int{2, 3}, pl{S0}, full)
		if err != nil {
			return err
		}
		e, err := Embedding(p, ix)
		if err != nil {
			return err
		}
		loss, err := probe(ctx, e)
		if err != nil {
			return err
		}
		if err := tp.Backward(ctx, loss); err != nil {
			return err
		}
		if got := fmt.Sprint(p.Grad().Spec().Placements()); got != "[P(sum)]" {
			t.Errorf("table gradient %s, want [P(sum)]", got)
		}
		g, err := fullData(ctx, p.Grad())
		if err != nil {
			return err
		}
		for _, row := range []int{2, 5} {
			for k := range 3 {
				if v := g[row*3+k]; v != 0 {
					t.Errorf("unused row %d: gradient %v, want exactly 0", row, v)
				}
			}
		}
		return nil
	})
}

func replicated(n int) pl {
	p := make(pl, n)
	for i := range p {
		p[i] = R
	}
	return p
}

func TestGradCrossEntropy(t *testing.T) {
	targets := []int64{1, 0, 4, 4, 2, 3}
	var cases []fdCase
	for _, c := range []struct {
		mesh []int
		p    pl
		tp   pl
	}{
		{[]int{2}, pl{R}, pl{R}},
		{[]int{2}, pl{S0}, pl{S0}},
		{[]int{4}, pl{S0}, pl{S0}},
		{[]int{2, 2}, pl{S0, R}, pl{S0, R}},
		{[]int{2, 2}, pl{S0, S0}, pl{S0, S0}},
	} {
		tpl := c.tp
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{{6, 5}}, places: []pl{c.p},
			op: func(_ context.Context, ps []*Value) (*Value, error) {
				ix, err := IndicesFromFull(ps[0].Spec().Mesh(), []int{6}, tpl, targets)
				if err != nil {
					return nil, err
				}
				return CrossEntropy(ps[0], ix)
			}})
	}
	runFD(t, cases)
	// The loss is the global mean whatever the row sharding, and as a
	// loss (not through probe) it backpropagates from the default seed.
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		var want float64
		for i, p := range []pl{{R}, {S0}} {
			x, err := random(m, []int{6, 5}, p, 9)
			if err != nil {
				return err
			}
			ix, err := IndicesFromFull(m, []int{6}, p, targets)
			if err != nil {
				return err
			}
			tp := NewTape()
			v, _ := tp.Param("logits", x)
			loss, err := CrossEntropy(v, ix)
			if err != nil {
				return err
			}
			l, err := fullData(ctx, loss.Data())
			if err != nil {
				return err
			}
			if i == 0 {
				want = l[0]
			} else if d := l[0] - want; d > 1e-12 || d < -1e-12 {
				t.Errorf("sharded loss %v, replicated %v", l[0], want)
			}
			if err := CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) { return CrossEntropy(ps[0], ix) }, x); err != nil {
				return err
			}
		}
		return nil
	})
}

// tinyBlock is a small tensor- and data-parallel network on a ("dp","tp")
// mesh using every op of this file: embedding, layer norm, a colwise and
// a rowwise Linear with GELU in between, an explicit all-reduce, shape
// ops and the cross-entropy loss, with rows sharded on dp.
func tinyBlock(ctx context.Context, ids, targets *Indices) LossFunc {
	return func(tp *Tape, ps []*Value) (*Value, error) {
		e, err := Embedding(ps[0], ids) // [2 3 4] [S0 R]
		if err != nil {
			return nil, err
		}
		if e, err = LayerNorm(e, ps[1], ps[2], 1e-5); err != nil {
			return nil, err
		}
		h, err := Linear(e, ps[3], ps[4]) // [2 3 6] [S0 S2]
		if err != nil {
			return nil, err
		}
		if h, err = GELU(h); err != nil {
			return nil, err
		}
		y, err := Linear(h, ps[5], ps[6]) // [2 3 4] [S0 P(sum)]
		if err != nil {
			return nil, err
		}
		ys, err := y.Spec().With(pl{S0, R})
		if err != nil {
			return nil, err
		}
		if y, err = Redistribute(ctx, y, ys); err != nil {
			return nil, err
		}
		if y, err = Transpose(y, 1, 2); err != nil {
			return nil, err
		}
		if y, err = Transpose(y, 1, 2); err != nil {
			return nil, err
		}
		if y, err = Reshape(y, 6, 4); err != nil {
			return nil, err
		}
		if y, err = LogSoftmax(y, -1); err != nil {
			return nil, err
		}
		return CrossEntropy(y, targets)
	}
}

func tinyParams(m *mesh.Mesh, dt comm.DType) ([]*placement.DTensor, error) {
	var out []*placement.DTensor
	for i, c := range []struct {
		shape []int
		p     pl
	}{
		{[]int{7, 4}, pl{R, R}}, {[]int{4}, pl{R, R}}, {[]int{4}, pl{R, R}},
		{[]int{6, 4}, pl{R, S0}}, {[]int{6}, pl{R, S0}},
		{[]int{4, 6}, pl{R, S1}}, {[]int{4}, pl{R, R}},
	} {
		s, err := placement.NewSpec(m, c.shape, dt, c.p)
		if err != nil {
			return nil, err
		}
		d, err := placement.FromFull(s, placementtest.Random(c.shape, dt, uint64(40+i)))
		if err != nil {
			return nil, err
		}
		out = append(out, d)
	}
	return out, nil
}

// TestGradTinyBlock checks the whole network by finite differences and
// its float32 path against float64.
func TestGradTinyBlock(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		ids, err := IndicesFromFull(m, []int{2, 3}, pl{S0, R}, []int64{1, 5, 0, 5, 2, 6})
		if err != nil {
			return err
		}
		targets, err := IndicesFromFull(m, []int{6}, pl{S0, R}, []int64{3, 0, 1, 1, 2, 0})
		if err != nil {
			return err
		}
		f := tinyBlock(ctx, ids, targets)
		grads := map[comm.DType][][]float64{}
		for _, dt := range []comm.DType{comm.Float64, comm.Float32} {
			ps, err := tinyParams(m, dt)
			if err != nil {
				return err
			}
			if dt == comm.Float64 {
				if err := CheckGrad(ctx, f, ps...); err != nil {
					return err
				}
			}
			tp := NewTape()
			vs, err := wrapParams(tp, ps)
			if err != nil {
				return err
			}
			loss, err := f(tp, vs)
			if err != nil {
				return err
			}
			if got := fmt.Sprint(loss.Spec().Placements()); got != "[P(sum) R]" {
				t.Errorf("loss placements %s", got)
			}
			if err := tp.Backward(ctx, loss); err != nil {
				return err
			}
			for _, v := range vs {
				g, err := fullData(ctx, v.Grad())
				if err != nil {
					return err
				}
				grads[dt] = append(grads[dt], g)
			}
		}
		for i := range grads[comm.Float64] {
			for j, want := range grads[comm.Float64][i] {
				if got := grads[comm.Float32][i][j]; math.Abs(got-want) > 1e-4*max(1, math.Abs(want)) {
					t.Errorf("param %d element %d: float32 gradient %v, float64 %v", i, j, got, want)
				}
			}
		}
		return nil
	})
}

// TestNNInvalid: out-of-range ids and targets are rejected before any
// data moves.
func TestNNInvalid(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		x, err := random(m, []int{4, 3}, pl{R}, 1)
		if err != nil {
			return err
		}
		tp := NewTape()
		v, _ := tp.Param("x", x)
		ids, err := IndicesFromFull(m, []int{2}, pl{R}, []int64{0, 4})
		if err != nil {
			return err
		}
		if _, err := Embedding(v, ids); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "id 4 out of range for a table of 4 rows") {
			t.Errorf("embedding: %v", err)
		}
		tg, err := IndicesFromFull(m, []int{4}, pl{R}, []int64{0, 1, 2, -1})
		if err != nil {
			return err
		}
		if _, err := CrossEntropy(v, tg); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "target -1 out of range for 3 classes") {
			t.Errorf("cross entropy: %v", err)
		}
		if _, err := Softmax(v, 0); err != nil {
			t.Errorf("softmax: %v", err)
		}
		return nil
	})
}
