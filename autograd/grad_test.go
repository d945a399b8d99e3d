package autograd

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// fdCase is one finite-difference check: parameters of the given shapes
// and placements on a simulated mesh, an op applied to them, and the probe
// loss on its result.
type fdCase struct {
	mesh   []int
	shapes [][]int
	places []pl
	op     func(ctx context.Context, ps []*Value) (*Value, error)
}

func (c fdCase) String() string {
	return fmt.Sprintf("mesh%v/%v", c.mesh, c.places)
}

func runFD(t *testing.T, cases []fdCase) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			simulate(t, c.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				params := make([]*placement.DTensor, len(c.shapes))
				for i := range params {
					var err error
					if params[i], err = random(m, c.shapes[i], c.places[i], uint64(10*i+7)); err != nil {
						return err
					}
				}
				return CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
					out, err := c.op(ctx, ps)
					if err != nil {
						return nil, err
					}
					return probe(ctx, out)
				}, params...)
			})
		})
	}
}

func binary(f func(a, b *Value) (*Value, error)) func(context.Context, []*Value) (*Value, error) {
	return func(_ context.Context, ps []*Value) (*Value, error) { return f(ps[0], ps[1]) }
}

func pairs(mesh []int, shapeA, shapeB []int, op func(context.Context, []*Value) (*Value, error), ps ...[2]pl) []fdCase {
	var out []fdCase
	for _, p := range ps {
		out = append(out, fdCase{mesh: mesh, shapes: [][]int{shapeA, shapeB}, places: []pl{p[0], p[1]}, op: op})
	}
	return out
}

func TestGradAdd(t *testing.T) {
	op := binary(Add)
	sh := []int{5, 3}
	var cases []fdCase
	cases = append(cases, pairs([]int{2}, sh, sh, op, [2]pl{{R}, {R}}, [2]pl{{S0}, {S0}}, [2]pl{{S1}, {S1}}, [2]pl{{Psum}, {Psum}})...)
	cases = append(cases, pairs([]int{4}, sh, sh, op, [2]pl{{S0}, {S0}}, [2]pl{{S1}, {S1}})...)
	cases = append(cases, pairs([]int{2, 2}, sh, sh, op, [2]pl{{S0, S1}, {S0, S1}}, [2]pl{{Psum, S0}, {Psum, S0}})...)
	runFD(t, cases)
}

func TestGradMul(t *testing.T) {
	op := binary(Mul)
	sh := []int{5, 3}
	var cases []fdCase
	cases = append(cases, pairs([]int{2}, sh, sh, op, [2]pl{{R}, {R}}, [2]pl{{S0}, {S0}}, [2]pl{{S1}, {S1}})...)
	cases = append(cases, pairs([]int{4}, []int{3, 5}, []int{3, 5}, op, [2]pl{{S1}, {S1}}, [2]pl{{S0}, {S0}})...)
	cases = append(cases, pairs([]int{2, 2}, sh, sh, op, [2]pl{{S1, S0}, {S1, S0}})...)
	// The same value on both sides: gradients from two uses accumulate.
	cases = append(cases, fdCase{mesh: []int{2}, shapes: [][]int{sh}, places: []pl{{S0}},
		op: func(_ context.Context, ps []*Value) (*Value, error) { return Mul(ps[0], ps[0]) }})
	runFD(t, cases)
}

func TestGradScale(t *testing.T) {
	op := func(_ context.Context, ps []*Value) (*Value, error) { return Scale(ps[0], -2.5) }
	var cases []fdCase
	for _, c := range []struct {
		mesh []int
		p    pl
	}{{[]int{2}, pl{R}}, {[]int{2}, pl{S0}}, {[]int{2}, pl{Psum}}, {[]int{4}, pl{S1}}, {[]int{2, 2}, pl{S0, Psum}}} {
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{{5, 3}}, places: []pl{c.p}, op: op})
	}
	runFD(t, cases)
}

func TestGradSum(t *testing.T) {
	var cases []fdCase
	for _, c := range []struct {
		mesh []int
		p    pl
		dims []int
	}{
		{[]int{2}, pl{R}, []int{0}},
		{[]int{2}, pl{S0}, []int{0}}, // -> Partial(sum)
		{[]int{2}, pl{S0}, []int{1}},
		{[]int{2}, pl{S1}, nil}, // all dims -> scalar
		{[]int{2}, pl{Psum}, []int{1}},
		{[]int{4}, pl{S0}, nil},
		{[]int{4}, pl{S1}, []int{0}},
		{[]int{2, 2}, pl{S0, S1}, []int{1}},
		{[]int{2, 2}, pl{S0, S0}, []int{0}},
		{[]int{2, 2}, pl{Psum, S1}, nil},
	} {
		dims := c.dims
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{{5, 3}}, places: []pl{c.p},
			op: func(_ context.Context, ps []*Value) (*Value, error) { return Sum(ps[0], dims...) }})
	}
	runFD(t, cases)
}

