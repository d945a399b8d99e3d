package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Elementwise arithmetic: Add, Mul and Scale, with their sharding rules
// and local loops. The linear ops (Add, Scale) keep Partial(sum); Mul,
// being nonlinear, takes no Partial input.

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

// AddRule is the sharding rule of Add: both inputs must have the same
// global shape (no broadcasting) and the same spec. Replicate, Shard(d) and
// Partial(sum) are accepted; the result has the inputs' spec (the sum of
// two Partial(sum) values is Partial(sum)). Partial(avg|max|min) is
// rejected, and so is Partial(sum) against Replicate: adding a replicated
// value on every rank would count it once per rank.
func AddRule(a, b *placement.Spec) (*placement.Spec, error) {
	return elementwiseRule("Add", a, b, true)
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
	return splitAware(t.record("Mul", out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needA, needB := t.need(a), t.need(b)
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
	})), nil
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

// zip applies f element-wise to the local blocks of x and y (same length
// and dtype) and lays the result out by spec.
func zip(spec *placement.Spec, x, y *placement.DTensor, f32 func(a, b []float32) []float32, f64 func(a, b []float64) []float64) (*placement.DTensor, error) {
	switch xd := x.LocalData().(type) {
	case []float32:
		yd, ok := y.LocalData().([]float32)
		if !ok || len(yd) != len(xd) {
			return nil, fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
		}
		return placement.NewLocal(spec, f32(xd, yd))
	case []float64:
		yd, ok := y.LocalData().([]float64)
		if !ok || len(yd) != len(xd) {
			return nil, fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
		}
		return placement.NewLocal(spec, f64(xd, yd))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// addInto sets out = a + b (kernels.Add) and returns it; out and b are
// at least as long as a.
func addInto[T float](out, a, b []T) []T {
	out = out[:len(a)]
	_ = kernels.Add(out, a, b[:len(a)]) // lengths match
	return out
}

// add is the element-wise sum, in a block as a says.
func add(a alloc, spec *placement.Spec, x, y *placement.DTensor) (*placement.DTensor, error) {
	if d, ok := onDevice(x); ok {
		return devZip("Add", a, d, spec, x, y, device.Kernels.Add)
	}
	return zip(spec, x, y,
		func(u, v []float32) []float32 { return addInto(block[float32](a, len(u)), u, v) },
		func(u, v []float64) []float64 { return addInto(block[float64](a, len(u)), u, v) })
}

// mul is the element-wise product (kernels.Mul), in a block as a says.
func mul(a alloc, spec *placement.Spec, x, y *placement.DTensor) (*placement.DTensor, error) {
	if d, ok := onDevice(x); ok {
		return devZip("Mul", a, d, spec, x, y, device.Kernels.Mul)
	}
	return zip(spec, x, y,
		func(u, v []float32) []float32 { return mulInto(block[float32](a, len(u)), u, v) },
		func(u, v []float64) []float64 { return mulInto(block[float64](a, len(u)), u, v) })
}

// mulInto sets out = a ⊙ b (kernels.Mul) and returns it; out and b are
// at least as long as a.
func mulInto[T float](out, a, b []T) []T {
	out = out[:len(a)]
	_ = kernels.Mul(out, a, b[:len(a)]) // lengths match
	return out
}

// scaleInto sets out = c·a (kernels.Scale) and returns it; out is at
// least as long as a.
func scaleInto[T float](out, a []T, c T) []T {
	out = out[:len(a)]
	_ = kernels.Scale(out, a, c) // lengths match
	return out
}

// scale multiplies the local block of x by c (kernels.Scale) and lays it
// out by spec, in a block as a says.
func scale(a alloc, spec *placement.Spec, x *placement.DTensor, c float64) (*placement.DTensor, error) {
	if d, ok := onDevice(x); ok {
		return devScale(a, d, spec, x, c)
	}
	switch d := x.LocalData().(type) {
	case []float32:
		return placement.NewLocal(spec, scaleInto(block[float32](a, len(d)), d, float32(c)))
	case []float64:
		return placement.NewLocal(spec, scaleInto(block[float64](a, len(d)), d, c))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}
