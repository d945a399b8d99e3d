package autograd

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Attention: CausalSoftmax over the last dim of [..., T, T] scores and
// CausalAttention (softmax_causal(q·kᵀ/√Dh)·v, one fused op for float32
// inputs laid out alike), with their sharding rules and local kernels.

// CausalSoftmax returns the softmax over the last dim of scores x
// [..., T, T] with the causal mask: entry (i, j) with j > i is −∞ before
// the softmax and exactly 0 after it. Sharding rule: CausalSoftmaxRule.
// Backward: y⊙(g − Σ_j g⊙y), laid out like g (masked entries get 0).
func CausalSoftmax(x *Value) (*Value, error) {
	const op = "CausalSoftmax"
	return elementwise(op, x, CausalSoftmaxRule, causalOp[float32], causalOp[float64])
}

// CausalSoftmaxRule is the sharding rule of CausalSoftmax for x
// [..., T, T]: no Partial input, and neither of the last two dims sharded
// (the mask needs global positions, the softmax a whole row); leading
// dims (batch, heads) may be sharded. The result has x's spec.
func CausalSoftmaxRule(x *placement.Spec) (*placement.Spec, error) {
	const op = "CausalSoftmax"
	if x == nil {
		return nil, invalidf(op, "nil spec")
	}
	sh := x.Shape()
	r := len(sh)
	if r < 2 || sh[r-1] != sh[r-2] {
		return nil, invalidf(op, "want scores [..., T, T]; got %v", sh)
	}
	if err := nonPartial(op, "x", x); err != nil {
		return nil, err
	}
	for _, d := range []int{r - 2, r - 1} {
		if o := x.Order(d); len(o) > 0 {
			return nil, rulef(op, "softmax over a sharded dim: x is sharded on dim %d (of the last two, the positions) by mesh axes %v; redistribute it to Replicate first and shard the batch or heads dims instead", d, o)
		}
	}
	return x, nil
}

func causalOp[T float](t *Tape, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "CausalSoftmax"
	if d, ok := onDevice(x.data); ok {
		return causalDev(t, d, spec, x)
	}
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	sh := spec.Shape()
	tt := sh[len(sh)-1]
	yd, err := causalForward(t, xd, tt)
	if err != nil {
		return nil, err
	}
	return recordUnary(t, op, x, spec, yd, func(gd []T, gshape []int) ([]T, error) {
		return causalBackward(t, yd, gd, gshape)
	})
}

// causalForward is the causal row softmax of [..., T, T] blocks (tt = T)
// into a result block of t.
func causalForward[T float](t *Tape, x []T, tt int) ([]T, error) {
	if x32, ok := as32(x); ok {
		y := resultBlock[float32](t, len(x32))
		if err := kernels.CausalSoftmax(t.Workers(), y, x32, tt, 1); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), nil
	}
	y := make([]T, len(x))
	if err := kernels.CausalSoftmax64(y, x, tt); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return y, nil
}

