package placement

import (
	"context"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// cotangent returns the layout of the gradient of a value laid out by l:
// Partial(sum|avg) axes become Replicate, everything else is kept. A
// Partial(max|min) value has no linear gradient layout.
func cotangent(op string, l *layout) (*layout, error) {
	places := slices.Clone(l.places)
	for a, p := range places {
		if p.IsPartial() {
			if !linear(p.op) {
				return nil, unsupportedf(op, "%v on mesh axis %q is not linear: its gradient goes to the rank whose value won (ties to the lowest rank), which needs the forward values: use Planner.ExtremumGrad", p, l.names[a])
			}
			places[a] = Replicate()
		}
	}
	orders := map[int][]int{}
	for d, o := range l.order {
		orders[d] = o
	}
	return l.withPlacements(places, orders)
}

// GradSpec returns the spec a gradient of a tensor with spec s takes by
// default: the same, with Partial(sum|avg) axes Replicate (the gradient of
// a Partial value is Replicate). Partial(max|min) is rejected with
// ErrUnsupported.
func GradSpec(s *Spec) (*Spec, error) {
	if s == nil {
		return nil, invalidf("GradSpec", "nil spec")
	}
	l, err := cotangent("GradSpec", s.l)
	if err != nil {
		return nil, err
	}
	return &Spec{m: s.m, l: l}, nil
}

// Backward returns the plan that moves a gradient from the placement it
// arrives in to the forward source's gradient placement (docs/design.md §3: a
// gradient is itself a DTensor; the gradient of a Partial source is
// Replicate). grad is the spec the gradient arrives in on the forward
// destination's mesh; nil means the default, GradSpec of the destination
// (Partial -> Replicate). Per step this yields the duality table: an
// all-gather's dual is a local chunk (grad Replicate) or a reduce-scatter
// (grad Partial); an all-reduce's is the identity; a reduce-scatter's an
// all-gather; an all-to-all(i->j)'s an all-to-all(j->i); a chunk's an
// all-gather; R->P(sum)'s the identity; S->P(sum)'s a local chunk; a
// cross-mesh move's the reverse move. Plans touching Partial(max|min) return
// ErrUnsupported: that gradient is not linear. Run the result with Execute,
// passing the forward source's mesh.
func (p *Planner) Backward(fwd *Plan, grad *Spec) (*Plan, error) {
	const op = "Backward"
	if fwd == nil {
		return nil, invalidf(op, "nil plan")
	}
	target, err := cotangent(op, fwd.src)
	if err != nil {
		return nil, err
	}
	var from *layout
	if grad == nil {
		if from, err = cotangent(op, fwd.dst); err != nil {
			return nil, err
		}
	} else {
		from = grad.l
		if !from.sameMesh(fwd.dst) || !slices.Equal(from.shape, fwd.dst.shape) || from.dtype != fwd.dst.dtype {
			return nil, invalidf(op, "the gradient spec %s does not match the forward destination %s (mesh, shape and dtype must agree)", from, fwd.dst)
		}
		for a, pl := range from.places {
			if pl.IsPartial() && !linear(pl.op) {
				return nil, unsupportedf(op, "a gradient cannot arrive as %v (mesh axis %q)", pl, from.names[a])
			}
		}
	}
	return p.planLayouts(from, target)
}

// Inner returns the global inner product <a, b> computed across ranks: each
// rank takes the dot product of its two local blocks, weighted so that
// replicas count once and Partial values reduce correctly, and the results
// are summed over the mesh. a and b must have the same mesh, shape, dtype
// and shard layout; on every axis their placements must be equal Shards,
// both Routed with equal row counts, both Replicate, or Partial(sum|avg)
// paired with Replicate (a value paired with its gradient). It is the
// pairing of the adjoint test.
func Inner(ctx context.Context, a, b *DTensor) (float64, error) {
	const op = "Inner"
	if a == nil || b == nil {
		return 0, invalidf(op, "nil tensor")
	}
	la, lb := a.spec.l, b.spec.l
	if a.spec.m.World() != b.spec.m.World() || !la.sameMesh(lb) || !slices.Equal(la.shape, lb.shape) || la.dtype != lb.dtype {
		return 0, invalidf(op, "tensors %s and %s differ in mesh, shape or dtype", la, lb)
	}
	coord := a.spec.m.Coord()
	w := 1.0
	for ax := range la.places {
		pa, pb := la.places[ax], lb.places[ax]
		k := la.mshape[ax]
		switch {
		case pa.IsShard() && pa == pb:
		case pa.IsRouted() && pb.IsRouted():
			if la.rows == nil || !slices.Equal(la.rows, lb.rows) {
				return 0, invalidf(op, "Routed on axis %q: the row counts %v and %v must be given and equal", la.names[ax], la.rows, lb.rows)
			}
		case pa.IsReplicate() && pb.IsReplicate():
			if coord[ax] != 0 {
				w = 0
			}
		case pa.IsPartial() && pb.IsReplicate(), pa.IsReplicate() && pb.IsPartial():
			op2 := pa.op | pb.op
			switch op2 {
			case comm.Sum:
			case comm.Avg:
				w /= float64(k)
			default:
				return 0, invalidf(op, "%v paired with %v on axis %q: only Partial(sum|avg) pairs with Replicate", pa, pb, la.names[ax])
			}
		default:
			return 0, invalidf(op, "placements %v and %v on axis %q do not pair (want equal shards, R with R, or P(sum|avg) with R)", pa, pb, la.names[ax])
		}
	}
	for d := range la.order {
		if !slices.Equal(la.order[d], lb.order[d]) {
			return 0, invalidf(op, "shard orders of dim %d differ: %v vs %v", d, la.axisNames(la.order[d]), lb.axisNames(lb.order[d]))
		}
	}
	if err := device.Same("placement: "+op, a.Device(), b.Device()); err != nil {
		return 0, err
	}
	s := 0.0
	if w != 0 {
		// On a device the dot product is taken on copies of the blocks on
		// the host: a test's pairing, not a training step's op.
		var err error
		if a, err = a.To(device.Host()); err != nil {
			return 0, wrapf(op, err, "copying the first tensor's block")
		}
		if b, err = b.To(device.Host()); err != nil {
			return 0, wrapf(op, err, "copying the second tensor's block")
		}
		switch xa := a.data.(type) {
		case []float32:
			xb := b.data.([]float32)
			for i := range xa {
				s += float64(xa[i]) * float64(xb[i])
			}
		case []float64:
			xb := b.data.([]float64)
			for i := range xa {
				s += xa[i] * xb[i]
			}
		}
		s *= w
	}
	c, err := a.spec.m.Group(ctx)
	if err != nil {
		return 0, err
	}
	buf := comm.Host([]float64{s})
	if err := comm.AllReduce(ctx, c, buf, buf, comm.Sum); err != nil {
		return 0, err
	}
	return buf.Float64s()[0], nil
}
