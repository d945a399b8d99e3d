package autograd_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// rotate is a custom op that communicates in both directions: x [p·b, d]
// is Shard(0) over the axis, and the result's block r is x's block r−1
// (mod p). Forward sends this rank's block to rank r+1 with an
// all-to-all-v; backward sends the gradient's block back to rank r−1.
func rotate(ctx context.Context, m *mesh.Mesh, x *autograd.Value) (*autograd.Value, error) {
	c, err := m.Comm(ctx, "x")
	if err != nil {
		return nil, err
	}
	p, r := c.Size(), c.Rank()
	shift := func(src *placement.DTensor, to int) (*placement.DTensor, error) {
		data := src.LocalData().([]float64)
		send, recv := make([]int, p), make([]int, p)
		send[to] = len(data)
		recv[(2*r-to+p)%p] = len(data) // the peer that sends to us
		out := make([]float64, len(data))
		if err := comm.AllToAllV(ctx, c, comm.Host(data), comm.Host(out), send, recv); err != nil {
			return nil, err
		}
		return placement.NewLocal(src.Spec(), out)
	}
	return autograd.Custom("rotate", []*autograd.Value{x},
		func() (*placement.DTensor, error) { return shift(x.Data(), (r+1)%p) },
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			if !g.Spec().Equal(x.Spec()) {
				return nil, fmt.Errorf("%w: gradient %v, want %v", autograd.ErrGradPlacement, g.Spec(), x.Spec())
			}
			dx, err := shift(g, (r-1+p)%p)
			return []*placement.DTensor{dx}, err
		})
}

// TestCustomGrad checks a custom op whose forward and backward both run
// collectives against central finite differences of a nonlinear loss,
// Σ rotate(x)²·w, on 1, 2, 3 and 4 ranks.
func TestCustomGrad(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4} {
		t.Run(fmt.Sprintf("p=%d", p), func(t *testing.T) {
			placementtest.Run(t, []int{p}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				spec, err := placement.NewSpec(m, []int{2 * p, 3}, comm.Float64, []placement.Placement{placement.Shard(0)})
				if err != nil {
					return err
				}
				x0, err := placement.FromFull(spec, placementtest.Random([]int{2 * p, 3}, comm.Float64, 1))
				if err != nil {
					return err
				}
				wd, err := placement.FromFull(spec, placementtest.Random([]int{2 * p, 3}, comm.Float64, 2))
				if err != nil {
					return err
				}
				return autograd.CheckGrad(ctx, func(tp *autograd.Tape, params []*autograd.Value) (*autograd.Value, error) {
					y, err := rotate(ctx, m, params[0])
					if err != nil {
						return nil, err
					}
					w, err := tp.Constant(wd)
					if err != nil {
						return nil, err
					}
					y2, err := autograd.Mul(y, y)
					if err != nil {
						return nil, err
					}
					yw, err := autograd.Mul(y2, w)
					if err != nil {
						return nil, err
					}
					return autograd.Sum(yw)
				}, x0)
			})
		})
	}
}