func TestGradMatMul(t *testing.T) {
	op := binary(MatMul)
	a, b := []int{5, 3}, []int{3, 4}
	var cases []fdCase
	cases = append(cases, pairs([]int{2}, a, b, op,
		[2]pl{{S0}, {R}}, [2]pl{{R}, {S1}}, [2]pl{{S1}, {S0}}, [2]pl{{R}, {R}}, [2]pl{{Psum}, {R}}, [2]pl{{R}, {Psum}})...)
	cases = append(cases, pairs([]int{4}, a, b, op, [2]pl{{S1}, {S0}}, [2]pl{{S0}, {R}}, [2]pl{{R}, {S1}})...)
	cases = append(cases, pairs([]int{2, 2}, a, b, op,
		[2]pl{{S0, S1}, {R, S0}}, [2]pl{{S0, R}, {R, S1}}, [2]pl{{S1, S1}, {S0, S0}}, [2]pl{{Psum, S0}, {R, R}})...)
	runFD(t, cases)
}

func TestGradRedistribute(t *testing.T) {
	var cases []fdCase
	for _, c := range []struct {
		mesh     []int
		src, dst pl
	}{
		{[]int{2}, pl{R}, pl{S0}},
		{[]int{2}, pl{S0}, pl{R}},
		{[]int{2}, pl{S0}, pl{S1}},
		{[]int{2}, pl{Psum}, pl{R}},
		{[]int{2}, pl{Psum}, pl{S1}},
		{[]int{2}, pl{R}, pl{Psum}},
		{[]int{2}, pl{S1}, pl{Psum}},
		{[]int{2}, pl{Pavg}, pl{R}},
		{[]int{2}, pl{Pmax}, pl{R}},
		{[]int{2}, pl{Pmin}, pl{S0}},
		{[]int{4}, pl{S0}, pl{S1}},
		{[]int{4}, pl{Psum}, pl{S0}},
		{[]int{2, 2}, pl{S0, S1}, pl{R, R}},
		{[]int{2, 2}, pl{Psum, S0}, pl{S1, R}},
		{[]int{2, 2}, pl{R, R}, pl{S1, S0}},
		{[]int{2, 2}, pl{Pmax, S0}, pl{R, R}},
	} {
		dst := c.dst
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{{5, 3}}, places: []pl{c.src},
			op: func(ctx context.Context, ps []*Value) (*Value, error) {
				s, err := ps[0].Spec().With(dst)
				if err != nil {
					return nil, err
				}
				return Redistribute(ctx, ps[0], s)
			}})
	}
	runFD(t, cases)
}

// TestGradMLP: a tensor- and data-parallel two-layer network on a 2x2
// mesh, checked end to end: x is batch-sharded on dp, W1 colwise and W2
// rowwise on tp, a square in between, and the loss is Partial(sum) on dp.
func TestGradMLP(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		x, err := random(m, []int{5, 3}, pl{S0, R}, 1)
		if err != nil {
			return err
		}
		w1, err := random(m, []int{3, 4}, pl{R, S1}, 2)
		if err != nil {
			return err
		}
		w2, err := random(m, []int{4, 2}, pl{R, S0}, 3)
		if err != nil {
			return err
		}
		f := func(tp *Tape, ps []*Value) (*Value, error) {
			h, err := MatMul(ps[0], ps[1]) // [S0, S1]
			if err != nil {
				return nil, err
			}
			if h, err = Mul(h, h); err != nil {
				return nil, err
			}
			y, err := MatMul(h, ps[2]) // [S0, P(sum)]
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
			if y, err = Mul(y, y); err != nil {
				return nil, err
			}
			return Sum(y) // [P(sum), R]
		}
		if err := CheckGrad(ctx, f, x, w1, w2); err != nil {
			return err
		}
		// The weights' gradients are Partial(sum) on dp, for DDP to reduce;
		// x's is Partial(sum) on tp (it meets a tp-sharded W1).
		tp := NewTape()
		ps, err := wrapParams(tp, []*placement.DTensor{x, w1, w2})
		if err != nil {
			return err
		}
		loss, err := f(tp, ps)
		if err != nil {
			return err
		}
		if got := fmt.Sprint(loss.Spec().Placements()); got != "[P(sum) R]" {
			t.Errorf("loss placements %s", got)
		}
		if err := tp.Backward(ctx, loss); err != nil {
			return err
		}
		for i, want := range []string{"[S(0) P(sum)]", "[P(sum) S(1)]", "[P(sum) S(0)]"} {
			if got := fmt.Sprint(ps[i].Grad().Spec().Placements()); got != want {
				t.Errorf("param %d gradient placements %s, want %s", i, got, want)
			}
		}
		return nil
	})
}
