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
)

// biasGELU is a fused gelu(x + b) on local blocks: x is [rows, cols], b is
// [cols] (the bias is broadcast over rows). The placements are the
// caller's; the local code is the same for every layout.
func biasGELU(in, gradIn []pl, out, gradOut pl) LocalFunc[float64] {
	return LocalFunc[float64]{
		Name:    "bias_gelu",
		In:      in,
		GradIn:  gradIn,
		Out:     out,
		GradOut: gradOut,
		Forward: func(in []Block[float64]) (Block[float64], error) {
			x, b := in[0], in[1]
			if len(x.Shape) != 2 || len(b.Shape) != 1 || b.Shape[0] != x.Shape[1] {
				return Block[float64]{}, fmt.Errorf("blocks %v and %v do not line up", x.Shape, b.Shape)
			}
			cols := x.Shape[1]
			y := make([]float64, len(x.Data))
			for i, v := range x.Data {
				z := v + b.Data[i%cols]
				y[i] = 0.5 * z * (1 + math.Erf(z/math.Sqrt2))
			}
			return Block[float64]{Shape: x.Shape, Data: y}, nil
		},
		Backward: func(g Block[float64], in []Block[float64], _ Block[float64]) ([]Block[float64], error) {
			x, b := in[0], in[1]
			cols := x.Shape[1]
			gx := make([]float64, len(x.Data))
			gb := make([]float64, len(b.Data))
			for i, v := range x.Data {
				z := v + b.Data[i%cols]
				d := 0.5*(1+math.Erf(z/math.Sqrt2)) + z*math.Exp(-0.5*z*z)/math.Sqrt(2*math.Pi)
				gx[i] = g.Data[i] * d
				gb[i%cols] += g.Data[i] * d
			}
			return []Block[float64]{{Shape: x.Shape, Data: gx}, {Shape: b.Shape, Data: gb}}, nil
		},
	}
}

// TestLocalMapGrad checks the fused bias+GELU against finite differences
// with the input sharded by rows or columns over 2 and 4 ranks (including
// short and empty shards), on a 2-D mesh, and replicated with both
// declarations that are correct for replicated compute.
func TestLocalMapGrad(t *testing.T) {
	type layout struct {
		mesh       []int
		x, b       pl // input placements
		gx, gb     pl // their gradients
		out, gout  pl
		rows, cols int
	}
	cases := []layout{
		// Rows sharded, bias replicated: each rank's bias gradient sums only
		// its own rows, a P(sum) contribution.
		{[]int{2}, pl{S0}, pl{R}, pl{S0}, pl{Psum}, pl{S0}, pl{S0}, 5, 3},
		{[]int{4}, pl{S0}, pl{R}, pl{S0}, pl{Psum}, pl{S0}, pl{S0}, 5, 3},
		// Columns sharded, bias sharded alike: everything stays local.
		{[]int{2}, pl{S1}, pl{S0}, pl{S1}, pl{S0}, pl{S1}, pl{S1}, 3, 5},
		{[]int{4}, pl{S1}, pl{S0}, pl{S1}, pl{S0}, pl{S1}, pl{S1}, 3, 5},
		// Both on a 2-D mesh.
		{[]int{2, 2}, pl{S0, S1}, pl{R, S0}, pl{S0, S1}, pl{Psum, S0}, pl{S0, S1}, pl{S0, S1}, 5, 3},
		// Replicated compute, gradient arriving R: every rank's block is the
		// whole gradient.
		{[]int{2}, pl{R}, pl{R}, pl{R}, pl{R}, pl{R}, pl{R}, 4, 3},
		// Replicated compute fed a P(sum) gradient: Backward is linear in
		// it, so the input gradients are P(sum) too.
		{[]int{2}, pl{R}, pl{R}, pl{Psum}, pl{Psum}, pl{R}, pl{Psum}, 4, 3},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("mesh%v/x%v/b%v/gout%v", c.mesh, c.x, c.b, c.gout), func(t *testing.T) {
			f := biasGELU([]pl{c.x, c.b}, []pl{c.gx, c.gb}, c.out, c.gout)
			rows, cols := c.rows, c.cols
			simulate(t, c.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				x, err := random(m, []int{rows, cols}, c.x, 7)
				if err != nil {
					return err
				}
				b, err := random(m, []int{cols}, c.b, 17)
				if err != nil {
					return err
				}
				return CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
					y, err := f.Apply(ps[0], ps[1])
					if err != nil {
						return nil, err
					}
					if c.gout[0].IsPartial() {
						// Make the gradient arrive P(sum): a matmul with
						// column-sharded weights contracts over a sharded dim
						// in backward.
						return partialGradLoss(ctx, tp, y)
					}
					return probe(ctx, y)
				}, x, b)
			})
		})
	}
}

