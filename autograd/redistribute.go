package autograd

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Redistribute, the one op that communicates, its rule, and alignGrad,
// which lays an incoming gradient out as its op's result before the op's
// backward reads its local block.

// Redistribute returns v laid out by dst (placement.Planner.Redistribute
// with the tape's planner). This is the one op that communicates, and only
// because the caller asked for it. Sharding rule: RedistributeRule; when
// the result is recorded, dst must not hold Partial(max|min). Backward runs
// the dual plan (placement.Planner.Backward) from whatever layout the
// gradient arrives in to the source's gradient layout; from a
// Partial(max|min) source it runs placement.Planner.ExtremumGrad, whose
// gradient goes to the rank whose value won and is laid out Partial(sum)
// on those axes.
func Redistribute(ctx context.Context, v *Value, dst *placement.Spec) (*Value, error) {
	const op = "Redistribute"
	t, err := checkInputs(op, v)
	if err != nil {
		return nil, err
	}
	src := v.Spec()
	if _, err := RedistributeRule(src, dst); err != nil {
		return nil, err
	}
	if t.recording() && v.requiresGrad {
		if ext := extremumAxes(dst); ext != "" {
			return nil, rulef(op, "the destination %v holds %s, which has no gradient layout; reduce it to Replicate or Shard before differentiating, or run under NoGrad", dst, ext)
		}
	}
	pl, err := t.planner.Plan(src, dst)
	if err != nil {
		return nil, err
	}
	x := v.data
	y, err := t.execute(ctx, pl, x, dst.Mesh(), t.result())
	if err != nil {
		return nil, err
	}
	extremum := extremumAxes(src) != ""
	return t.record(op, y, []*Value{v}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		if extremum {
			gx, err := t.planner.ExtremumGrad(ctx, x, y, g)
			return []*placement.DTensor{gx}, err
		}
		back, err := t.planner.Backward(pl, g.Spec())
		if err != nil {
			return nil, err
		}
		gx, err := t.execute(ctx, back, g, src.Mesh(), t.scratch())
		return []*placement.DTensor{gx}, err
	}), nil
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

// alignGrad returns g laid out so that its local blocks line up with those
// of a value laid out by v: on every mesh axis both Shard of the same dim
// or neither sharded (Replicate and Partial(sum) blocks are whole), with
// the same shard orders. A gradient that does not line up is moved to
// placement.GradSpec(v) when that plan has no collective; otherwise the
// result is ErrGradPlacement (no hidden communication).
func (t *Tape) alignGrad(ctx context.Context, op string, g *placement.DTensor, v *placement.Spec) (*placement.DTensor, error) {
	gs := g.Spec()
	if !slices.Equal(gs.Shape(), v.Shape()) || gs.DType() != v.DType() {
		return nil, invalidf(op, "gradient %v does not match the value %v in shape or dtype", gs, v)
	}
	if aligned(gs, v) {
		return g, nil
	}
	want, err := placement.GradSpec(v)
	if err != nil {
		return nil, err
	}
	moved, ops, err := t.moveLocal(ctx, g, want)
	if err != nil {
		return nil, err
	}
	if moved == nil {
		return nil, gradPlacementf(op, "the gradient of the result arrives as %v but the result is %v; lining them up needs %v, and autograd inserts no communication", gs.Placements(), v.Placements(), ops)
	}
	return moved, nil
}

// aligned reports whether g's local blocks line up with v's.
func aligned(g, v *placement.Spec) bool {
	pg, pv := g.Placements(), v.Placements()
	if len(pg) != len(pv) {
		return false
	}
	for a := range pg {
		if pg[a].IsShard() != pv[a].IsShard() || pg[a].Dim() != pv[a].Dim() {
			return false
		}
	}
	for d := range v.Shape() {
		if !slices.Equal(g.Order(d), v.Order(d)) {
			return false
		}
	}
	return true
}
