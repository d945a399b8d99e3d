package autograd

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Narrow returns entries start … start+length−1 of x along dim (negative
// dims count from the end). Sharding rule: NarrowRule (dim not sharded).
// Backward pads the gradient with zeros, laid out like g.
func Narrow(x *Value, dim, start, length int) (*Value, error) {
	const op = "Narrow"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, d, err := narrowRule(x.Spec(), dim, start, length)
	if err != nil {
		return nil, err
	}
	full := x.Spec().Shape()[d]
	lshape := x.data.LocalShape()
	out, err := mapLocal(spec, x.data, func(v any) any { return narrowAny(t.result(), v, lshape, d, start, length) })
	if err != nil {
		return nil, err
	}
	in := x.Spec()
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		s, err := gradSpec(in, g.Spec().Placements())
		if err != nil {
			return nil, err
		}
		gshape := g.LocalShape()
		gx, err := mapLocal(s, g, func(v any) any { return padAny(t.scratch(), v, gshape, d, start, full) })
		return []*placement.DTensor{gx}, err
	}), nil
}

// SplitLast splits the last dim of x into k equal parts (Narrow of each),
// e.g. a fused q|k|v projection into q, k and v. The last dim must be
// divisible by k and not sharded.
func SplitLast(x *Value, k int) ([]*Value, error) {
	if x == nil || x.data == nil {
		return nil, invalidf("SplitLast", "input 0 is nil")
	}
	sh := x.Spec().Shape()
	if len(sh) == 0 || k <= 0 || sh[len(sh)-1]%k != 0 {
		return nil, invalidf("SplitLast", "cannot split shape %v into %d equal parts along the last dim", sh, k)
	}
	n := sh[len(sh)-1] / k
	out := make([]*Value, k)
	for i := range out {
		v, err := Narrow(x, -1, i*n, n)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// Concat joins xs along dim (negative counts from the end). Sharding rule:
// ConcatRule. Backward narrows the gradient back into pieces, laid out
// like g.
func Concat(dim int, xs ...*Value) (*Value, error) {
	const op = "Concat"
	t, err := checkInputs(op, xs...)
	if err != nil {
		return nil, err
	}
	specs := make([]*placement.Spec, len(xs))
	for i, x := range xs {
		specs[i] = x.Spec()
	}
	spec, d, err := concatRule(dim, specs)
	if err != nil {
		return nil, err
	}
	sizes := make([]int, len(xs))
	lshapes := make([][]int, len(xs))
	blocks := make([]any, len(xs))
	for i, x := range xs {
		sizes[i] = specs[i].Shape()[d]
		lshapes[i] = x.data.LocalShape()
		blocks[i] = x.data.LocalData()
	}
	out, err := placement.NewLocal(spec, concatAny(t.result(), blocks, lshapes, d))
	if err != nil {
		return nil, err
	}
	return t.record(op, out, xs, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gshape := g.LocalShape()
		grads := make([]*placement.DTensor, len(xs))
		off := 0
		for i, x := range xs {
			if x.requiresGrad {
				s, err := gradSpec(specs[i], g.Spec().Placements())
				if err != nil {
					return nil, err
				}
				o := off
				if grads[i], err = mapLocal(s, g, func(v any) any { return narrowAny(t.scratch(), v, gshape, d, o, sizes[i]) }); err != nil {
					return nil, err
				}
			}
			off += sizes[i]
		}
		return grads, nil
	}), nil
}

// mapLocal lays out f(local block of x) by spec.
func mapLocal(spec *placement.Spec, x *placement.DTensor, f func(any) any) (*placement.DTensor, error) {
	return placement.NewLocal(spec, f(x.LocalData()))
}

// narrowAny and padAny put their result in a block as a says (scratch for
// a gradient, a result for an op's result).
func narrowAny(a alloc, v any, shape []int, d, start, length int) any {
	switch x := v.(type) {
	case []float32:
		return narrowT(a, x, shape, d, start, length)
	case []float64:
		return narrowT(a, x, shape, d, start, length)
	}
	return v
}

func padAny(a alloc, v any, shape []int, d, start, full int) any {
	switch x := v.(type) {
	case []float32:
		return padT(a, x, shape, d, start, full)
	case []float64:
		return padT(a, x, shape, d, start, full)
	}
	return v
}

func concatAny(a alloc, blocks []any, shapes [][]int, d int) any {
	switch blocks[0].(type) {
	case []float32:
		return concatT[float32](a, blocks, shapes, d)
	default:
		return concatT[float64](a, blocks, shapes, d)
	}
}

func narrowT[T float](a alloc, x []T, shape []int, d, start, length int) []T {
	outer, n, inner := splitDim(shape, d)
	out := block[T](a, outer*length*inner)
	for o := range outer {
		copy(out[o*length*inner:(o+1)*length*inner], x[(o*n+start)*inner:(o*n+start+length)*inner])
	}
	return out
}

func padT[T float](a alloc, g []T, shape []int, d, start, full int) []T {
	outer, n, inner := splitDim(shape, d)
	out := block[T](a, outer*full*inner)
	for o := range outer {
		row := out[o*full*inner : (o+1)*full*inner]
		if !a.fresh() { // arena memory: the padding must be cleared
			clear(row[:start*inner])
			clear(row[(start+n)*inner:])
		}
		copy(row[start*inner:(start+n)*inner], g[o*n*inner:(o+1)*n*inner])
	}
	return out
}

func concatT[T float](a alloc, blocks []any, shapes [][]int, d int) []T {
	outer, _, inner := splitDim(shapes[0], d)
	total := 0
	for _, s := range shapes {
		total += s[d]
	}
	out := block[T](a, outer*total*inner)
	off := 0
	for i, b := range blocks {
		x := b.([]T)
		n := shapes[i][d]
		for o := range outer {
			copy(out[(o*total+off)*inner:(o*total+off+n)*inner], x[o*n*inner:(o+1)*n*inner])
		}
		off += n
	}
	return out
}

// BatchedMatMul returns a·b for a [..., m, k] and b [..., k, n] with equal
// batch dims, one matrix product per batch index. Sharding rule:
// BatchedMatMulRule. Backward, per mesh axis (a, b) -> (da, db):
//
//	(S(d), S(d)) batch:    S(d), S(d)
//	(S(m), R):             S(m), P(sum)
//	(R, S(n)):             P(sum), S(n)
//	(S(k), S(k)):          S(k), S(k)    g must be R there
//	(R, R):                like g, like g
//	(P(sum), R):           like g, P(sum) g must be R for db
//	(R, P(sum)):           P(sum), like g g must be R for da
func BatchedMatMul(a, b *Value) (*Value, error) {
	const op = "BatchedMatMul"
	t, err := checkInputs(op, a, b)
	if err != nil {
		return nil, err
	}
	spec, cases, err := bmmRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	blas, err := t.blasOrDefault()
	if err != nil {
		return nil, err
	}
	al, bl := a.data.LocalShape(), b.data.LocalShape()
	r := len(al)
	batch, m, k, n := prod(al[:r-2]), al[r-2], al[r-1], bl[r-1]
	if bl[r-2] != k || prod(bl[:r-2]) != batch {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v and %v do not chain", op, al, bl)
	}
	out, err := bmmLocal(t.result(), blas, spec, a.data, b.data, false, false, batch, m, n, k)
	if err != nil {
		return nil, err
	}
	sa, sb := a.Spec(), b.Spec()
	x, y := a.data, b.data
	needA, needB := a.requiresGrad, b.requiresGrad
	names := sa.Mesh().Names()
	return t.record(op, out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		pa, pb, pg := sa.Placements(), sb.Placements(), g.Spec().Placements()
		da, db := make([]placement.Placement, len(pa)), make([]placement.Placement, len(pa))
		sum := placement.Partial(comm.Sum)
		var errA, errB error
		for ax, c := range cases {
			needR := func(which string) error {
				return gradPlacementf(op, "the gradient of the result arrives as %v on mesh axis %q, where a is %v and b is %v: d%s needs it all-reduced to R first, and autograd inserts no communication", pg[ax], names[ax], pa[ax], pb[ax], which)
			}
			switch c {
			case bmmBatch:
				da[ax], db[ax] = pa[ax], pb[ax]
			case bmmRows:
				da[ax], db[ax] = pa[ax], sum
			case bmmCols:
				da[ax], db[ax] = sum, pb[ax]
			case bmmInner:
				da[ax], db[ax] = pa[ax], pb[ax]
				if pg[ax].IsPartial() {
					errA, errB = cmp(errA, needR("a")), cmp(errB, needR("b"))
				}
			case bmmRep:
				da[ax], db[ax] = pg[ax], pg[ax]
			case bmmPartA:
				da[ax], db[ax] = pg[ax], sum
				if pg[ax].IsPartial() {
					errB = cmp(errB, needR("b"))
				}
			case bmmPartB:
				da[ax], db[ax] = sum, pg[ax]
				if pg[ax].IsPartial() {
					errA = cmp(errA, needR("a"))
				}
			}
		}
		grads := make([]*placement.DTensor, 2)
		if needA {
			if errA != nil {
				return nil, errA
			}
			s, err := gradSpec(sa, da)
			if err != nil {
				return nil, err
			}
			if grads[0], err = bmmLocal(t.scratch(), blas, s, g, y, false, true, batch, m, k, n); err != nil {
				return nil, err
			}
		}
		if needB {
			if errB != nil {
				return nil, errB
			}
			s, err := gradSpec(sb, db)
			if err != nil {
				return nil, err
			}
			if grads[1], err = bmmLocal(t.scratch(), blas, s, x, g, true, false, batch, k, n, m); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

// bmmLocal computes op(A_i)·op(B_i) for every batch index i of row-major
// local blocks, op(A_i) m×k and op(B_i) k×n, and lays the result out by
// spec, in a block as a says (see gemm).
func bmmLocal(a alloc, bl *kernels.BLAS, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, batch, m, n, k int) (*placement.DTensor, error) {
	lda, ldb := max(1, k), max(1, n)
	if transA {
		lda = max(1, m)
	}
	if transB {
		ldb = max(1, k)
	}
	sa, sb, sc := m*k, k*n, m*n
	var beta float32 // see gemm: a fresh result is already zero
	if a.fresh() {
		beta = 1
	}
	switch xd := x.LocalData().(type) {
	case []float32:
		yd, _ := y.LocalData().([]float32)
		c := block[float32](a, batch*sc)
		if k == 0 {
			clear(c)
		} else if m > 0 && n > 0 {
			for i := range batch {
				if err := bl.Sgemm(transA, transB, m, n, k, 1, xd[i*sa:(i+1)*sa], lda, yd[i*sb:(i+1)*sb], ldb, beta, c[i*sc:(i+1)*sc], max(1, n)); err != nil {
					return nil, fmt.Errorf("autograd: internal: %w", err)
				}
			}
		}
		return placement.NewLocal(spec, c)
	case []float64:
		yd, _ := y.LocalData().([]float64)
		c := block[float64](a, batch*sc)
		if k == 0 {
			clear(c)
		} else if m > 0 && n > 0 {
			for i := range batch {
				if err := bl.Dgemm(transA, transB, m, n, k, 1, xd[i*sa:(i+1)*sa], lda, yd[i*sb:(i+1)*sb], ldb, float64(beta), c[i*sc:(i+1)*sc], max(1, n)); err != nil {
					return nil, fmt.Errorf("autograd: internal: %w", err)
				}
			}
		}
		return placement.NewLocal(spec, c)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// CausalSoftmax returns the softmax over the last dim of scores x
// [..., T, T] with the causal mask: entry (i, j) with j > i is −∞ before
// the softmax and exactly 0 after it. Sharding rule: CausalSoftmaxRule.
// Backward: y⊙(g − Σ_j g⊙y), laid out like g (masked entries get 0).
func CausalSoftmax(x *Value) (*Value, error) {
	const op = "CausalSoftmax"
	return elementwise(op, x, CausalSoftmaxRule, causalOp[float32], causalOp[float64])
}

func causalOp[T float](t *Tape, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "CausalSoftmax"
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

// causalFwd is the masked row softmax of [..., T, T] blocks.
func causalFwd[T float](x []T, tt int) []T {
	out := make([]T, len(x))
	for base := 0; base < len(x); base += tt * tt {
		for i := range tt {
			row := x[base+i*tt : base+(i+1)*tt]
			m := math.Inf(-1)
			for j := 0; j <= i; j++ {
				m = max(m, float64(row[j]))
			}
			s := 0.0
			for j := 0; j <= i; j++ {
				s += math.Exp(float64(row[j]) - m)
			}
			for j := 0; j <= i; j++ {
				out[base+i*tt+j] = T(math.Exp(float64(row[j])-m) / s)
			}
		}
	}
	return out
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
	rec := t.records(q, k, v)
	// P = causal softmax(scale·q·kᵀ), batch blocks of tt×tt; kept for
	// backward when recorded.
	probs := getBuf[float32](t, batch*tt*tt)
	out := resultBlock[float32](t, batch*tt*dv)
	err = kernels.CausalAttentionForward(t.Workers(), out, probs, qd, kd, vd, batch, tt, dh, dv, scale)
	if !rec {
		putBuf(t, probs)
	}
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	res, err := placement.NewLocal(spec, out)
	if err != nil {
		return nil, err
	}
	sq, sk, sv := q.Spec(), k.Spec(), v.Spec()
	needQ, needK, needV := q.requiresGrad, k.requiresGrad, v.requiresGrad
	return t.record(op, res, []*Value{q, k, v}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
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