// partialGradLoss is Sum(y·W) for W [cols, 4] sharded by columns, so the
// gradient of the replicated y arrives Partial(sum).
func partialGradLoss(ctx context.Context, tp *Tape, y *Value) (*Value, error) {
	m := y.Spec().Mesh()
	w, err := random(m, []int{y.Spec().Shape()[1], 4}, pl{S1}, 99)
	if err != nil {
		return nil, err
	}
	wv, err := tp.Constant(w)
	if err != nil {
		return nil, err
	}
	p, err := MatMul(y, wv)
	if err != nil {
		return nil, err
	}
	return Sum(p)
}

// TestLocalMapWrongGradCaught shows what happens with each kind of wrong
// gradient declaration: impossible layouts are rejected by Apply, and the
// ones that are valid layouts but wrong for this function (the
// double-counting case) are what CheckGrad is for.
func TestLocalMapWrongGradCaught(t *testing.T) {
	t.Run("replicate-grad-for-sharded-input", func(t *testing.T) {
		m := rank0Mesh(t, []int{2})
		tp := NewTape()
		x := param(t, tp, m, []int{4, 3}, pl{S0})
		b := param(t, tp, m, []int{3}, pl{R})
		f := biasGELU([]pl{{S0}, {R}}, []pl{{R}, {Psum}}, pl{S0}, pl{S0})
		_, err := f.Apply(x, b)
		wantErr(t, err, ErrRule, `LocalMap("bias_gelu")`, `input 0 ("x")`, "S(0)", "declared R")
	})
	t.Run("shard-grad-for-replicated-output", func(t *testing.T) {
		m := rank0Mesh(t, []int{2})
		tp := NewTape()
		x := param(t, tp, m, []int{4, 3}, pl{R})
		b := param(t, tp, m, []int{3}, pl{R})
		f := biasGELU([]pl{{R}, {R}}, []pl{{R}, {R}}, pl{R}, pl{S0})
		_, err := f.Apply(x, b)
		wantErr(t, err, ErrRule, `LocalMap("bias_gelu")`, "the output", "declared S(0)")
	})
	// A P(sum) gradient reaching a Backward that declared it wants R would
	// need an all-reduce: backward fails instead of computing garbage.
	t.Run("partial-grad-arrives-for-replicate", func(t *testing.T) {
		simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
			tp := NewTape()
			xd, err := random(m, []int{4, 3}, pl{R}, 1)
			if err != nil {
				return err
			}
			bd, err := random(m, []int{3}, pl{R}, 2)
			if err != nil {
				return err
			}
			x, _ := tp.Param("x", xd)
			b, _ := tp.Param("b", bd)
			f := biasGELU([]pl{{R}, {R}}, []pl{{R}, {R}}, pl{R}, pl{R})
			y, err := f.Apply(x, b)
			if err != nil {
				return err
			}
			loss, err := partialGradLoss(ctx, tp, y)
			if err != nil {
				return err
			}
			err = tp.Backward(ctx, loss)
			if !errors.Is(err, ErrGradPlacement) || !strings.Contains(err.Error(), `LocalMap("bias_gelu")`) || !strings.Contains(err.Error(), "P(sum)") {
				return fmt.Errorf("want ErrGradPlacement naming the function and P(sum), got %v", err)
			}
			return nil
		})
	})
	// Valid layouts that are wrong for the function: R where each rank
	// holds a contribution (drops the other ranks' rows), and P(sum) where
	// each rank holds the whole gradient (counts it once per rank).
	for _, c := range []struct {
		name           string
		x, gx, gb, out pl
	}{
		{"replicate-drops-contributions", pl{S0}, pl{S0}, pl{R}, pl{S0}},
		{"partial-double-counts", pl{R}, pl{R}, pl{Psum}, pl{R}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := biasGELU([]pl{c.x, {R}}, []pl{c.gx, c.gb}, c.out, c.out)
			simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
				x, err := random(m, []int{4, 3}, c.x, 7)
				if err != nil {
					return err
				}
				b, err := random(m, []int{3}, pl{R}, 17)
				if err != nil {
					return err
				}
				err = CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
					y, err := f.Apply(ps[0], ps[1])
					if err != nil {
						return nil, err
					}
					return probe(ctx, y)
				}, x, b)
				if err == nil || !strings.Contains(err.Error(), "parameter 1") || !strings.Contains(err.Error(), "finite differences") {
					return fmt.Errorf("want CheckGrad to reject the bias gradient, got %v", err)
				}
				return nil
			})
		})
	}
}

