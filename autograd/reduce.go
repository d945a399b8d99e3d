package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Reductions: Sum over dims, its sharding rule (a sum over a sharded dim
// is Partial(sum)) and the local sum and broadcast (its backward) loops.

// Sum sums a over dims (every dim when none are given), removing them from
// the shape. Sharding rule: SumRule; a sum over a sharded dim yields
// Partial(sum) on that axis with no communication. Backward broadcasts the
// gradient over the reduced dims; where the input is sharded over a
// reduced dim the gradient must arrive Replicate on that axis (as it does
// by default for a Partial(sum) result).
func Sum(a *Value, dims ...int) (*Value, error) {
	t, err := checkInputs("Sum", a)
	if err != nil {
		return nil, err
	}
	spec, reduce, err := sumRule(a.Spec(), dims)
	if err != nil {
		return nil, err
	}
	out, err := sumLocal(spec, a.data, reduce)
	if err != nil {
		return nil, err
	}
	in := a.Spec()
	return t.record("Sum", out, []*Value{a}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, "Sum", g, spec)
		if err != nil {
			return nil, err
		}
		pin, pg := in.Placements(), g.Spec().Placements()
		places := make([]placement.Placement, len(pin))
		names := in.Mesh().Names()
		for ax, p := range pin {
			if !p.IsShard() {
				places[ax] = pg[ax]
				continue
			}
			if reduce[p.Dim()] && !pg[ax].IsReplicate() {
				return nil, gradPlacementf("Sum", "the gradient of the result arrives as %v on mesh axis %q, where the input is %v over a summed dim; it must be R there (a reduce-scatter or all-reduce first), and autograd inserts no communication", pg[ax], names[ax], p)
			}
			places[ax] = p
		}
		gspec, err := specWith(in, in.Shape(), places, ordersOf(in))
		if err != nil {
			return nil, err
		}
		ga, err := broadcastLocal(t, gspec, g, reduce)
		return []*placement.DTensor{ga}, err
	}), nil
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

// sumLocal sums x's local block over the reduced dims; spec is the
// result's layout.
func sumLocal(spec *placement.Spec, x *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	shape := x.LocalShape()
	switch d := x.LocalData().(type) {
	case []float32:
		return placement.NewLocal(spec, sumT(d, shape, reduce))
	case []float64:
		return placement.NewLocal(spec, sumT(d, shape, reduce))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// broadcastLocal expands g's local block over the reduced dims of spec's
// local shape into t's arena (a gradient); spec is the result's layout.
func broadcastLocal(t *Tape, spec *placement.Spec, g *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	shape := spec.LocalShape()
	want := 1
	for d, s := range shape {
		if !reduce[d] {
			want *= s
		}
	}
	switch d := g.LocalData().(type) {
	case []float32:
		if len(d) != want {
			return nil, fmt.Errorf("autograd: internal: gradient block %v does not fit %v", g.LocalShape(), shape)
		}
		return placement.NewLocal(spec, broadcastT(getBuf[float32](t, prod(shape)), d, shape, reduce))
	case []float64:
		if len(d) != want {
			return nil, fmt.Errorf("autograd: internal: gradient block %v does not fit %v", g.LocalShape(), shape)
		}
		return placement.NewLocal(spec, broadcastT(getBuf[float64](t, prod(shape)), d, shape, reduce))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", g.LocalData())
}

// reduceIndex returns, for a row-major array of shape, the strides that map
// each element to its position in the array with the reduced dims removed
// (stride 0 on reduced dims).
func reduceIndex(shape []int, reduce []bool) []int {
	st := make([]int, len(shape))
	s := 1
	for d := len(shape) - 1; d >= 0; d-- {
		if reduce[d] {
			continue
		}
		st[d] = s
		s *= shape[d]
	}
	return st
}

// forEach calls f(i, j) for every element i of a row-major array of shape,
// with j its index under the strides st.
func forEach(shape, st []int, f func(i, j int)) {
	n := prod(shape)
	if n == 0 {
		return
	}
	idx := make([]int, len(shape))
	j := 0
	for i := range n {
		f(i, j)
		for d := len(shape) - 1; d >= 0; d-- {
			idx[d]++
			j += st[d]
			if idx[d] < shape[d] {
				break
			}
			j -= st[d] * shape[d]
			idx[d] = 0
		}
	}
}

func sumT[T float](x []T, shape []int, reduce []bool) []T {
	if !slices.Contains(reduce, false) { // every dim: one total, in the same order
		var s T
		for _, v := range x {
			s += v
		}
		return []T{s}
	}
	st := reduceIndex(shape, reduce)
	n := 1
	for d, s := range shape {
		if !reduce[d] {
			n *= s
		}
	}
	out := make([]T, n)
	forEach(shape, st, func(i, j int) { out[j] += x[i] })
	return out
}

func broadcastT[T float](out, g []T, shape []int, reduce []bool) []T {
	if !slices.Contains(reduce, false) && len(g) == 1 { // a scalar everywhere
		for i := range out {
			out[i] = g[0]
		}
		return out
	}
	st := reduceIndex(shape, reduce)
	forEach(shape, st, func(i, j int) { out[i] = g[j] })
	return out
}
