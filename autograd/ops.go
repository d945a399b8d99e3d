package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

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

// Add returns a + b (element-wise, same global shape). Sharding rule:
// AddRule. Backward passes the result's gradient to both inputs.
func Add(a, b *Value) (*Value, error) {
	t, err := checkInputs("Add", a, b)
	if err != nil {
		return nil, err
	}
	spec, err := AddRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	out, err := add(t.result(), spec, a.data, b.data)
	if err != nil {
		return nil, err
	}
	return t.record("Add", out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		return []*placement.DTensor{g, g}, nil
	}), nil
}

// Mul returns a ⊙ b (element-wise, same global shape). Sharding rule:
// MulRule (no Partial inputs). Backward: dA = g ⊙ b, dB = g ⊙ a, laid out
// like the gradient g (which may be Partial(sum) where the inputs are
// Replicate).
func Mul(a, b *Value) (*Value, error) {
	t, err := checkInputs("Mul", a, b)
	if err != nil {
		return nil, err
	}
	spec, err := MulRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	out, err := mul(t.result(), spec, a.data, b.data)
	if err != nil {
		return nil, err
	}
	x, y := a.data, b.data
	needA, needB := a.requiresGrad, b.requiresGrad
	return t.record("Mul", out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, "Mul", g, spec)
		if err != nil {
			return nil, err
		}
		grads := make([]*placement.DTensor, 2)
		if needA {
			if grads[0], err = mul(t.scratch(), g.Spec(), g, y); err != nil {
				return nil, err
			}
		}
		if needB {
			if grads[1], err = mul(t.scratch(), g.Spec(), g, x); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

// Scale returns c·a. Sharding rule: ScaleRule. Backward: c·g.
func Scale(a *Value, c float64) (*Value, error) {
	t, err := checkInputs("Scale", a)
	if err != nil {
		return nil, err
	}
	spec, err := ScaleRule(a.Spec())
	if err != nil {
		return nil, err
	}
	out, err := scale(t.result(), spec, a.data, c)
	if err != nil {
		return nil, err
	}
	return t.record("Scale", out, []*Value{a}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		ga, err := scale(t.scratch(), g.Spec(), g, c)
		return []*placement.DTensor{ga}, err
	}), nil
}

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

// blasOrDefault returns the tape's BLAS, loading kernels.Default on first
// use.
func (t *Tape) blasOrDefault() (*kernels.BLAS, error) {
	if t.blas == nil {
		b, err := kernels.Default()
		if err != nil {
			return nil, fmt.Errorf("autograd: MatMul: %w", err)
		}
		t.blas = b
	}
	return t.blas, nil
}

// Workers is the goroutine budget of the tape's kernels: as many as its
// BLAS has threads, so that a rank sized to its share of the cores keeps to
// it outside GEMM too (GOMAXPROCS if no BLAS loads). Custom ops pass it to
// the kernels they call.
func (t *Tape) Workers() kernels.Workers {
	if t == nil {
		return 0
	}
	b, err := t.blasOrDefault()
	if err != nil {
		return 0
	}
	return kernels.Workers(b.Threads())
}

// MatMul returns a·b for a [m, k] and b [k, n]. Sharding rule: MatMulRule;
// a sharded contraction gives Partial(sum) with no communication. Backward:
// dA = g·bᵀ, dB = aᵀ·g on local blocks, laid out per axis as
//
//	(S(0), R):    dA S(0), dB P(sum)   (data parallelism: replicated weight)
//	(R, S(1)):    dA P(sum), dB S(1)
//	(S(1), S(0)): dA S(1), dB S(0)     (g must be R on that axis)
//	(R, R):       dA, dB like g (R or P(sum))
//	(P(sum), R):  dA like g, dB P(sum) (g must be R to compute dB)
//	(R, P(sum)):  dA P(sum), dB like g (g must be R to compute dA)
//
// A gradient that would need communication first fails with
// ErrGradPlacement.
func MatMul(a, b *Value) (*Value, error) {
	t, err := checkInputs("MatMul", a, b)
	if err != nil {
		return nil, err
	}
	spec, err := MatMulRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	blas, err := t.blasOrDefault()
	if err != nil {
		return nil, err
	}
	x, y := a.data, b.data
	al, bl := x.LocalShape(), y.LocalShape()
	if al[1] != bl[0] {
		return nil, fmt.Errorf("autograd: MatMul: internal: local blocks %v and %v do not chain", al, bl)
	}
	m, k, n := al[0], al[1], bl[1]
	out, err := gemm(t.result(), blas, spec, x, y, false, false, m, n, k)
	if err != nil {
		return nil, err
	}
	needA, needB := a.requiresGrad, b.requiresGrad
	sa, sb := a.Spec(), b.Spec()
	return t.record("MatMul", out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, "MatMul", g, spec)
		if err != nil {
			return nil, err
		}
		if gl := g.LocalShape(); gl[0] != m || gl[1] != n {
			return nil, fmt.Errorf("autograd: MatMul: internal: gradient block %v, want [%d %d]", gl, m, n)
		}
		pa, pb, pg := sa.Placements(), sb.Placements(), g.Spec().Placements()
		da, db := make([]placement.Placement, len(pa)), make([]placement.Placement, len(pa))
		var errA, errB error
		names := sa.Mesh().Names()
		sum := placement.Partial(comm.Sum)
		for ax := range pa {
			xa, yb, gp := pa[ax], pb[ax], pg[ax]
			needAll := func(which string) error {
				return gradPlacementf("MatMul", "the gradient of the result arrives as %v on mesh axis %q, where a is %v and b is %v: d%s needs it all-reduced to R first, and autograd inserts no communication", gp, names[ax], xa, yb, which)
			}
			switch {
			case xa.IsShard() && xa.Dim() == 0:
				da[ax], db[ax] = xa, sum
			case yb.IsShard() && yb.Dim() == 1:
				da[ax], db[ax] = sum, yb
			case xa.IsShard() && yb.IsShard():
				da[ax], db[ax] = xa, yb
				if gp.IsPartial() {
					errA, errB = cmp(errA, needAll("A")), cmp(errB, needAll("B"))
				}
			case xa.IsReplicate() && yb.IsReplicate():
				da[ax], db[ax] = gp, gp
			case xa.IsPartial():
				da[ax], db[ax] = gp, sum
				if gp.IsPartial() {
					errB = cmp(errB, needAll("B"))
				}
			default: // b Partial(sum), a Replicate
				da[ax], db[ax] = sum, gp
				if gp.IsPartial() {
					errA = cmp(errA, needAll("A"))
				}
			}
		}
		grads := make([]*placement.DTensor, 2)
		if needA {
			if errA != nil {
				return nil, errA
			}
			s, err := specWith(sa, sa.Shape(), da, ordersOf(sa))
			if err != nil {
				return nil, err
			}
			if grads[0], err = gemm(t.scratch(), blas, s, g, y, false, true, m, k, n); err != nil {
				return nil, err
			}
		}
		if needB {
			if errB != nil {
				return nil, errB
			}
			s, err := specWith(sb, sb.Shape(), db, ordersOf(sb))
			if err != nil {
				return nil, err
			}
			if grads[1], err = gemm(t.scratch(), blas, s, x, g, true, false, k, n, m); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

// cmp keeps the first error.
func cmp(old, err error) error {
	if old != nil {
		return old
	}
	return err
}

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
