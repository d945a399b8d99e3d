package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Normalisation: LayerNorm over the last dim, its sharding rule (the
// normalised dim whole on every rank), and its local kernels: the fused
// float32 row kernels of package kernels (lnForward, lnBackward) and the
// plain float64-accumulating loops that float64 blocks keep (lnFwd,
// lnBwd).

// LayerNorm normalises x over its last dim with the biased variance:
// (x − μ)/sqrt(σ² + eps)·w + b. Sharding rule: LayerNormRule (x not
// Partial nor sharded on the last dim; w and b Replicate). Backward: dx
// laid out like g; dw and db are Partial(sum) on the axes that shard x's
// rows and like g elsewhere.
func LayerNorm(x, w, b *Value, eps float64) (*Value, error) {
	const op = "LayerNorm"
	t, err := checkInputs(op, x, w, b)
	if err != nil {
		return nil, err
	}
	spec, err := LayerNormRule(x.Spec(), w.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	if !(eps >= 0) {
		return nil, invalidf(op, "eps %v must be non-negative", eps)
	}
	if d, ok := onDevice(x.data); ok {
		return layerNormDev(t, d, spec, x, w, b, eps)
	}
	if isF32(spec) {
		return layerNormOp[float32](t, spec, x, w, b, eps)
	}
	return layerNormOp[float64](t, spec, x, w, b, eps)
}

// LayerNormRule is the sharding rule of LayerNorm over the last dim: x has
// no Partial placement and is not sharded on its last dim ("layer norm
// over a sharded dim"); w and b are [D] (D the last dim of x) and Replicate
// on every axis. The result has x's spec.
func LayerNormRule(x, w, b *placement.Spec) (*placement.Spec, error) {
	const op = "LayerNorm"
	if x == nil || w == nil || b == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := compatible(op, x, w); err != nil {
		return nil, err
	}
	if err := compatible(op, x, b); err != nil {
		return nil, err
	}
	sx := x.Shape()
	if len(sx) == 0 {
		return nil, invalidf(op, "x is a scalar; LayerNorm needs at least one dim")
	}
	d := sx[len(sx)-1]
	if !slices.Equal(w.Shape(), []int{d}) || !slices.Equal(b.Shape(), []int{d}) {
		return nil, invalidf(op, "w %v and b %v must both have shape [%d] (the last dim of x %v)", w.Shape(), b.Shape(), d, sx)
	}
	if err := nonPartial(op, "x", x); err != nil {
		return nil, err
	}
	if o := x.Order(len(sx) - 1); len(o) > 0 {
		return nil, rulef(op, "layer norm over a sharded dim: x is sharded on its last dim %d by mesh axes %v; redistribute that dim to Replicate (all-gather), or shard a leading dim instead", len(sx)-1, o)
	}
	if err := allReplicate(op, "w", w, "the normalised dim is whole on every rank"); err != nil {
		return nil, err
	}
	if err := allReplicate(op, "b", b, "the normalised dim is whole on every rank"); err != nil {
		return nil, err
	}
	return x, nil
}

func layerNormOp[T float](t *Tape, spec *placement.Spec, x, w, b *Value, eps float64) (*Value, error) {
	const op = "LayerNorm"
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	wd, err := dataOf[T](w.data)
	if err != nil {
		return nil, err
	}
	bd, err := dataOf[T](b.data)
	if err != nil {
		return nil, err
	}
	shape := spec.Shape()
	n := shape[len(shape)-1]
	yd, saved, err := lnForward(t, t.records(x, w, b), xd, wd, bd, n, eps)
	if err != nil {
		return nil, err
	}
	out, err := placement.NewLocal(spec, yd)
	if err != nil {
		return nil, err
	}
	ws, bs := w.Spec(), b.Spec()
	return splitAware(t.record(op, out, []*Value{x, w, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needX, needW, needB := t.need(x), t.need(w), t.need(b)
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		dx, dw, db, err := lnBackward(t, gd, xd, wd, saved, n, needX, needW, needB)
		if err != nil {
			return nil, err
		}
		grads := make([]*placement.DTensor, 3)
		if needX {
			if grads[0], err = placement.NewLocal(g.Spec(), dx); err != nil {
				return nil, err
			}
		}
		red := reducedOver(spec, g.Spec().Placements())
		if needW {
			s, err := gradSpec(ws, red)
			if err != nil {
				return nil, err
			}
			if grads[1], err = placement.NewLocal(s, dw); err != nil {
				return nil, err
			}
		}
		if needB {
			s, err := gradSpec(bs, red)
			if err != nil {
				return nil, err
			}
			if grads[2], err = placement.NewLocal(s, db); err != nil {
				return nil, err
			}
		}
		return grads, nil
	})), nil
}

// lnSaved is what LayerNorm's backward needs: the rows' mean and
// 1/sqrt(σ²+eps) (float32, with x itself), or x̂ (float64).
type lnSaved struct {
	mean, rstd []float64
	xhat       []float64
}

// lnForward is LayerNorm over rows of n values into a result block.
func lnForward[T float](t *Tape, rec bool, x, w, b []T, n int, eps float64) ([]T, lnSaved, error) {
	if x32, ok := as32(x); ok {
		w32, _ := as32(w)
		b32, _ := as32(b)
		y := resultBlock[float32](t, len(x32))
		var s lnSaved
		if rec && n > 0 {
			rows := len(x32) / n
			s.mean, s.rstd = getBuf[float64](t, rows), getBuf[float64](t, rows)
		}
		if err := kernels.LayerNorm(y, s.mean, s.rstd, x32, w32, b32, n, eps); err != nil {
			return nil, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), s, nil
	}
	rows := 0
	if n > 0 {
		rows = len(x) / n
	}
	y, sv := make([]T, len(x)), lnSaved{xhat: make([]float64, len(x)), rstd: make([]float64, rows)}
	if err := kernels.LayerNorm64(y, sv.xhat, sv.rstd, x, w, b, n, eps); err != nil {
		return nil, sv, fmt.Errorf("autograd: internal: %w", err)
	}
	return y, sv, nil
}

// lnBackward returns dx, dw and db (nil where not needed), in t's arena
// for float32.
func lnBackward[T float](t *Tape, g, x, w []T, s lnSaved, n int, needX, needW, needB bool) (dx, dw, db []T, err error) {
	g32, ok := as32(g)
	if !ok {
		if needX {
			dx = make([]T, len(g))
		}
		if needW {
			dw = make([]T, n)
		}
		if needB {
			db = make([]T, n)
		}
		if err := kernels.LayerNorm64Backward(dx, dw, db, g, w, s.xhat, s.rstd, n); err != nil {
			return nil, nil, nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return dx, dw, db, nil
	}
	x32, _ := as32(x)
	w32, _ := as32(w)
	var dx32, dw32, db32 []float32
	if needX {
		dx32 = getBuf[float32](t, len(g32))
	}
	if needW {
		dw32 = zeroBuf[float32](t, n) // stays 0 when there are no rows
	}
	if needB {
		db32 = zeroBuf[float32](t, n)
	}
	if err := kernels.LayerNormBackward(dx32, dw32, db32, g32, x32, w32, s.mean, s.rstd, n); err != nil {
		return nil, nil, nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return from32[T](dx32), from32[T](dw32), from32[T](db32), nil
}
