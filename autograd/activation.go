package autograd

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Activations: the exact GELU (with erf, not the tanh approximation) and
// Softmax and LogSoftmax over a dim, with their sharding rules and local
// kernels (float32 on the fused kernels of package kernels, float64 on
// plain loops), and the helpers every one-input op shares (elementwise,
// recordUnary).

// GELU returns the exact GELU, 0.5·x·(1 + erf(x/√2)), element-wise.
// Sharding rule: GELURule (no Partial input). Backward: g·GELU'(x), laid
// out like g.
func GELU(x *Value) (*Value, error) {
	const op = "GELU"
	return elementwise(op, x, GELURule, geluOp[float32], geluOp[float64])
}

// GELURule is the sharding rule of GELU: the result has the input's spec;
// Partial inputs are rejected (GELU is nonlinear).
func GELURule(x *placement.Spec) (*placement.Spec, error) {
	if x == nil {
		return nil, invalidf("GELU", "nil spec")
	}
	if err := nonPartial("GELU", "x", x); err != nil {
		return nil, err
	}
	return x, nil
}

func geluOp[T float](t *Tape, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "GELU"
	if d, ok := onDevice(x.data); ok {
		return geluDev(t, d, spec, x)
	}
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	ls := x.data.LocalShape()
	n := 1
	if len(ls) > 0 {
		n = ls[len(ls)-1]
	}
	yd, saved, err := geluForward(t, t.records(x), xd, n)
	if err != nil {
		return nil, err
	}
	return recordUnary(t, op, x, spec, yd, func(gd []T, gshape []int) ([]T, error) {
		return geluBackward(t, xd, saved, gd, n)
	})
}

// geluSaved is what GELU's backward needs: GELU'(x) per element for
// float32 (kernels.BiasGELU's deriv), erf(x/√2) per element for float64.
type geluSaved struct {
	deriv []float32
	erfs  []float64
}

// geluForward computes GELU(x) for rows of n values into a result block.
func geluForward[T float](t *Tape, rec bool, x []T, n int) ([]T, geluSaved, error) {
	if x32, ok := as32(x); ok {
		y := resultBlock[float32](t, len(x32))
		var s geluSaved
		if rec {
			s.deriv = getBuf[float32](t, len(x32))
		}
		if err := kernels.BiasGELU(t.Workers(), y, s.deriv, x32, nil, rowWidth(len(x32), n)); err != nil {
			return nil, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), s, nil
	}
	y, erfs := make([]T, len(x)), make([]float64, len(x))
	if err := kernels.GELU64(t.Workers(), y, erfs, x); err != nil {
		return nil, geluSaved{}, fmt.Errorf("autograd: internal: %w", err)
	}
	return y, geluSaved{erfs: erfs}, nil
}