// TestLocalMapMissingDeclarations: no defaults for gradient placements, and
// every other declaration is checked before Forward runs.
func TestLocalMapMissingDeclarations(t *testing.T) {
	m := rank0Mesh(t, []int{2})
	tp := NewTape()
	x := param(t, tp, m, []int{4, 3}, pl{S0})
	b := param(t, tp, m, []int{3}, pl{R})
	ok := func() LocalFunc[float64] {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		fwd := f.Forward
		f.Forward = func(in []Block[float64]) (Block[float64], error) {
			if in[0].Shape[0] != 2 {
				t.Errorf("rank 0's block of x is %v", in[0].Shape)
			}
			return fwd(in)
		}
		return f
	}
	if _, err := ok().Apply(x, b); err != nil {
		t.Fatalf("the complete declaration: %v", err)
	}
	ran := false
	for _, c := range []struct {
		name  string
		edit  func(*LocalFunc[float64])
		is    error
		parts []string
	}{
		{"no-GradIn", func(f *LocalFunc[float64]) { f.GradIn = nil }, ErrInvalid, []string{"GradIn declares 0", "no default"}},
		{"empty-GradIn-1", func(f *LocalFunc[float64]) { f.GradIn[1] = nil }, ErrInvalid, []string{`input 1 ("b")`, "GradIn[1] is empty", "no default"}},
		{"no-GradOut", func(f *LocalFunc[float64]) { f.GradOut = nil }, ErrInvalid, []string{"GradOut is empty", "no default"}},
		{"short-GradIn", func(f *LocalFunc[float64]) { f.GradIn[0] = pl{S0, S0} }, ErrInvalid, []string{`input 0 ("x")`, "2 placements", "1-axis"}},
		{"no-Name", func(f *LocalFunc[float64]) { f.Name = "" }, ErrInvalid, []string{"no Name"}},
		{"no-Forward", func(f *LocalFunc[float64]) { f.Forward = nil }, ErrInvalid, []string{"nil Forward"}},
		{"no-Backward", func(f *LocalFunc[float64]) { f.Backward = nil }, ErrInvalid, []string{"nil Backward"}},
		{"In-mismatch", func(f *LocalFunc[float64]) { f.In[0] = pl{R}; f.GradIn[0] = pl{R} }, ErrRule, []string{`input 0 ("x") is [S(0)]`, "never redistribute", "Redistribute"}},
		{"Partial-max", func(f *LocalFunc[float64]) { f.Out = pl{Pmax} }, ErrRule, []string{"the output", "P(max)"}},
		{"P(avg)-grad", func(f *LocalFunc[float64]) { f.GradIn[1] = pl{Pavg} }, ErrRule, []string{`input 1 ("b")`, "P(avg)"}},
		{"In-count", func(f *LocalFunc[float64]) { f.In = f.In[:1] }, ErrInvalid, []string{"2 inputs", "In declares 1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := ok()
			f.In = []pl{append(pl{}, f.In[0]...), append(pl{}, f.In[1]...)}
			f.GradIn = []pl{append(pl{}, f.GradIn[0]...), append(pl{}, f.GradIn[1]...)}
			inner := f.Forward
			f.Forward = func(in []Block[float64]) (Block[float64], error) {
				ran = true
				return inner(in)
			}
			c.edit(&f)
			_, err := f.Apply(x, b)
			wantErr(t, err, c.is, c.parts...)
			if ran {
				t.Errorf("Forward ran before the declarations were rejected")
			}
		})
	}
	// A forward-only function needs no Backward under NoGrad.
	f := ok()
	f.Backward = nil
	if err := tp.NoGrad(func() error { _, err := f.Apply(x, b); return err }); err != nil {
		t.Errorf("NoGrad without Backward: %v", err)
	}
}

