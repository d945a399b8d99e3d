package optim

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/numcheck"
)

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
// an error, unless the optimizer was made with AllowFrozen: then it is
// skipped entirely (PyTorch's grad None), its momentum buffer neither
// decaying nor starting. Float32 parameters are updated in float32 arithmetic
// (each coefficient rounded once), float64 in float64.
type SGD struct {
	// LR, Momentum, Dampening, WeightDecay, Nesterov and Maximize are the
	// hyper-parameters, as set by NewSGD; they may be changed between
	// steps (a learning-rate schedule sets LR), and Step checks them again.
	LR, Momentum, Dampening, WeightDecay float64
	Nesterov, Maximize                   bool

	params []*autograd.Value
	bufs   []any // momentum buffers: nil, []float32 or []float64
	frozen bool  // AllowFrozen
}

// sgdOptions are the options NewSGD takes.
var sgdOptions = []string{"Momentum", "Dampening", "WeightDecay", "Nesterov", "Maximize", "AllowFrozen"}

// NewSGD returns an SGD optimizer for params (leaves that require grad,
// each listed once, holding float32 or float64) with learning rate lr ≥ 0
// (required, as in torch.optim.SGD) and PyTorch 1.13's defaults unless
// opts say otherwise: Momentum 0, Dampening 0, WeightDecay 0, no
// Nesterov, no Maximize, no AllowFrozen. Errors wrap ErrInvalid: a bad
// parameter list, an option SGD does not take, or hyper-parameters
// torch.optim.SGD rejects (negative learning rate, momentum or weight
// decay; Nesterov without momentum or with dampening), NaN or ±Inf, or a
// dampening outside [0, 1) (at 1 the momentum buffer would never take a
// gradient again), naming the option.
func NewSGD(params []*autograd.Value, lr float64, opts ...Option) (*SGD, error) {
	const op = "NewSGD"
	if err := checkParams(op, params); err != nil {
		return nil, err
	}
	c, err := newConfig(op, config{}, sgdOptions, opts)
	if err != nil {
		return nil, err
	}
	o := &SGD{
		LR: lr, Momentum: c.momentum, Dampening: c.dampening, WeightDecay: c.weightDecay,
		Nesterov: c.nesterov, Maximize: c.maximize,
		params: slices.Clone(params), bufs: make([]any, len(params)),
		frozen: c.frozen,
	}
	if err := o.check(op); err != nil {
		return nil, err
	}
	return o, nil
}

// check rejects hyper-parameters that torch.optim.SGD rejects, and
// non-finite ones, by internal/numcheck's rules. A learning rate of 0 is
// valid: warm-up schedules start there.
func (o *SGD) check(op string) error {
	if err := checkNums(op,
		numcheck.NonNegative(ErrInvalid, "LR", o.LR),
		numcheck.NonNegative(ErrInvalid, "Momentum", o.Momentum),
		numcheck.Fraction(ErrInvalid, "Dampening", o.Dampening),
		numcheck.NonNegative(ErrInvalid, "WeightDecay", o.WeightDecay)); err != nil {
		return err
	}
	if o.Nesterov && (o.Momentum <= 0 || o.Dampening != 0) {
		return fmt.Errorf("optim: %s: %w: Nesterov momentum requires a momentum > 0 and zero dampening (momentum %v, dampening %v)", op, ErrInvalid, o.Momentum, o.Dampening)
	}
	return nil
}

// HasMomentumBuffer reports whether parameter i has a momentum buffer
// (it has one after its first update with Momentum ≠ 0); false if i is out
// of range.
func (o *SGD) HasMomentumBuffer(i int) bool {
	return i >= 0 && i < len(o.bufs) && o.bufs[i] != nil
}

// Step updates every parameter, in place, from the local block of its
// gradient; a parameter without a gradient is an error naming it, or is
// skipped with AllowFrozen. Call it after Backward and before the next
// forward pass, as for AdamW. The gradient's local block must line up
// with the parameter's (on every mesh axis of size > 1 both sharded on the
// same dim, in the same shard order, or neither) and must not be Partial:
// reduce it first (DDP's all-reduce, FSDP's reduce-scatter). Step checks
// the hyper-parameters and every parameter before updating any; errors
// wrap ErrInvalid, and on an error nothing has changed.
func (o *SGD) Step() error {
	const op = "SGD.Step"
	if err := o.check(op); err != nil {
		return err
	}
	if err := checkGrads(op, o.params, o.frozen); err != nil {
		return err
	}
	for i, p := range o.params {
		if err := sameBlock(op, p, o.bufs[i]); err != nil {
			return err
		}
	}
	for i, p := range o.params {
		g := p.Grad()
		if g == nil {
			continue
		}
		switch pd := p.Data().LocalData().(type) {
		case []float32:
			o.bufs[i] = sgdUpdate(o, pd, g.LocalData().([]float32), o.bufs[i])
		case []float64:
			o.bufs[i] = sgdUpdate(o, pd, g.LocalData().([]float64), o.bufs[i])
		}
	}
	return nil
}

// sgdUpdate applies one SGD step to p with gradient g and returns the
// momentum buffer (buf is the previous one: nil before the first step, or
// a []T of len(p)). Every intermediate is rounded to T.
func sgdUpdate[T Float](c *SGD, p, g []T, buf any) any {
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
func checkParams(op string, params []*autograd.Value) error {
	seen := map[*autograd.Value]bool{}
	for i, p := range params {
		switch {
		case p == nil || p.Data() == nil:
			return fmt.Errorf("optim: %s: %w: parameter %d is nil", op, ErrInvalid, i)
		case !p.IsLeaf() || !p.RequiresGrad():
			return fmt.Errorf("optim: %s: %w: %q (parameter %d) is not a leaf that requires grad", op, ErrInvalid, p.Name(), i)
		case seen[p]:
			return fmt.Errorf("optim: %s: %w: %q (parameter %d) is listed twice", op, ErrInvalid, p.Name(), i)
		}
		seen[p] = true
		switch p.Data().LocalData().(type) {
		case []float32, []float64:
		default:
			return fmt.Errorf("optim: %s: %w: %q holds %T; want float32 or float64", op, ErrInvalid, p.Name(), p.Data().LocalData())
		}
	}
	return nil
}

// StateBytes returns the bytes of optimizer state this rank holds: the
// momentum buffers made so far, each the size of its parameter's local
// block.
func (o *SGD) StateBytes() int64 {
	var n int64
	for _, b := range o.bufs {
		n += sliceBytes(b)
	}
	return n
}

// sliceBytes is the size in bytes of a []float32 or []float64 (0 for nil).
func sliceBytes(s any) int64 {
	switch d := s.(type) {
	case []float32:
		return 4 * int64(len(d))
	case []float64:
		return 8 * int64(len(d))
	}
	return 0
}
