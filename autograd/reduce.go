package autograd

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
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
	var out *placement.DTensor
	if d, ok := onDevice(a.data); ok {
		out, err = devSum(t, d, spec, a.data, reduce)
	} else {
		out, err = sumLocal(spec, a.data, reduce)
	}
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
				places[ax] = p.WithDim(nd)
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

// sumLocal sums x's local block over the reduced dims (kernels.SumDims);
// spec is the result's layout.
func sumLocal(spec *placement.Spec, x *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	shape := x.LocalShape()
	switch d := x.LocalData().(type) {
	case []float32:
		return sumT(spec, d, shape, reduce)
	case []float64:
		return sumT(spec, d, shape, reduce)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

func sumT[T float](spec *placement.Spec, x []T, shape []int, reduce []bool) (*placement.DTensor, error) {
	out := make([]T, prod(spec.LocalShape()))
	if err := kernels.SumDims(out, x, shape, reduce); err != nil {
		return nil, fmt.Errorf("autograd: Sum: internal: %w", err)
	}
	return placement.NewLocal(spec, out)
}

// broadcastLocal expands g's local block over the reduced dims of spec's
// local shape (kernels.BroadcastDims) into t's arena (a gradient); spec
// is the result's layout.
func broadcastLocal(t *Tape, spec *placement.Spec, g *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	if d, ok := onDevice(g); ok {
		return devBroadcast(t, d, spec, g, reduce)
	}
	shape := spec.LocalShape()
	switch d := g.LocalData().(type) {
	case []float32:
		return broadcastT(spec, getBuf[float32](t, prod(shape)), d, shape, reduce)
	case []float64:
		return broadcastT(spec, getBuf[float64](t, prod(shape)), d, shape, reduce)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", g.LocalData())
}

func broadcastT[T float](spec *placement.Spec, out, g []T, shape []int, reduce []bool) (*placement.DTensor, error) {
	if err := kernels.BroadcastDims(out, g, shape, reduce); err != nil {
		return nil, fmt.Errorf("autograd: Sum: internal: gradient block does not fit %v: %w", shape, err)
	}
	return placement.NewLocal(spec, out)
}