// TestLocalMapBlockShapes: blocks returned by user code must have the local
// shape the declared spec implies on this rank.
func TestLocalMapBlockShapes(t *testing.T) {
	m := rank0Mesh(t, []int{2})
	tp := NewTape()
	x := param(t, tp, m, []int{4, 3}, pl{S0})
	b := param(t, tp, m, []int{3}, pl{R})
	t.Run("forward-global-shape", func(t *testing.T) {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		f.Forward = func(in []Block[float64]) (Block[float64], error) {
			return Block[float64]{Shape: []int{4, 3}, Data: make([]float64, 12)}, nil
		}
		_, err := f.Apply(x, b)
		wantErr(t, err, ErrInvalid, `LocalMap("bias_gelu")`, "forward", "the output", "[4 3]", "[2 3]")
	})
	t.Run("forward-transposed", func(t *testing.T) {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		f.Forward = func(in []Block[float64]) (Block[float64], error) {
			return Block[float64]{Shape: []int{3, 2}, Data: make([]float64, 6)}, nil
		}
		_, err := f.Apply(x, b)
		wantErr(t, err, ErrInvalid, "[3 2]", "[2 3]")
	})
	t.Run("forward-short-data", func(t *testing.T) {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		f.Forward = func(in []Block[float64]) (Block[float64], error) {
			return Block[float64]{Shape: []int{2, 3}, Data: make([]float64, 5)}, nil
		}
		_, err := f.Apply(x, b)
		wantErr(t, err, ErrInvalid, "5 elements", "holds 6")
	})
	t.Run("backward-bias-grad-shape", func(t *testing.T) {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		back := f.Backward
		f.Backward = func(g Block[float64], in []Block[float64], out Block[float64]) ([]Block[float64], error) {
			gs, err := back(g, in, out)
			if err != nil {
				return nil, err
			}
			gs[1] = Block[float64]{Shape: []int{1, 3}, Data: gs[1].Data} // a row vector, not [3]
			return gs, nil
		}
		err := backwardOf(t, tp, f, x, b)
		wantErr(t, err, ErrInvalid, `LocalMap("bias_gelu")`, "backward", `input 1 ("b")`, "[1 3]", "[3]")
	})
	t.Run("backward-count", func(t *testing.T) {
		f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
		f.Backward = func(g Block[float64], in []Block[float64], out Block[float64]) ([]Block[float64], error) {
			return []Block[float64]{g}, nil
		}
		err := backwardOf(t, tp, f, x, b)
		wantErr(t, err, ErrInvalid, "1 gradient blocks for 2 inputs")
	})
	t.Run("dtype", func(t *testing.T) {
		f32 := LocalFunc[float32]{Name: "f32", In: []pl{{S0}, {R}}, GradIn: []pl{{S0}, {Psum}}, Out: pl{S0}, GradOut: pl{S0},
			Forward: func(in []Block[float32]) (Block[float32], error) { return in[0], nil }}
		_, err := f32.Apply(x, b)
		wantErr(t, err, ErrInvalid, `LocalMap("f32")`, `input 0 ("x") is float64`, "float32")
	})
}

