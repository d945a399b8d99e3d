package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Sharding rules of Narrow, Concat, BatchedMatMul and CausalSoftmax.

// NarrowRule is the sharding rule of Narrow(x, dim, start, length): dim
// (negative counts from the end) must not be sharded ("narrow over a
// sharded dim": each rank holds a different slice of it); Replicate,
// Shard of other dims and Partial (narrowing is linear) are kept. The
// result has length entries along dim.
func NarrowRule(x *placement.Spec, dim, start, length int) (*placement.Spec, error) {
	s, _, err := narrowRule(x, dim, start, length)
	return s, err
}

func narrowRule(x *placement.Spec, dim, start, length int) (*placement.Spec, int, error) {
	const op = "Narrow"
	if x == nil {
		return nil, 0, invalidf(op, "nil spec")
	}
	sh := x.Shape()
	d, err := normDim(op, dim, len(sh))
	if err != nil {
		return nil, 0, err
	}
	if start < 0 || length <= 0 || start+length > sh[d] {
		return nil, 0, invalidf(op, "range [%d, %d) does not fit dim %d of size %d", start, start+length, d, sh[d])
	}
	if o := x.Order(d); len(o) > 0 {
		return nil, 0, rulef(op, "narrow over a sharded dim: x is sharded on dim %d by mesh axes %v; redistribute that dim to Replicate first (or, for a fused q|k|v projection, interleave the weight's rows per rank so that the split is local)", d, o)
	}
	if err := sumOnly(op, "x", x, "narrowing is linear only over Partial(sum)"); err != nil {
		return nil, 0, err
	}
	sh[d] = length
	out, err := specWith(x, sh, x.Placements(), ordersOf(x))
	if err != nil {
		return nil, 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, d, nil
}

// ConcatRule is the sharding rule of Concat along dim: the inputs have
// equal shapes except along dim, the same placements (Replicate, Shard or
// Partial(sum), as for Add) and shard orders, and dim is not sharded. The
// result has their placements.
func ConcatRule(dim int, xs ...*placement.Spec) (*placement.Spec, error) {
	s, _, err := concatRule(dim, xs)
	return s, err
}

func concatRule(dim int, xs []*placement.Spec) (*placement.Spec, int, error) {
	const op = "Concat"
	if len(xs) == 0 {
		return nil, 0, invalidf(op, "no inputs")
	}
	for i, x := range xs {
		if x == nil {
			return nil, 0, invalidf(op, "input %d has a nil spec", i)
		}
	}
	first := xs[0]
	sh := first.Shape()
	d, err := normDim(op, dim, len(sh))
	if err != nil {
		return nil, 0, err
	}
	if err := sumOnly(op, "input 0", first, "concatenation is linear only over Partial(sum)"); err != nil {
		return nil, 0, err
	}
	if o := first.Order(d); len(o) > 0 {
		return nil, 0, rulef(op, "concat along a sharded dim: input 0 is sharded on dim %d by mesh axes %v; redistribute that dim to Replicate first", d, o)
	}
	total := 0
	names := first.Mesh().Names()
	for i, x := range xs {
		if err := compatible(op, first, x); err != nil {
			return nil, 0, err
		}
		s := x.Shape()
		if len(s) != len(sh) {
			return nil, 0, invalidf(op, "input %d has shape %v, input 0 %v", i, s, sh)
		}
		for k := range s {
			if k != d && s[k] != sh[k] {
				return nil, 0, invalidf(op, "input %d has shape %v, input 0 %v: they may differ only along dim %d", i, s, sh, d)
			}
		}
		total += s[d]
		p0, pi := first.Placements(), x.Placements()
		for ax := range p0 {
			if p0[ax] != pi[ax] {
				return nil, 0, rulef(op, "input 0 is %v but input %d is %v on mesh axis %q; all inputs need the same placement: redistribute input %d to %v", p0[ax], i, pi[ax], names[ax], i, p0[ax])
			}
		}
		for k := range s {
			if !slices.Equal(first.Order(k), x.Order(k)) {
				return nil, 0, rulef(op, "input %d shards dim %d over mesh axes %v but input 0 over %v; redistribute it to input 0's spec", i, k, x.Order(k), first.Order(k))
			}
		}
	}
	sh[d] = total
	out, err := specWith(first, sh, first.Placements(), ordersOf(first))
	if err != nil {
		return nil, 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, d, nil
}

// bmmCase is the per-axis case BatchedMatMulRule chose.
type bmmCase uint8

const (
	bmmBatch bmmCase = iota // both S(d) on a batch dim
	bmmRows                 // a S(m), b R
	bmmCols                 // a R, b S(n)
	bmmInner                // a S(k), b S(k): P(sum)
	bmmRep                  // R, R
	bmmPartA                // P(sum), R
	bmmPartB                // R, P(sum)
)

const bmmPairs = "(S(d), S(d)) -> S(d) for a batch dim d; (S(m), R) -> S(m); (R, S(n)) -> S(n); (S(k) of a, S(k) of b) -> P(sum); (R, R) -> R; (P(sum), R) -> P(sum); (R, P(sum)) -> P(sum)"

// BatchedMatMulRule is the sharding rule of BatchedMatMul for a
// [..., m, k] and b [..., k, n] with equal batch dims (no broadcasting).
// With r the rank of the tensors, per mesh axis (a, b) -> result:
//
//	(S(d), S(d))     -> S(d)    d < r−2, a batch dim (heads, batch)
//	(S(r−2), R)      -> S(r−2)  rows of a
//	(R, S(r−1))      -> S(r−1)  columns of b
//	(S(r−1), S(r−2)) -> P(sum)  contraction sharded
//	(R, R)           -> R
//	(P(sum), R)      -> P(sum)
//	(R, P(sum))      -> P(sum)
//
// Every other pair is an error naming the axis and the valid pairs. Each
// dim shared by both (batch dims, the contraction) must be sharded by the
// same axes in the same order.
func BatchedMatMulRule(a, b *placement.Spec) (*placement.Spec, error) {
	s, _, err := bmmRule(a, b)
	return s, err
}

func bmmRule(a, b *placement.Spec) (*placement.Spec, []bmmCase, error) {
	const op = "BatchedMatMul"
	if err := compatible(op, a, b); err != nil {
		return nil, nil, err
	}
	sa, sb := a.Shape(), b.Shape()
	r := len(sa)
	if r < 2 || len(sb) != r || !slices.Equal(sa[:r-2], sb[:r-2]) || sa[r-1] != sb[r-2] {
		return nil, nil, invalidf(op, "want a [..., m, k] and b [..., k, n] with equal batch dims; got %v and %v", sa, sb)
	}
	names := a.Mesh().Names()
	pa, pb := a.Placements(), b.Placements()
	out := make([]placement.Placement, len(pa))
	cases := make([]bmmCase, len(pa))
	sum := placement.Partial(comm.Sum)
	for ax := range pa {
		x, y := pa[ax], pb[ax]
		for _, in := range []struct {
			what string
			p    placement.Placement
		}{{"a", x}, {"b", y}} {
			if in.p.IsPartial() && in.p.Op() != comm.Sum {
				return nil, nil, rulef(op, "%s is %v on mesh axis %q: BatchedMatMul is linear in each input only over Partial(sum); redistribute it first", in.what, in.p, names[ax])
			}
		}
		switch {
		case x.IsShard() && x.Dim() < r-2 && x == y:
			cases[ax], out[ax] = bmmBatch, x
		case x == placement.Shard(r-2) && y.IsReplicate():
			cases[ax], out[ax] = bmmRows, x
		case x.IsReplicate() && y == placement.Shard(r-1):
			cases[ax], out[ax] = bmmCols, y
		case x == placement.Shard(r-1) && y == placement.Shard(r-2):
			cases[ax], out[ax] = bmmInner, sum
		case x.IsReplicate() && y.IsReplicate():
			cases[ax], out[ax] = bmmRep, x
		case x == sum && y.IsReplicate():
			cases[ax], out[ax] = bmmPartA, sum
		case x.IsReplicate() && y == sum:
			cases[ax], out[ax] = bmmPartB, sum
		case x.IsPartial() && y.IsPartial():
			return nil, nil, rulef(op, "a and b are both P(sum) on mesh axis %q: the product of two sums is not the sum of the products; redistribute one of them to R first", names[ax])
		default:
			return nil, nil, rulef(op, "a is %v and b is %v on mesh axis %q; valid pairs per axis: %s", x, y, names[ax], bmmPairs)
		}
	}
	for d := range r - 2 {
		if !slices.Equal(a.Order(d), b.Order(d)) {
			return nil, nil, rulef(op, "batch dim %d is sharded over mesh axes %v in a but %v in b; they must match", d, a.Order(d), b.Order(d))
		}
	}
	if oa, ob := a.Order(r-1), b.Order(r-2); !slices.Equal(oa, ob) {
		return nil, nil, rulef(op, "the contraction dim is sharded over mesh axes %v in a but %v in b; they must match", oa, ob)
	}
	shape := slices.Clone(sa)
	shape[r-1] = sb[r-1]
	orders := ordersOf(a)
	orders[r-1] = b.Order(r - 1)
	s, err := specWith(a, shape, out, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return s, cases, nil
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
