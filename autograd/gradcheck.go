package autograd

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// LossFunc builds a scalar loss on tape t from params, the parameters
// CheckGrad passes in (in the order given to it). It must record the same
// ops every time it is called and be deterministic.
type LossFunc func(t *Tape, params []*Value) (*Value, error)

// Checker compares Backward's gradients with central finite differences in
// float64. The zero Checker uses the defaults.
//
// Tolerance: an element passes when |analytic - numeric| <= Tol · max(1,
// |analytic|, |numeric|). With the default Step h = 1e-6, the central
// difference (L(x+h) - L(x-h)) / 2h has truncation error about
// h²·|L”'|/6 ≈ 1e-13 and rounding error about ε·|L|/h ≈ 2e-10·|L|, so the
// default Tol of 1e-6 holds for losses up to |L| ≈ 1e3 with smooth
// (polynomial) ops, while a wrong gradient is off by O(1) relative.
type Checker struct {
	// Step is the finite-difference step h (default 1e-6).
	Step float64
	// Tol is the relative tolerance (default 1e-6).
	Tol float64
	// Options configure the tapes the checker creates.
	Options []Option
}

// CheckGrad is Checker{}.Check.
func CheckGrad(ctx context.Context, f LossFunc, params ...*placement.DTensor) error {
	return Checker{}.Check(ctx, f, params...)
}

// Check runs f once with Backward and compares every parameter's gradient,
// brought to Replicate with Full, with central differences of the loss
// over every global element of every parameter. It is collective: every
// rank of the mesh calls it with the same f and parameter specs, and, as
// long as the gradients are consistent DTensors, every rank returns the
// same verdict. Parameters must be float64.
//
// Perturbing one global element changes the local copy on every rank that
// holds it, except on Partial(sum) axes, where only the rank at coordinate
// 0 of those axes changes (the sum moves by h); on Partial(avg|max|min)
// every holder changes (the reduction moves by h). Each element costs two
// forward evaluations (under NoGrad), so keep the tensors small.
func (c Checker) Check(ctx context.Context, f LossFunc, params ...*placement.DTensor) error {
	const op = "CheckGrad"
	if f == nil {
		return invalidf(op, "nil loss function")
	}
	for i, p := range params {
		if p == nil {
			return invalidf(op, "parameter %d is nil", i)
		}
		if p.Spec().DType() != comm.Float64 {
			return invalidf(op, "parameter %d is %v; finite differences need float64", i, p.Spec().DType())
		}
		if d := p.Device(); d.Kind() != device.KindHost {
			return invalidf(op, "parameter %d is on %s; finite differences perturb host blocks: pass p.To(device.Host()) and move the inputs inside the loss function", i, d.Name())
		}
	}
	h, tol := c.Step, c.Tol
	if h <= 0 {
		h = 1e-6
	}
	if tol <= 0 {
		tol = 1e-6
	}
	// Analytic gradients.
	t := NewTape(c.Options...)
	vals, err := wrapParams(t, params)
	if err != nil {
		return err
	}
	loss, err := f(t, vals)
	if err != nil {
		return err
	}
	if loss == nil {
		return invalidf(op, "the loss function returned a nil loss")
	}
	if err := t.Backward(ctx, loss); err != nil {
		return err
	}
	analytic := make([][]float64, len(params))
	for i, v := range vals {
		if v.grad == nil {
			analytic[i] = make([]float64, prod(params[i].Spec().Shape()))
			continue
		}
		gs := v.grad.Spec()
		if !slices.Equal(gs.Shape(), params[i].Spec().Shape()) {
			return fmt.Errorf("autograd: %s: the gradient of parameter %d has global shape %v, want %v", op, i, gs.Shape(), params[i].Spec().Shape())
		}
		if analytic[i], err = fullData(ctx, v.grad); err != nil {
			return err
		}
	}
	// Numeric gradients.
	eval := func(ps []*placement.DTensor) (float64, error) {
		t := NewTape(c.Options...)
		vals, err := wrapParams(t, ps)
		if err != nil {
			return 0, err
		}
		var loss *Value
		if err := t.NoGrad(func() error {
			var err error
			loss, err = f(t, vals)
			return err
		}); err != nil {
			return 0, err
		}
		if loss == nil {
			return 0, invalidf(op, "the loss function returned a nil loss")
		}
		d, err := fullData(ctx, loss.data)
		if err != nil {
			return 0, err
		}
		if len(d) != 1 {
			return 0, invalidf(op, "the loss has %d elements; want a scalar", len(d))
		}
		return d[0], nil
	}
	ps := slices.Clone(params)
	for i, p := range params {
		shape := p.Spec().Shape()
		for e := range prod(shape) {
			var lp, lm float64
			for _, s := range []float64{h, -h} {
				q, err := perturb(p, e, s)
				if err != nil {
					return err
				}
				ps[i] = q
				l, err := eval(ps)
				if err != nil {
					return err
				}
				if s > 0 {
					lp = l
				} else {
					lm = l
				}
			}
			ps[i] = p
			num := (lp - lm) / (2 * h)
			an := analytic[i][e]
			if d := math.Abs(an - num); !(d <= tol*max(1, math.Abs(an), math.Abs(num))) {
				return fmt.Errorf("autograd: %s: parameter %d (%v), element %d (index %v): backward gives %.12g, finite differences %.12g (|diff| %.3g, tolerance %.3g relative)",
					op, i, p.Spec(), e, unravel(e, shape), an, num, d, tol)
			}
		}
	}
	return nil
}

func wrapParams(t *Tape, ps []*placement.DTensor) ([]*Value, error) {
	vals := make([]*Value, len(ps))
	for i, p := range ps {
		v, err := t.Param(fmt.Sprintf("param%d", i), p)
		if err != nil {
			return nil, err
		}
		vals[i] = v
	}
	return vals, nil
}

// fullData materialises dt on every rank as float64s.
func fullData(ctx context.Context, dt *placement.DTensor) ([]float64, error) {
	full, err := dt.Full(ctx)
	if err != nil {
		return nil, err
	}
	switch d := full.(type) {
	case []float64:
		return d, nil // Full returns fresh memory
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out, nil
	}
	return nil, fmt.Errorf("autograd: full tensor of type %T", full)
}

func unravel(p int, shape []int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		c[i] = p % shape[i]
		p /= shape[i]
	}
	return c
}

// perturb returns p with global element e moved by delta (see Check).
func perturb(p *placement.DTensor, e int, delta float64) (*placement.DTensor, error) {
	spec := p.Spec()
	m := spec.Mesh()
	coord := m.Coord()
	for a, pl := range spec.Placements() {
		if pl.IsPartial() && pl.Op() == comm.Sum && coord[a] != 0 {
			return p, nil
		}
	}
	off, size, err := spec.Box(m.Rank())
	if err != nil {
		return nil, err
	}
	idx := unravel(e, spec.Shape())
	li := 0
	for d := range idx {
		l := idx[d] - off[d]
		if l < 0 || l >= size[d] {
			return p, nil
		}
		li = li*size[d] + l
	}
	q, err := clone(p)
	if err != nil {
		return nil, err
	}
	q.LocalData().([]float64)[li] += delta
	return q, nil
}