// TestCustomErrors: bad arguments are rejected before forward runs, and
// bad gradients when backward returns them, each with a clear message.
func TestCustomErrors(t *testing.T) {
	ctx := context.Background()
	err := placementtest.Simulate(ctx, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{2, 2}, comm.Float64, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		mk := func() *placement.DTensor {
			d, _ := placement.FromFull(spec, placementtest.Random([]int{2, 2}, comm.Float64, 3))
			return d
		}
		other, err := placement.NewSpec(m, []int{2, 3}, comm.Float64, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		f32, err := placement.NewSpec(m, []int{2, 2}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		ident := func() (*placement.DTensor, error) { return mk(), nil }
		boom := errors.New("boom")
		noBack := func(context.Context, *placement.DTensor) ([]*placement.DTensor, error) { return nil, nil }
		type tc struct {
			name     string
			run      func(tp *autograd.Tape, x *autograd.Value) error
			want     error
			text     string
			forwards int // how often forward may have run
		}
		var ran int
		counted := func() (*placement.DTensor, error) { ran++; return mk(), nil }
		// backwardWith runs a loss through a custom op whose backward
		// returns grads.
		backwardWith := func(tp *autograd.Tape, x *autograd.Value, back autograd.CustomBackward) error {
			y, err := autograd.Custom("op", []*autograd.Value{x}, ident, back)
			if err != nil {
				return err
			}
			s, err := autograd.Sum(y)
			if err != nil {
				return err
			}
			return tp.Backward(ctx, s)
		}
		cases := []tc{
			{name: "no name", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("", []*autograd.Value{x}, counted, nil)
				return err
			}, want: autograd.ErrInvalid, text: "no name"},
			{name: "no inputs", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", nil, counted, nil)
				return err
			}, want: autograd.ErrInvalid, text: "no inputs"},
			{name: "nil input", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", []*autograd.Value{x, nil}, counted, nil)
				return err
			}, want: autograd.ErrInvalid, text: "input 1 is nil"},
			{name: "nil forward", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", []*autograd.Value{x}, nil, nil)
				return err
			}, want: autograd.ErrInvalid, text: "nil forward"},
			{name: "nil backward when recorded", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", []*autograd.Value{x}, counted, nil)
				return err
			}, want: autograd.ErrInvalid, text: "nil backward"},
			{name: "forward error", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", []*autograd.Value{x}, func() (*placement.DTensor, error) { return nil, boom }, noBack)
				return err
			}, want: boom, text: "op: forward: boom", forwards: -1},
			{name: "forward nil result", run: func(tp *autograd.Tape, x *autograd.Value) error {
				_, err := autograd.Custom("op", []*autograd.Value{x}, func() (*placement.DTensor, error) { return nil, nil }, noBack)
				return err
			}, want: autograd.ErrInvalid, text: "nil tensor", forwards: -1},
			{name: "too few gradients", run: func(tp *autograd.Tape, x *autograd.Value) error {
				return backwardWith(tp, x, func(context.Context, *placement.DTensor) ([]*placement.DTensor, error) { return nil, nil })
			}, want: autograd.ErrInvalid, text: "0 gradients for 1 inputs", forwards: -1},
			{name: "gradient shape", run: func(tp *autograd.Tape, x *autograd.Value) error {
				return backwardWith(tp, x, func(context.Context, *placement.DTensor) ([]*placement.DTensor, error) {
					g, _ := placement.FromFull(other, placementtest.Random([]int{2, 3}, comm.Float64, 4))
					return []*placement.DTensor{g}, nil
				})
			}, want: autograd.ErrInvalid, text: "global shape [2 3]", forwards: -1},
			{name: "gradient dtype", run: func(tp *autograd.Tape, x *autograd.Value) error {
				return backwardWith(tp, x, func(context.Context, *placement.DTensor) ([]*placement.DTensor, error) {
					g, _ := placement.FromFull(f32, placementtest.Random([]int{2, 2}, comm.Float32, 4))
					return []*placement.DTensor{g}, nil
				})
			}, want: autograd.ErrInvalid, text: "float32", forwards: -1},
			{name: "backward error", run: func(tp *autograd.Tape, x *autograd.Value) error {
				return backwardWith(tp, x, func(context.Context, *placement.DTensor) ([]*placement.DTensor, error) { return nil, boom })
			}, want: boom, text: "op: backward: boom", forwards: -1},
		}
		for _, c := range cases {
			ran = 0
			tp := autograd.NewTape()
			x, err := tp.Param("x", mk())
			if err != nil {
				return err
			}
			err = c.run(tp, x)
			if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.text) {
				t.Errorf("%s: error %v, want %v containing %q", c.name, err, c.want, c.text)
			}
			if c.forwards >= 0 && ran > c.forwards {
				t.Errorf("%s: forward ran %d times before the arguments were rejected", c.name, ran)
			}
		}

		// Inputs from different tapes are rejected before forward runs.
		ran = 0
		a, _ := autograd.NewTape().Param("a", mk())
		b, _ := autograd.NewTape().Param("b", mk())
		if _, err := autograd.Custom("op", []*autograd.Value{a, b}, counted, nil); !errors.Is(err, autograd.ErrInvalid) || ran != 0 {
			t.Errorf("two tapes: error %v, forward ran %d times", err, ran)
		}

		// Under NoGrad (or with constants only) no backward is needed and
		// the result does not require grad.
		tp := autograd.NewTape()
		x, _ := tp.Param("x", mk())
		var y *autograd.Value
		if err := tp.NoGrad(func() error {
			var err error
			y, err = autograd.Custom("op", []*autograd.Value{x}, ident, nil)
			return err
		}); err != nil || y.RequiresGrad() || tp.Len() != 0 {
			t.Errorf("NoGrad: error %v, requires grad %v, %d ops recorded", err, y != nil && y.RequiresGrad(), tp.Len())
		}

		// A gradient returned for a constant input is ignored; the
		// parameter's arrives.
		tp = autograd.NewTape()
		x, _ = tp.Param("x", mk())
		k, _ := tp.Constant(mk())
		y, err = autograd.Custom("pair", []*autograd.Value{x, k}, ident, func(_ context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			return []*placement.DTensor{g, g}, nil
		})
		if err != nil {
			return err
		}
		s, err := autograd.Sum(y)
		if err != nil {
			return err
		}
		if err := tp.Backward(ctx, s); err != nil {
			return err
		}
		if x.Grad() == nil || k.Grad() != nil {
			t.Errorf("pair: x grad %v, constant grad %v", x.Grad(), k.Grad())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
