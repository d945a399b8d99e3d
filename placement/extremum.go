package placement

import (
	"context"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// ExtremumGrad is the backward of a redistribution that reduced
// Partial(max) or Partial(min) axes, which is not linear and so has no
// plan of its own (Backward rejects it): the gradient goes to the rank whose
// value won. x is the forward source, y the forward result (Redistribute(x,
// y's spec); it must hold no Partial(max|min)), and g the gradient of y, in
// any linear layout on y's mesh.
//
// On every element, the rank of x's reducing axes whose local value equals
// the result wins, ties to the lowest rank (in row-major order over those
// axes); its gradient is g there and every other rank's is zero. Summed
// over those ranks this is g, so the result is laid out like x with
// Partial(max|min) replaced by Partial(sum). The other transitions of the
// forward move are undone by the duality table, as in Backward.
func (p *Planner) ExtremumGrad(ctx context.Context, x, y, g *DTensor) (*DTensor, error) {
	const op = "ExtremumGrad"
	if x == nil || y == nil || g == nil {
		return nil, invalidf(op, "nil tensor")
	}
	lx := x.spec.l
	var axes []string
	reduced := slices.Clone(lx.places) // x with the extremum axes replicated
	summed := slices.Clone(lx.places)  // the gradient's layout
	for a, pl := range lx.places {
		if pl.IsPartial() && !linear(pl.op) {
			axes = append(axes, lx.names[a])
			reduced[a], summed[a] = Replicate(), Partial(comm.Sum)
		}
	}
	if axes == nil {
		return nil, invalidf(op, "the source %s has no Partial(max|min) axis; use Backward", lx)
	}
	for a, pl := range y.spec.l.places {
		if pl.IsPartial() && !linear(pl.op) {
			return nil, invalidf(op, "the result %s still holds %v on axis %q: reduce it first", y.spec.l, pl, y.spec.l.names[a])
		}
	}
	orders := map[int][]int{}
	for d, o := range lx.order {
		orders[d] = o
	}
	lr, err := lx.withPlacements(reduced, orders)
	if err != nil {
		return nil, err
	}
	ls, err := lx.withPlacements(summed, orders)
	if err != nil {
		return nil, err
	}
	rspec := &Spec{m: x.spec.m, l: lr}
	// The forward result and its gradient, both laid out like x with the
	// extremum axes replicated: every rank then compares its own piece
	// with the result it contributed to, element by element.
	yr, err := p.Redistribute(ctx, y, rspec)
	if err != nil {
		return nil, err
	}
	lin, err := p.planLayouts(lr, y.spec.l)
	if err != nil {
		return nil, err
	}
	back, err := p.Backward(lin, g.spec)
	if err != nil {
		return nil, err
	}
	gr, err := p.Execute(ctx, back, g, x.spec.m)
	if err != nil {
		return nil, err
	}
	group, err := x.spec.m.Group(ctx, axes...)
	if err != nil {
		return nil, err
	}
	out := &Spec{m: x.spec.m, l: ls}
	switch xd := x.data.(type) {
	case []float32:
		d, err := maskWinners(ctx, group, xd, yr.data.([]float32), gr.data.([]float32))
		if err != nil {
			return nil, err
		}
		return newDTensor(out, block[float32]{shape: x.shape, data: d}), nil
	default:
		d, err := maskWinners(ctx, group, xd.([]float64), yr.data.([]float64), gr.data.([]float64))
		if err != nil {
			return nil, err
		}
		return newDTensor(out, block[float64]{shape: x.shape, data: d}), nil
	}
}

// maskWinners returns g where this rank of group is the lowest whose x
// equals the result y, and zero elsewhere.
func maskWinners[T elem](ctx context.Context, group comm.Communicator, x, y, g []T) ([]T, error) {
	me := int32(group.Rank())
	winner := make([]int32, len(x))
	for i := range x {
		winner[i] = int32(group.Size()) // no claim
		if x[i] == y[i] {
			winner[i] = me
		}
	}
	w := comm.Host(winner)
	if err := comm.AllReduce(ctx, group, w, w, comm.Min); err != nil {
		return nil, err
	}
	out := make([]T, len(x))
	for i := range out {
		if winner[i] == me {
			out[i] = g[i]
		}
	}
	return out, nil
}