// TestLocalMapUserErrors: errors from Forward and Backward come back
// wrapped with the function's name.
func TestLocalMapUserErrors(t *testing.T) {
	m := rank0Mesh(t, []int{2})
	tp := NewTape()
	x := param(t, tp, m, []int{4, 3}, pl{S0})
	b := param(t, tp, m, []int{3}, pl{R})
	boom := errors.New("boom")
	f := biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
	f.Forward = func([]Block[float64]) (Block[float64], error) { return Block[float64]{}, boom }
	_, err := f.Apply(x, b)
	wantErr(t, err, boom, `LocalMap("bias_gelu")`, "forward")

	f = biasGELU([]pl{{S0}, {R}}, []pl{{S0}, {Psum}}, pl{S0}, pl{S0})
	f.Backward = func(Block[float64], []Block[float64], Block[float64]) ([]Block[float64], error) { return nil, boom }
	err = backwardOf(t, tp, f, x, b)
	wantErr(t, err, boom, `LocalMap("bias_gelu")`, "backward")
}

// TestLocalMapFloat32 runs a float32 function forward and backward and
// compares with float64 arithmetic on rank 0's blocks.
func TestLocalMapFloat32(t *testing.T) {
	m := rank0Mesh(t, []int{2})
	spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float32, pl{S0})
	if err != nil {
		t.Fatal(err)
	}
	xd, err := placement.NewLocal(spec, []float32{1, 2, 3, 4})
	if err != nil {
		t.Fatal(err)
	}
	tp := NewTape()
	x, _ := tp.Param("x", xd)
	sq := LocalFunc[float32]{Name: "square", In: []pl{{S0}}, GradIn: []pl{{S0}}, Out: pl{S0}, GradOut: pl{S0},
		Forward: func(in []Block[float32]) (Block[float32], error) {
			y := make([]float32, len(in[0].Data))
			for i, v := range in[0].Data {
				y[i] = v * v
			}
			return Block[float32]{Shape: in[0].Shape, Data: y}, nil
		},
		Backward: func(g Block[float32], in []Block[float32], _ Block[float32]) ([]Block[float32], error) {
			d := make([]float32, len(g.Data))
			for i := range d {
				d[i] = 2 * in[0].Data[i] * g.Data[i]
			}
			return []Block[float32]{{Shape: g.Shape, Data: d}}, nil
		},
	}
	y, err := sq.Apply(x)
	if err != nil {
		t.Fatal(err)
	}
	if got := y.Data().LocalData().([]float32); fmt.Sprint(got) != "[1 4 9 16]" {
		t.Errorf("forward: %v", got)
	}
	loss, err := Sum(y)
	if err != nil {
		t.Fatal(err)
	}
	if err := tp.Backward(context.Background(), loss); err != nil {
		t.Fatal(err)
	}
	if got := x.Grad().LocalData().([]float32); fmt.Sprint(got) != "[2 4 6 8]" {
		t.Errorf("backward: %v", got)
	}
}

// param makes a parameter named after its shape's role ("x" for rank 2,
// "b" otherwise) on a rank-0 mesh.
func param(t *testing.T, tp *Tape, m *mesh.Mesh, shape []int, places pl) *Value {
	t.Helper()
	d, err := random(m, shape, places, uint64(len(shape)))
	if err != nil {
		t.Fatal(err)
	}
	name := "b"
	if len(shape) == 2 {
		name = "x"
	}
	v, err := tp.Param(name, d)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// backwardOf applies f and runs Backward on Sum of the result; nothing
// communicates for row-sharded inputs, so rank 0 can run it alone.
func backwardOf(t *testing.T, tp *Tape, f LocalFunc[float64], x, b *Value) error {
	t.Helper()
	y, err := f.Apply(x, b)
	if err != nil {
		t.Fatal(err)
	}
	loss, err := Sum(y)
	if err != nil {
		t.Fatal(err)
	}
	return tp.Backward(context.Background(), loss)
}

// wantErr checks that err wraps is and mentions every part.
func wantErr(t *testing.T, err, is error, parts ...string) {
	t.Helper()
	if !errors.Is(err, is) {
		t.Fatalf("want an error wrapping %v, got %v", is, err)
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Errorf("error %q does not mention %q", err, p)
		}
	}
}