// geluBackward maps g to g·GELU'(x), in t's arena for float32.
func geluBackward[T float](t *Tape, x []T, s geluSaved, g []T, n int) ([]T, error) {
	if g32, ok := as32(g); ok {
		dx := getBuf[float32](t, len(g32))
		if err := kernels.BiasGELUBackward(dx, nil, g32, s.deriv, rowWidth(len(g32), n)); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	dx := make([]T, len(x))
	if err := kernels.GELU64Backward(t.Workers(), dx, x, s.erfs, g); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return dx, nil
}

// rowWidth is n when it divides l into whole rows, else l (one row): the
// row kernels only use the width to split work.
func rowWidth(l, n int) int {
	if n > 0 && l%n == 0 {
		return n
	}
	return l
}

// Softmax returns the softmax of x over dim (negative dims count from the
// end), subtracting the maximum before exp. Sharding rule: SoftmaxRule (no
// Partial input, dim not sharded). Backward: y⊙(g − Σ_dim g⊙y), laid out
// like g.
func Softmax(x *Value, dim int) (*Value, error) {
	return softmax("Softmax", x, dim, false)
}

// LogSoftmax returns x − logsumexp(x) over dim. Sharding rule:
// LogSoftmaxRule (as Softmax's). Backward: g − softmax(x)·Σ_dim g, laid
// out like g.
func LogSoftmax(x *Value, dim int) (*Value, error) {
	return softmax("LogSoftmax", x, dim, true)
}

// SoftmaxRule is the sharding rule of Softmax over dim (negative dims count
// from the end): the result has the input's spec. Partial inputs are
// rejected, and so is an input sharded on dim ("softmax over a sharded
// dim"): each rank would normalise over its own slice only.
func SoftmaxRule(x *placement.Spec, dim int) (*placement.Spec, error) {
	_, err := softmaxRule("Softmax", x, dim)
	if err != nil {
		return nil, err
	}
	return x, nil
}

// LogSoftmaxRule is the sharding rule of LogSoftmax; it is SoftmaxRule's.
func LogSoftmaxRule(x *placement.Spec, dim int) (*placement.Spec, error) {
	_, err := softmaxRule("LogSoftmax", x, dim)
	if err != nil {
		return nil, err
	}
	return x, nil
}

func softmaxRule(op string, x *placement.Spec, dim int) (int, error) {
	if x == nil {
		return 0, invalidf(op, "nil spec")
	}
	d, err := normDim(op, dim, len(x.Shape()))
	if err != nil {
		return 0, err
	}
	if err := nonPartial(op, "x", x); err != nil {
		return 0, err
	}
	if o := x.Order(d); len(o) > 0 {
		return 0, rulef(op, "softmax over a sharded dim: x is sharded on dim %d by mesh axes %v; redistribute dim %d to Replicate on those axes (all-gather), or shard another dim instead", d, o, d)
	}
	return d, nil
}

func softmax(op string, x *Value, dim int, logOut bool) (*Value, error) {
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	d, err := softmaxRule(op, x.Spec(), dim)
	if err != nil {
		return nil, err
	}
	if dev, ok := onDevice(x.data); ok {
		return softmaxDev(t, dev, op, x, d, logOut)
	}
	if isF32(x.Spec()) {
		return softmaxOp[float32](t, op, x, d, logOut)
	}
	return softmaxOp[float64](t, op, x, d, logOut)
}

func softmaxOp[T float](t *Tape, op string, x *Value, d int, logOut bool) (*Value, error) {
	spec := x.Spec()
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	shape := x.data.LocalShape()
	yd, err := softmaxForward(t, xd, shape, d, logOut)
	if err != nil {
		return nil, err
	}
	return recordUnary(t, op, x, spec, yd, func(gd []T, gshape []int) ([]T, error) {
		return softmaxBackward(t, yd, gd, shape, d, logOut)
	})
}

// softmaxForward is softmax (or log-softmax) over dim d of a block of
// shape; float32 blocks reduced over their last dim run on the row
// kernels. The result is a result block of t.
func softmaxForward[T float](t *Tape, x []T, shape []int, d int, logOut bool) ([]T, error) {
	outer, n, inner := splitDim(shape, d)
	if x32, ok := as32(x); ok && inner == 1 && outer*n == len(x32) {
		y := resultBlock[float32](t, len(x32))
		f := kernels.SoftmaxRows
		if logOut {
			f = kernels.LogSoftmaxRows
		}
		if err := f(t.Workers(), y, x32, n); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), nil
	}
	y := make([]T, len(x))
	if err := kernels.Softmax64(y, x, outer, n, inner, logOut); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return y, nil
}

// softmaxBackward maps g to the gradient of x, in t's arena for float32
// blocks reduced over their last dim.
func softmaxBackward[T float](t *Tape, y, g []T, shape []int, d int, logOut bool) ([]T, error) {
	outer, n, inner := splitDim(shape, d)
	y32, ok := as32(y)
	g32, _ := as32(g)
	if ok && inner == 1 && outer*n == len(y32) && len(g32) == len(y32) {
		dx := getBuf[float32](t, len(y32))
		f := kernels.SoftmaxRowsBackward // memory-bound: one goroutine
		if logOut {
			f = func(dx, y, dy []float32, n int) error {
				return kernels.LogSoftmaxRowsBackward(t.Workers(), dx, y, dy, n)
			}
		}
		if err := f(dx, y32, g32, n); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return softmaxBwd(y, g, shape, d, logOut)
}

// softmaxBwd is kernels.Softmax64Backward over dim d of a block of shape,
// into a fresh block.
func softmaxBwd[T float](y, g []T, shape []int, d int, logOut bool) ([]T, error) {
	outer, n, inner := splitDim(shape, d)
	dx := make([]T, len(y))
	if err := kernels.Softmax64Backward(dx, y, g, outer, n, inner, logOut); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return dx, nil
}

// elementwise checks a one-input op's input and rule and runs its float32
// or float64 form.
func elementwise(op string, x *Value, rule func(*placement.Spec) (*placement.Spec, error),
	f32, f64 func(*Tape, *placement.Spec, *Value) (*Value, error)) (*Value, error) {
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, err := rule(x.Spec())
	if err != nil {
		return nil, err
	}
	if isF32(spec) {
		return f32(t, spec, x)
	}
	return f64(t, spec, x)
}

// recordUnary makes the result of a one-input op from its local block yd
// laid out by spec, and records a backward that aligns the incoming
// gradient to spec and maps its local block through back (gshape is the
// gradient's local shape) into the input's gradient, laid out like g.
func recordUnary[T float](t *Tape, op string, x *Value, spec *placement.Spec, yd []T, back func(gd []T, gshape []int) ([]T, error)) (*Value, error) {
	out, err := placement.NewLocal(spec, yd)
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		dx, err := back(gd, g.LocalShape())
		if err != nil {
			return nil, err
		}
		gx, err := placement.NewLocal(g.Spec(), dx)
		return []*placement.DTensor{gx}, err
	}), nil
}
