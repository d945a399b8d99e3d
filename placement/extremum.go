package placement

import (
	"context"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// ExtremumGrad is the backward of a redistribution that reduced
// Partial(max) or Partial(min) axes, which is not linear and so has no
// plan of its own (Backward rejects it): the gradient goes to the rank whose
// value won. x is the forward source, y the forward result (Redistribute(x,
// y's spec); it must hold no Partial(max|min)), and g the gradient of y, in
// any linear layout on y's mesh. Only y's spec is read.
//
// On every element, the rank of x's reducing axes whose local value equals
// the extremum over those ranks wins, ties to the lowest rank (in
// row-major order over those axes); its gradient is g there and every
// other rank's is zero. The winner is decided from x's pieces themselves
// (an all-reduce of the extremum, then one of the lowest claiming rank),
// never from y: y may have been averaged again (Partial(max) ->
// Partial(avg)), and an average of identical copies over 3 ranks need not
// equal them bit for bit. A NaN extremum (comm/local and NCCL propagate
// NaN, so one is NaN wherever any rank's piece is) is won by the lowest
// rank holding a NaN, whatever its payload: every element, NaN or not,
// has exactly one winner. Summed over the reducing ranks the result is g,
// so it is laid out like x with Partial(max|min) replaced by
// Partial(sum). The other transitions of the forward move are undone by
// the duality table, as in Backward.
func (p *Planner) ExtremumGrad(ctx context.Context, x, y, g *DTensor) (*DTensor, error) {
	const op = "ExtremumGrad"
	if x == nil || y == nil || g == nil {
		return nil, invalidf(op, "nil tensor")
	}
	lx := x.spec.l
	var axes []string
	var reduce comm.ReduceOp
	reduced := slices.Clone(lx.places) // x with the extremum axes replicated
	summed := slices.Clone(lx.places)  // the gradient's layout
	for a, pl := range lx.places {
		if pl.IsPartial() && !linear(pl.op) {
			axes = append(axes, lx.names[a])
			reduce = pl.op // NewSpec allows one extremum op per spec
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
	if err := device.Same("placement: "+op, x.Device(), g.Device()); err != nil {
		return nil, err
	}
	// The gradient laid out like x with the extremum axes replicated, by
	// the duality table of the linear rest of the forward move.
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
	out := &Spec{m: x.spec.m, l: ls}
	if dev := x.Device(); dev.Kind() != device.KindHost {
		return extremumOnDevice(ctx, op, x, gr, out, axes, reduce)
	}
	group, err := x.spec.m.Group(ctx, axes...)
	if err != nil {
		return nil, err
	}
	return extremumMask(ctx, group, reduce, out, x, gr)
}

// extremumOnDevice is ExtremumGrad's last step for x on a device, gr the
// gradient laid out like x (a device block Execute made for this call,
// freed on every path, errors included). No device kernel compares
// pieces yet: the winners are found on host copies of x and the
// gradient, and the result goes back to x's device.
func extremumOnDevice(ctx context.Context, op string, x, gr *DTensor, out *Spec, axes []string, reduce comm.ReduceOp) (res *DTensor, err error) {
	dev := x.Device()
	freed := false
	free := func() error {
		if freed {
			return nil
		}
		freed = true
		if ferr := gr.data.(device.Buffer).Free(); ferr != nil {
			return wrapf(op, ferr, "freeing the gradient's block on %s", dev.Name())
		}
		return nil
	}
	defer func() {
		if ferr := free(); ferr != nil && err == nil {
			res, err = nil, ferr
		}
	}()
	hx, err := x.To(device.Host())
	if err != nil {
		return nil, wrapf(op, err, "copying x's block")
	}
	hg, err := gr.To(device.Host())
	if err != nil {
		return nil, wrapf(op, err, "copying the gradient's block")
	}
	// The copy is on the host now: the device block can go back before
	// the host work and the collective.
	if err := free(); err != nil {
		return nil, err
	}
	group, err := x.spec.m.Group(ctx, axes...)
	if err != nil {
		return nil, err
	}
	h, err := extremumMask(ctx, group, reduce, out, hx, hg)
	if err != nil {
		return nil, err
	}
	return h.To(dev)
}

// extremumMask is ExtremumGrad's last step on host blocks: gr masked to
// the ranks whose x won, laid out by out.
func extremumMask(ctx context.Context, group comm.Communicator, reduce comm.ReduceOp, out *Spec, x, gr *DTensor) (*DTensor, error) {
	switch xd := x.data.(type) {
	case []float32:
		d, err := maskWinners(ctx, group, reduce, xd, gr.data.([]float32))
		if err != nil {
			return nil, err
		}
		return newDTensor(out, block[float32]{shape: slices.Clone(x.shape), data: d}), nil
	default:
		d, err := maskWinners(ctx, group, reduce, xd.([]float64), gr.data.([]float64))
		if err != nil {
			return nil, err
		}
		return newDTensor(out, block[float64]{shape: slices.Clone(x.shape), data: d}), nil
	}
}

// maskWinners returns g where this rank of group is the lowest whose x
// equals the extremum (reduce: Max or Min) of x over group, and zero
// elsewhere. Max and min select one of their inputs, so the all-reduced
// value equals the winning piece exactly.
func maskWinners[T elem](ctx context.Context, group comm.Communicator, reduce comm.ReduceOp, x, g []T) ([]T, error) {
	ext := make([]T, len(x))
	if err := comm.AllReduce(ctx, group, comm.Host(x), comm.Host(ext), reduce); err != nil {
		return nil, err
	}
	me := int32(group.Rank())
	winner := make([]int32, len(x))
	for i := range x {
		winner[i] = int32(group.Size()) // no claim
		// x != x is NaN: a NaN piece wins a NaN extremum.
		if x[i] == ext[i] || (x[i] != x[i] && ext[i] != ext[i]) {
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
