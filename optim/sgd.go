package optim

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
)

// SGDConfig holds the hyper-parameters of SGD, with torch.optim.SGD's
// names and meanings (all dimensionless except LR, the step size in
// parameter units per gradient unit).
type SGDConfig struct {
	// LR is the learning rate (≥ 0).
	LR float64
	// Momentum is the momentum factor μ (≥ 0; 0 means no momentum buffer).
	Momentum float64
	// Dampening τ scales the gradient added to the momentum buffer by
	// 1 − τ (not on the first step, where the buffer is the gradient).
	Dampening float64
	// WeightDecay λ (≥ 0) is coupled L2 regularisation: λ·p is added to
	// the gradient before momentum.
	WeightDecay float64
	// Nesterov uses Nesterov momentum; it needs Momentum > 0 and
	// Dampening == 0.
	Nesterov bool
	// Maximize ascends the objective instead of descending it.
	Maximize bool
}

// check rejects hyper-parameters that torch.optim.SGD rejects, and
// non-finite ones.
func (c SGDConfig) check() error {
	for _, v := range []float64{c.LR, c.Momentum, c.Dampening, c.WeightDecay} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("optim: SGD: non-finite hyper-parameter in %+v", c)
		}
	}
	switch {
	case c.LR < 0:
		return fmt.Errorf("optim: SGD: invalid learning rate %v (want ≥ 0)", c.LR)
	case c.Momentum < 0:
		return fmt.Errorf("optim: SGD: invalid momentum %v (want ≥ 0)", c.Momentum)
	case c.WeightDecay < 0:
		return fmt.Errorf("optim: SGD: invalid weight decay %v (want ≥ 0)", c.WeightDecay)
	case c.Nesterov && (c.Momentum <= 0 || c.Dampening != 0):
		return fmt.Errorf("optim: SGD: Nesterov momentum requires a momentum > 0 and zero dampening (momentum %v, dampening %v)", c.Momentum, c.Dampening)
	}
	return nil
}

// SGD is stochastic gradient descent over a fixed list of autograd leaves
// with the semantics of PyTorch's torch.optim.SGD (foreach=False). For
// each parameter p with gradient g, in this order:
//
//	g = −g                        if Maximize
//	g = g + λ·p                   if WeightDecay λ ≠ 0
//	b = g                         first step with momentum (no dampening)
//	b = μ·b + (1 − τ)·g           later steps with Momentum μ ≠ 0
//	g = g + μ·b if Nesterov, else g = b   (when μ ≠ 0)
//	p = p − lr·g
//
// Like AdamW it works on each rank's local blocks, so parameters of any
// placement are updated in place from the matching block of their
// gradient, and it never communicates. A parameter without a gradient is
// skipped entirely (PyTorch's grad None): its momentum buffer neither
// decays nor starts. Float32 parameters are updated in float32 arithmetic
// (each coefficient rounded once), float64 in float64.
type SGD struct {
	// SGDConfig holds the hyper-parameters; they may be changed between
	// steps (Step checks them again).
	SGDConfig

	params []*autograd.Value
	bufs   []any // momentum buffers: nil, []float32 or []float64
}

// NewSGD returns an SGD optimizer for params (leaves that require grad,
// each listed once, holding float32 or float64). It returns an error for
// an invalid parameter list or hyper-parameters (negative learning rate,
// momentum or weight decay, non-finite values, Nesterov without momentum
// or with dampening).
func NewSGD(params []*autograd.Value, cfg SGDConfig) (*SGD, error) {
	if err := checkParams("SGD", params); err != nil {
		return nil, err
	}
	if err := cfg.check(); err != nil {
		return nil, err
	}
	return &SGD{SGDConfig: cfg, params: slices.Clone(params), bufs: make([]any, len(params))}, nil
}

// Params returns the parameters, in the order given to NewSGD.
func (o *SGD) Params() []*autograd.Value { return slices.Clone(o.params) }

// HasMomentumBuffer reports whether parameter i has a momentum buffer
// (it has one after its first update with Momentum ≠ 0); false if i is out
// of range.
func (o *SGD) HasMomentumBuffer(i int) bool {
	return i >= 0 && i < len(o.bufs) && o.bufs[i] != nil
}

// Step updates every parameter that has a gradient, in place, from the
// local block of that gradient. Call it after Backward and before the
// next forward pass, as for AdamW. The gradient's local block must line up
// with the parameter's (on every mesh axis of size > 1 both sharded on the
// same dim, in the same shard order, or neither) and must not be Partial:
// reduce it first (DDP's all-reduce, FSDP's reduce-scatter). Step checks
// the hyper-parameters and every parameter before updating any; on an
// error nothing has changed.
func (o *SGD) Step() error {
	if err := o.check(); err != nil {
		return err
	}
	var errs []error
	for _, p := range o.params {
		if g := p.Grad(); g != nil {
			if err := lineUp(p.Data(), g); err != nil {
				errs = append(errs, fmt.Errorf("optim: SGD: %q: %w", p.Name(), err))
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	for i, p := range o.params {
		g := p.Grad()
		if g == nil {
			continue
		}
		switch pd := p.Data().LocalData().(type) {
		case []float32:
			o.bufs[i] = sgdUpdate(o.SGDConfig, pd, g.LocalData().([]float32), o.bufs[i])
		case []float64:
			o.bufs[i] = sgdUpdate(o.SGDConfig, pd, g.LocalData().([]float64), o.bufs[i])
		}
	}
	return nil
}

// sgdUpdate applies one SGD step to p with gradient g and returns the
// momentum buffer (buf is the previous one: nil before the first step, or
// a []T of len(p)). Every intermediate is rounded to T.
func sgdUpdate[T Float](c SGDConfig, p, g []T, buf any) any {
	n := len(p)
	g = g[:n]
	lr, wd, mu, damp := T(c.LR), T(c.WeightDecay), T(c.Momentum), T(1-c.Dampening)
	var b []T
	first := false
	if c.Momentum != 0 {
		if buf == nil {
			b, first = make([]T, n), true
		} else {
			b = buf.([]T)
		}
	}
	for i := range n {
		d := g[i]
		if c.Maximize {
			d = -d
		}
		if c.WeightDecay != 0 {
			d = d + T(wd*p[i])
		}
		if c.Momentum != 0 {
			if first {
				b[i] = d
			} else {
				b[i] = T(mu*b[i]) + T(damp*d)
			}
			if c.Nesterov {
				d = d + T(mu*b[i])
			} else {
				d = b[i]
			}
		}
		p[i] = p[i] - T(lr*d)
	}
	if b == nil {
		return buf
	}
	return b
}

// checkParams validates an optimizer's parameter list: non-nil leaves that
// require grad, each listed once, holding float32 or float64 blocks.
func checkParams(opt string, params []*autograd.Value) error {
	seen := map[*autograd.Value]bool{}
	for i, p := range params {
		switch {
		case p == nil || p.Data() == nil:
			return fmt.Errorf("optim: %s: parameter %d is nil", opt, i)
		case !p.IsLeaf() || !p.RequiresGrad():
			return fmt.Errorf("optim: %s: %q (parameter %d) is not a leaf that requires grad", opt, p.Name(), i)
		case seen[p]:
			return fmt.Errorf("optim: %s: %q (parameter %d) is listed twice", opt, p.Name(), i)
		}
		seen[p] = true
		switch p.Data().LocalData().(type) {
		case []float32, []float64:
		default:
			return fmt.Errorf("optim: %s: %q holds %T", opt, p.Name(), p.Data().LocalData())
		}
	}
	return nil
}
