package kernels

import "fmt"

// SGDStep is the scalars of one SGD update (SGD), with the meanings of
// torch.optim.SGD (foreach=False).
type SGDStep struct {
	// LR is the learning rate; WeightDecay the coupled weight decay λ
	// (0: none); Momentum μ (0: no momentum buffer); Dampening τ, so that
	// later steps add (1 − τ)·d to the buffer. Each is rounded once to the
	// element type; whether WeightDecay and Momentum are 0 is decided on
	// these float64 values.
	LR, WeightDecay, Momentum, Dampening float64
	// Maximize ascends (the gradient's sign is flipped); Nesterov uses
	// Nesterov momentum; First is the first step with momentum: the buffer
	// is set to the direction instead of being read.
	Maximize, Nesterov, First bool
}

// SGD applies one SGD step in place to parameters p with gradient g and
// momentum buffer buf, in T's precision, in this order for every element:
//
//	d = −g if Maximize, else g
//	d = d + λ·p                           if λ ≠ 0
//	buf = d (First), else μ·buf + (1−τ)·d if μ ≠ 0
//	d = d + μ·buf if Nesterov, else buf   if μ ≠ 0
//	p = p − lr·d
//
// Every intermediate is rounded to T and nothing is fused. buf must have
// p's length when Momentum ≠ 0 and is not read otherwise (it may be
// nil). It returns an error wrapping ErrInvalid, before writing
// anything, when the lengths differ.
func SGD[T Float](p, g, buf []T, s SGDStep) error {
	n := len(p)
	if len(g) != n || (s.Momentum != 0 && len(buf) != n) {
		return fmt.Errorf("kernels: SGD: %w: lengths p %d, g %d, buf %d differ", ErrInvalid, n, len(g), len(buf))
	}
	g = g[:n]
	lr, wd, mu, damp := T(s.LR), T(s.WeightDecay), T(s.Momentum), T(1-s.Dampening)
	decay, momentum := s.WeightDecay != 0, s.Momentum != 0
	var b []T
	if momentum {
		b = buf[:n]
	}
	for i := range n {
		d := g[i]
		if s.Maximize {
			d = -d
		}
		if decay {
			d = d + T(wd*p[i])
		}
		if momentum {
			if s.First {
				b[i] = d
			} else {
				b[i] = T(mu*b[i]) + T(damp*d)
			}
			if s.Nesterov {
				d = d + T(mu*b[i])
			} else {
				d = b[i]
			}
		}
		p[i] = p[i] - T(lr*d)
	}
	return nil
}

// SumSquares returns Σ x[i]² computed in float64, in index order: the
// squared 2-norm of a gradient block that gradient clipping reduces over
// ranks.
func SumSquares[T Float](x []T) float64 {
	s := 0.0
	for _, v := range x {
		s += float64(v) * float64(v)
	}
	return s
}
