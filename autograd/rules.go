package autograd

import (
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Sharding rules: given input specs, the output spec or an error (wrapping
// ErrRule for placements, ErrInvalid for shapes, dtypes and meshes) that
// names the mismatch and the placements that would work. A rule never
// implies communication: an op whose rule accepts its inputs computes on
// local blocks only.

// compatible checks that two specs live on the same mesh layout with the
// same dtype.
func compatible(op string, a, b *placement.Spec) error {
	if a == nil || b == nil {
		return invalidf(op, "nil spec")
	}
	ma, mb := a.Mesh(), b.Mesh()
	if ma.World() != mb.World() || !slices.Equal(ma.Names(), mb.Names()) || !slices.Equal(ma.Shape(), mb.Shape()) || !slices.Equal(ma.WorldRanks(), mb.WorldRanks()) {
		return invalidf(op, "inputs live on different meshes (%v and %v); redistribute one onto the other's mesh", ma, mb)
	}
	if a.DType() != b.DType() {
		return invalidf(op, "dtypes differ: %v and %v", a.DType(), b.DType())
	}
	return nil
}

// specWith builds a spec on s's mesh and dtype with the given shape and
// placements and the given shard orders (tensor dim -> axis names).
func specWith(s *placement.Spec, shape []int, places []placement.Placement, orders map[int][]string) (*placement.Spec, error) {
	var opts []placement.SpecOption
	for d := range shape {
		if o := orders[d]; len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	return placement.NewSpec(s.Mesh(), shape, s.DType(), places, opts...)
}

// ordersOf returns s's shard orders by tensor dim.
func ordersOf(s *placement.Spec) map[int][]string {
	out := map[int][]string{}
	for d := range s.Shape() {
		out[d] = s.Order(d)
	}
	return out
}

// sumOnly rejects Partial placements other than Partial(sum).
func sumOnly(op, what string, s *placement.Spec, why string) error {
	names := s.Mesh().Names()
	for a, p := range s.Placements() {
		if p.IsPartial() && p.Op() != comm.Sum {
			return rulef(op, "%s is %v on mesh axis %q: %s; redistribute it to Replicate (all-reduce) or Shard (reduce-scatter) first", what, p, names[a], why)
		}
	}
	return nil
}

// AddRule is the sharding rule of Add: both inputs must have the same
// global shape (no broadcasting) and the same spec. Replicate, Shard(d) and
// Partial(sum) are accepted; the result has the inputs' spec (the sum of
// two Partial(sum) values is Partial(sum)). Partial(avg|max|min) is
// rejected, and so is Partial(sum) against Replicate: adding a replicated
// value on every rank would count it once per rank.
func AddRule(a, b *placement.Spec) (*placement.Spec, error) {
	return elementwiseRule("Add", a, b, true)
}

// MulRule is the sharding rule of Mul: the same as AddRule, except that Mul
// is nonlinear in each input, so no Partial input is accepted.
func MulRule(a, b *placement.Spec) (*placement.Spec, error) {
	return elementwiseRule("Mul", a, b, false)
}

func elementwiseRule(op string, a, b *placement.Spec, linear bool) (*placement.Spec, error) {
	if err := compatible(op, a, b); err != nil {
		return nil, err
	}
	if !slices.Equal(a.Shape(), b.Shape()) {
		return nil, invalidf(op, "global shapes %v and %v differ (no broadcasting)", a.Shape(), b.Shape())
	}
	names := a.Mesh().Names()
	for _, in := range []struct {
		what string
		s    *placement.Spec
	}{{"a", a}, {"b", b}} {
		if !linear {
			for ax, p := range in.s.Placements() {
				if p.IsPartial() {
					return nil, rulef(op, "%s is %v on mesh axis %q: nonlinear op on a Partial input: redistribute it first (to Replicate or Shard)", in.what, p, names[ax])
				}
			}
			continue
		}
		if err := sumOnly(op, in.what, in.s, "elementwise ops take only Partial(sum), which they keep linear"); err != nil {
			return nil, err
		}
	}
	pa, pb := a.Placements(), b.Placements()
	for ax := range pa {
		x, y := pa[ax], pb[ax]
		if x == y {
			continue
		}
		switch {
		case x.IsPartial() && y.IsReplicate(), x.IsReplicate() && y.IsPartial():
			p, r := "a", "b"
			if y.IsPartial() {
				p, r = "b", "a"
			}
			return nil, rulef(op, "a is %v but b is %v on mesh axis %q: adding a replicated value to a partial one would count it once per rank; redistribute %s to R (all-reduce), or %s to P(sum) (local, no communication)", x, y, names[ax], p, r)
		case x.IsPartial() || y.IsPartial():
			p, s, sp := "a", "b", y
			if y.IsPartial() {
				p, s, sp = "b", "a", x
			}
			return nil, rulef(op, "a is %v but b is %v on mesh axis %q: redistribute %s to %v (reduce-scatter), or %s to P(sum) (local, no communication)", x, y, names[ax], p, sp, s)
		default:
			return nil, rulef(op, "a is %v but b is %v on mesh axis %q: both inputs need the same placement; redistribute b to %v or a to %v", x, y, names[ax], x, y)
		}
	}
	if !a.Equal(b) {
		return nil, rulef(op, "a (%v) and b (%v) shard a dim over the same axes in different orders; redistribute one to the other's spec", a, b)
	}
	return a, nil
}

// ScaleRule is the sharding rule of Scale (multiplication by a constant):
// the result has the input's spec. Replicate, Shard and Partial(sum) are
// accepted; Partial(avg|max|min) is rejected like in every elementwise op.
func ScaleRule(a *placement.Spec) (*placement.Spec, error) {
	if a == nil {
		return nil, invalidf("Scale", "nil spec")
	}
	if err := sumOnly("Scale", "the input", a, "elementwise ops take only Partial(sum), which they keep linear"); err != nil {
		return nil, err
	}
	return a, nil
}

// SumRule is the sharding rule of Sum over dims (all dims when none are
// given; the reduced dims are removed from the shape, so summing all dims
// gives a scalar of shape []). Per mesh axis: Shard(d) with d reduced
// becomes Partial(sum) (each rank sums its own rows, no communication);
// Shard(d) with d kept becomes Shard of d's new index; Replicate and
// Partial(sum) are kept. Partial(avg|max|min) is rejected.
func SumRule(a *placement.Spec, dims ...int) (*placement.Spec, error) {
	out, _, err := sumRule(a, dims)
	return out, err
}

// sumRule also returns which dims are reduced.
func sumRule(a *placement.Spec, dims []int) (*placement.Spec, []bool, error) {
	const op = "Sum"
	if a == nil {
		return nil, nil, invalidf(op, "nil spec")
	}
	shape := a.Shape()
	reduce := make([]bool, len(shape))
	if len(dims) == 0 {
		for d := range reduce {
			reduce[d] = true
		}
	}
	for _, d := range dims {
		if d < 0 || d >= len(shape) {
			return nil, nil, invalidf(op, "dim %d out of range for a %d-d tensor", d, len(shape))
		}
		if reduce[d] {
			return nil, nil, invalidf(op, "dim %d given twice", d)
		}
		reduce[d] = true
	}
	if err := sumOnly(op, "the input", a, "a sum is linear only over Partial(sum)"); err != nil {
		return nil, nil, err
	}
	newDim := make([]int, len(shape))
	var outShape []int
	for d, s := range shape {
		newDim[d] = -1
		if !reduce[d] {
			newDim[d] = len(outShape)
			outShape = append(outShape, s)
		}
	}
	places := a.Placements()
	for ax, p := range places {
		if p.IsShard() {
			if nd := newDim[p.Dim()]; nd < 0 {
				places[ax] = placement.Partial(comm.Sum)
			} else {
				places[ax] = placement.Shard(nd)
			}
		}
	}
	orders := map[int][]string{}
	for d, o := range ordersOf(a) {
		if newDim[d] >= 0 {
			orders[newDim[d]] = o
		}
	}
	out, err := specWith(a, outShape, places, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, reduce, nil
}

// MatMul placements per mesh axis: a is [m, k], b is [k, n].
const matmulPairs = "(S(0), R)->S(0), (R, S(1))->S(1), (S(1), S(0))->P(sum), (R, R)->R, (P(sum), R)->P(sum), (R, P(sum))->P(sum)"

// MatMulRule is the sharding rule of MatMul for a [m, k] times b [k, n].
// Per mesh axis (a, b) -> result:
//
//	(S(0), R)      -> S(0)    rows of a
//	(R, S(1))      -> S(1)    columns of b
//	(S(1), S(0))   -> P(sum)  contraction sharded: partial products
//	(R, R)         -> R
//	(P(sum), R)    -> P(sum)  linear in a
//	(R, P(sum))    -> P(sum)  linear in b
//
// Both Partial on one axis is an error (the product of two sums is not the
// sum of the products), as is every other pair; the error lists what b
// would need given a. When several axes shard the contraction dim, a's dim
// 1 and b's dim 0 must be sharded in the same order.
func MatMulRule(a, b *placement.Spec) (*placement.Spec, error) {
	const op = "MatMul"
	if err := compatible(op, a, b); err != nil {
		return nil, err
	}
	sa, sb := a.Shape(), b.Shape()
	if len(sa) != 2 || len(sb) != 2 {
		return nil, invalidf(op, "MatMul takes 2-d tensors; got shapes %v and %v", sa, sb)
	}
	if sa[1] != sb[0] {
		return nil, invalidf(op, "inner dims differ: a is %v, b is %v", sa, sb)
	}
	names := a.Mesh().Names()
	pa, pb := a.Placements(), b.Placements()
	out := make([]placement.Placement, len(pa))
	for ax := range pa {
		x, y := pa[ax], pb[ax]
		for _, in := range []struct {
			what string
			p    placement.Placement
		}{{"a", x}, {"b", y}} {
			if in.p.IsPartial() && in.p.Op() != comm.Sum {
				return nil, rulef(op, "%s is %v on mesh axis %q: MatMul is linear in each input only over Partial(sum); redistribute it to Replicate or Shard first", in.what, in.p, names[ax])
			}
		}
		r, ok := matmulAxis(x, y)
		if ok {
			out[ax] = r
			continue
		}
		if x.IsPartial() && y.IsPartial() {
			return nil, rulef(op, "a and b are both P(sum) on mesh axis %q: the product of two sums is not the sum of the products; redistribute one of them to R (all-reduce) first", names[ax])
		}
		return nil, rulef(op, "a is %v and b is %v on mesh axis %q; with a %v, b would need %s (valid pairs per axis: %s)", x, y, names[ax], x, partners(x), matmulPairs)
	}
	if oa, ob := a.Order(1), b.Order(0); !slices.Equal(oa, ob) {
		return nil, rulef(op, "the contraction dim is sharded over mesh axes %v in a but %v in b; they must match so that each rank holds the same slice of k", oa, ob)
	}
	return specWith(a, []int{sa[0], sb[1]}, out, map[int][]string{0: a.Order(0), 1: b.Order(1)})
}

// matmulAxis is the per-axis table of MatMulRule.
func matmulAxis(x, y placement.Placement) (placement.Placement, bool) {
	sum := placement.Partial(comm.Sum)
	switch {
	case x == placement.Shard(0) && y.IsReplicate():
		return x, true
	case x.IsReplicate() && y == placement.Shard(1):
		return y, true
	case x == placement.Shard(1) && y == placement.Shard(0):
		return sum, true
	case x.IsReplicate() && y.IsReplicate():
		return x, true
	case x == sum && y.IsReplicate(), x.IsReplicate() && y == sum:
		return sum, true
	}
	return placement.Placement{}, false
}

// partners lists the b placements that pair with a's placement x.
func partners(x placement.Placement) string {
	switch {
	case x.IsReplicate():
		return "R, S(1) or P(sum)"
	case x == placement.Shard(0):
		return "R"
	case x == placement.Shard(1):
		return "S(0)"
	case x.IsPartial():
		return "R"
	}
	return "nothing: redistribute a to R, S(0) or S(1)"
}

// RedistributeRule checks a redistribution from src to dst: the same global
// shape and dtype, on the same mesh or another mesh over the same world;
// the result has dst. Any pair of linear placements is accepted (the move
// is explicit, so it may communicate); for differentiation, dst must not
// hold Partial(max|min), which has no gradient layout (Redistribute checks
// that when it records).
func RedistributeRule(src, dst *placement.Spec) (*placement.Spec, error) {
	const op = "Redistribute"
	if src == nil || dst == nil {
		return nil, invalidf(op, "nil spec")
	}
	if src.Mesh().World() != dst.Mesh().World() {
		return nil, invalidf(op, "source and destination meshes are built on different world communicators")
	}
	if !slices.Equal(src.Shape(), dst.Shape()) || src.DType() != dst.DType() {
		return nil, invalidf(op, "source %v and destination %v differ in global shape or dtype", src, dst)
	}
	for _, s := range []*placement.Spec{src, dst} {
		if slices.ContainsFunc(s.Placements(), placement.Placement.IsRouted) {
			return nil, rulef(op, "%v is Routed: the moe package's dispatch and combine move Routed tensors", s)
		}
	}
	return dst, nil
}

// extremumAxes names the axes of s that are Partial(max|min).
func extremumAxes(s *placement.Spec) string {
	var out []string
	names := s.Mesh().Names()
	for a, p := range s.Placements() {
		if p.IsPartial() && (p.Op() == comm.Max || p.Op() == comm.Min) {
			out = append(out, fmt.Sprintf("%v on %q", p, names[a]))
		}
	}
	return strings.Join(out, ", ")
}