// causalBackward maps g to the gradient of the causal softmax's input, in
// t's arena for float32 (masked entries get 0).
func causalBackward[T float](t *Tape, y, g []T, shape []int) ([]T, error) {
	if y32, ok := as32(y); ok {
		g32, _ := as32(g)
		tt := 0
		if len(shape) > 0 {
			tt = shape[len(shape)-1]
		}
		dx := getBuf[float32](t, len(y32))
		if err := kernels.CausalSoftmaxBackward(dx, y32, g32, tt, 1); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return softmaxBwd(y, g, shape, len(shape)-1, false)
}

// CausalAttention is causal scaled-dot-product attention with heads as a
// dimension: q, k, v are [..., T, Dh] (e.g. [B, H, T, Dh]) and the result
// is softmax_causal(q·kᵀ/√Dh)·v, [..., T, Dh]. It is the composition of
// Transpose, BatchedMatMul, Scale and CausalSoftmax, so the sharding rules
// are theirs: batch and head dims may be sharded (the same way in q, k and
// v); T and Dh may not, and no input may be Partial.
//
// float32 inputs laid out alike (Replicate, or Shard of the same batch or
// head dims, on every mesh axis) run fused: one recorded op on
// kernels.CausalAttentionForward and kernels.CausalAttentionBackward,
// which skip the masked half of every block and keep only the
// probabilities for backward (no transposed copy of k, no separate scores
// or scaling pass). Its result and gradients are laid out as the
// composition's, and agree with it to within float32 rounding. Other
// inputs are recorded as the composition.
func CausalAttention(q, k, v *Value) (*Value, error) {
	if q == nil || q.data == nil {
		return nil, invalidf("CausalAttention", "nil q")
	}
	sh := q.Spec().Shape()
	if len(sh) < 2 {
		return nil, invalidf("CausalAttention", "q has shape %v; want [..., T, Dh]", sh)
	}
	if spec, ok := fusedAttentionSpec(q, k, v); ok {
		return causalAttentionFused(spec, q, k, v)
	}
	kt, err := Transpose(k, -2, -1)
	if err != nil {
		return nil, err
	}
	s, err := BatchedMatMul(q, kt)
	if err != nil {
		return nil, err
	}
	if s, err = Scale(s, 1/math.Sqrt(float64(sh[len(sh)-1]))); err != nil {
		return nil, err
	}
	a, err := CausalSoftmax(s)
	if err != nil {
		return nil, err
	}
	return BatchedMatMul(a, v)
}

// fusedAttentionSpec returns the spec of CausalAttention's result and true
// when q, k and v can run fused: float32, on one tape and mesh, q and k of
// one shape, v with their batch dims and T, and identical placements and
// shard orders that are Replicate or Shard of a batch dim on every axis.
// The spec comes from the composition's rules, so it is the composed
// result's.
func fusedAttentionSpec(q, k, v *Value) (*placement.Spec, bool) {
	if k == nil || v == nil || k.data == nil || v.data == nil || q.tape != k.tape || q.tape != v.tape {
		return nil, false
	}
	sq, sk, sv := q.Spec(), k.Spec(), v.Spec()
	if !isF32(sq) || !isF32(sk) || !isF32(sv) {
		return nil, false
	}
	shq, shv := sq.Shape(), sv.Shape()
	r := len(shq)
	if r < 2 || !slices.Equal(shq, sk.Shape()) || len(shv) != r || !slices.Equal(shq[:r-1], shv[:r-1]) {
		return nil, false
	}
	if compatible("CausalAttention", sq, sk) != nil || compatible("CausalAttention", sq, sv) != nil {
		return nil, false
	}
	pq := sq.Placements()
	if !slices.Equal(pq, sk.Placements()) || !slices.Equal(pq, sv.Placements()) {
		return nil, false
	}
	for _, p := range pq {
		if !p.IsReplicate() && !(p.IsShard() && p.Dim() < r-2) {
			return nil, false
		}
	}
	for d := range r {
		if !slices.Equal(sq.Order(d), sk.Order(d)) || !slices.Equal(sq.Order(d), sv.Order(d)) {
			return nil, false
		}
	}
	kt, err := TransposeRule(sk, -2, -1)
	if err != nil {
		return nil, false
	}
	scores, err := BatchedMatMulRule(sq, kt)
	if err != nil {
		return nil, false
	}
	if _, err := CausalSoftmaxRule(scores); err != nil {
		return nil, false
	}
	out, err := BatchedMatMulRule(scores, sv)
	if err != nil {
		return nil, false
	}
	return out, true
}

// causalAttentionFused records CausalAttention as one op (see its doc).
func causalAttentionFused(spec *placement.Spec, q, k, v *Value) (*Value, error) {
	const op = "CausalAttention"
	t, err := checkInputs(op, q, k, v)
	if err != nil {
		return nil, err
	}
	if d, ok := onDevice(q.data); ok {
		return attentionDev(t, d, spec, q, k, v)
	}
	qd, err := dataOf[float32](q.data)
	if err != nil {
		return nil, err
	}
	kd, err := dataOf[float32](k.data)
	if err != nil {
		return nil, err
	}
	vd, err := dataOf[float32](v.data)
	if err != nil {
		return nil, err
	}
	lq, lv := q.data.LocalShape(), v.data.LocalShape()
	r := len(lq)
	batch, tt, dh, dv := prod(lq[:r-2]), lq[r-2], lq[r-1], lv[r-1]
	if len(qd) != batch*tt*dh || len(kd) != len(qd) || len(vd) != batch*tt*dv {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v, %v and %v", op, lq, k.data.LocalShape(), lv)
	}
	scale := float32(1 / math.Sqrt(float64(q.Spec().Shape()[r-1])))
	// P = causal softmax(scale·q·kᵀ), batch blocks of tt×tt; kept for
	// backward when recorded (or kept by a selective checkpoint).
	var probs, out []float32
	var res *placement.DTensor
	kept, err := t.reuse(op, spec)
	if err != nil {
		return nil, err
	}
	if kept != nil {
		res = kept.out
		out, _ = res.LocalData().([]float32)
		probs, _ = kept.aux.([]float32)
		if len(out) != batch*tt*dv || len(probs) != batch*tt*tt {
			return nil, fmt.Errorf("autograd: %s: internal: kept blocks of %d and %d", op, len(out), len(probs))
		}
	} else {
		probs = getBuf[float32](t, batch*tt*tt)
		out = resultBlock[float32](t, batch*tt*dv)
		err = kernels.CausalAttentionForward(t.Workers(), out, probs, qd, kd, vd, batch, tt, dh, dv, scale)
		if !t.records(q, k, v) && !t.keeping(op) {
			putBuf(t, probs)
			probs = nil
		}
		if err != nil {
			return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
		}
		if res, err = placement.NewLocal(spec, out); err != nil {
			return nil, err
		}
	}
	sq, sk, sv := q.Spec(), k.Spec(), v.Spec()
	needQ, needK, needV := q.requiresGrad, k.requiresGrad, v.requiresGrad
	return t.recordAux(op, res, probs, []*Value{q, k, v}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[float32](g)
		if err != nil {
			return nil, err
		}
		if len(gd) != len(out) {
			return nil, fmt.Errorf("autograd: %s: internal: gradient block %v, result %v", op, g.LocalShape(), res.LocalShape())
		}
		// On every mesh axis the inputs are R or Shard(batch dim): their
		// gradients are laid out like the aligned g, as the composition's.
		pg := g.Spec().Placements()
		var dq, dk, dvv []float32
		if needQ {
			dq = getBuf[float32](t, len(qd))
		}
		if needK {
			dk = getBuf[float32](t, len(kd))
		}
		if needV {
			dvv = getBuf[float32](t, len(vd))
		}
		if err := kernels.CausalAttentionBackward(t.Workers(), dq, dk, dvv, gd, probs, qd, kd, vd, batch, tt, dh, dv, scale); err != nil {
			return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
		}
		grads := make([]*placement.DTensor, 3)
		for i, c := range []struct {
			need bool
			s    *placement.Spec
			d    []float32
		}{{needQ, sq, dq}, {needK, sk, dk}, {needV, sv, dvv}} {
			if !c.need {
				continue
			}
			gs, err := gradSpec(c.s, pg)
			if err != nil {
				return nil, err
			}
			if grads[i], err = placement.NewLocal(gs, c.d); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}
