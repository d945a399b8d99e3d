package autograd

import (
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Helpers shared by the sharding rules. A rule takes input specs and
// returns the output spec or an error (wrapping ErrRule for placements,
// ErrInvalid for shapes, dtypes and meshes) that names the mismatch and
// the placements that would work. A rule never implies communication: an
// op whose rule accepts its inputs computes on local blocks only, and lays
// every input gradient out explicitly, as its doc comment's per-axis table
// says.

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

// nonPartial rejects every Partial placement of a nonlinear op's input.
func nonPartial(op, what string, s *placement.Spec) error {
	names := s.Mesh().Names()
	for ax, p := range s.Placements() {
		if p.IsPartial() {
			return rulef(op, "%s is %v on mesh axis %q: %s is nonlinear, so it cannot take a Partial input; redistribute it to Replicate (all-reduce) or Shard (reduce-scatter) first", what, p, names[ax], op)
		}
	}
	return nil
}

// sameMeshes checks that two specs live on the same mesh layout (dtypes
// are not compared).
func sameMeshes(op string, a, b *placement.Spec) error {
	ma, mb := a.Mesh(), b.Mesh()
	if ma.World() != mb.World() || !slices.Equal(ma.Names(), mb.Names()) || !slices.Equal(ma.Shape(), mb.Shape()) || !slices.Equal(ma.WorldRanks(), mb.WorldRanks()) {
		return invalidf(op, "inputs live on different meshes (%v and %v); redistribute one onto the other's mesh", ma, mb)
	}
	return nil
}

// allReplicate requires s to be Replicate on every mesh axis.
func allReplicate(op, what string, s *placement.Spec, why string) error {
	names := s.Mesh().Names()
	for ax, p := range s.Placements() {
		if !p.IsReplicate() {
			return rulef(op, "%s is %v on mesh axis %q; it must be R on every axis (%s): redistribute it to Replicate first", what, p, names[ax], why)
		}
	}
	return nil
}

// normDim maps a possibly negative dim into [0, n).
func normDim(op string, d, n int) (int, error) {
	if d < 0 {
		d += n
	}
	if d < 0 || d >= n {
		return 0, invalidf(op, "dim %d out of range for a %d-d tensor", d, n)
	}
	return d, nil
}

// gradSpec is in's shape, dtype and shard orders with the given
// placements.
func gradSpec(in *placement.Spec, places []placement.Placement) (*placement.Spec, error) {
	return specWith(in, in.Shape(), places, ordersOf(in))
}

// reducedOver returns, per mesh axis, Partial(sum) where x is sharded (a
// gradient summed over x's local rows is partial there) and g's placement
// elsewhere: the layout of a parameter gradient accumulated over rows.
func reducedOver(x *placement.Spec, pg []placement.Placement) []placement.Placement {
	out := make([]placement.Placement, len(pg))
	for ax, p := range x.Placements() {
		if p.IsShard() {
			out[ax] = placement.Partial(comm.Sum)
		} else {
			out[ax] = pg[ax]
		}
	}
	return out
}
