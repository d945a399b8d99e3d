package optim

import (
	"errors"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
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
// an error, unless the optimizer was made with WithAllowFrozen: then it is
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
	bufs   []any // momentum buffers: nil, []float32, []float64 or a device.Buffer
	// unset marks buffers that StateDict made (or a load left) which no
	// update has set yet: the next update sets them to the gradient, as
	// for a nil buffer. Nil until StateDict.
	unset  []bool
	frozen bool // AllowFrozen
	closed bool // Close
}

// sgdOptions are the options NewSGD takes.
var sgdOptions = []string{"WithMomentum", "WithDampening", "WithWeightDecay", "WithNesterov", "WithMaximize", "WithAllowFrozen"}

// NewSGD returns an SGD optimizer for params (leaves that require grad,
// each listed once, holding float32 or float64) with learning rate lr ≥ 0
// (required, as in torch.optim.SGD) and PyTorch 1.13's defaults unless
// opts say otherwise: Momentum 0, Dampening 0, WeightDecay 0, no
// Nesterov, no Maximize, no WithAllowFrozen. Errors wrap ErrInvalid: a bad
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
	return i >= 0 && i < len(o.bufs) && o.bufs[i] != nil && (o.unset == nil || !o.unset[i])
}

// Step updates every parameter, in place, from the local block of its
// gradient; a parameter without a gradient is an error naming it, or is
// skipped with WithAllowFrozen. Call it after Backward and before the next
// forward pass, as for AdamW. The gradient's local block must line up
// with the parameter's (on every mesh axis of size > 1 both sharded on the
// same dim, in the same shard order, or neither) and must not be Partial:
// reduce it first (DDP's all-reduce, FSDP's reduce-scatter). Step checks
// the hyper-parameters and every parameter before updating any; errors
// wrap ErrInvalid, and on an error nothing has changed.
//
// A parameter on a device is updated by the device's Kernels.SGD from a
// gradient on the same device (one elsewhere is an error matching
// device.ErrMixed), with its momentum buffer allocated on that device
// (an allocation error frees what this Step allocated and changes
// nothing). The update is queued on the device's compute stream: an error
// found while it runs is returned by the device's next Synchronize. After
// Close, Step is an error wrapping ErrInvalid.
func (o *SGD) Step() error {
	const op = "SGD.Step"
	if o.closed {
		return errClosed(op)
	}
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
	first, err := o.allocBufs(op)
	if err != nil {
		return err
	}
	for i, p := range o.params {
		g := p.Grad()
		if g == nil {
			continue
		}
		s := kernels.SGDStep{
			LR: o.LR, WeightDecay: o.WeightDecay, Momentum: o.Momentum, Dampening: o.Dampening,
			Maximize: o.Maximize, Nesterov: o.Nesterov, First: first[i],
		}
		var err error
		switch pd := p.Data().LocalData().(type) {
		case []float32:
			buf, _ := o.bufs[i].([]float32)
			err = kernels.SGD(pd, g.LocalData().([]float32), buf, s)
		case []float64:
			buf, _ := o.bufs[i].([]float64)
			err = kernels.SGD(pd, g.LocalData().([]float64), buf, s)
		case device.Buffer:
			buf, _ := o.bufs[i].(device.Buffer)
			err = pd.Owner().Kernels().SGD(pd, deviceBlock(g), buf, s)
		}
		if err != nil {
			// lineUp checked the blocks' shapes and devices, so this is a
			// bug or a closed device, not bad input; earlier parameters
			// are already updated.
			return fmt.Errorf("optim: %s: %q: %w", op, p.Name(), err)
		}
	}
	return nil
}

// allocBufs makes the momentum buffer of every parameter that has a
// gradient and none yet, where the parameter lives, when Momentum ≠ 0,
// and reports which parameters got one or hold one no update has set
// (their first step with momentum).
// On an error it frees what it made, so that nothing has changed.
func (o *SGD) allocBufs(op string) ([]bool, error) {
	first := make([]bool, len(o.params))
	if o.Momentum == 0 {
		return first, nil
	}
	made := make([]bool, len(o.params))
	for i, p := range o.params {
		if p.Grad() == nil {
			continue
		}
		if o.bufs[i] != nil {
			first[i] = o.unset != nil && o.unset[i]
			continue
		}
		b, err := newState(p.Data(), false)
		if err != nil {
			for j := range made {
				if made[j] {
					err = errors.Join(err, freeState(o.bufs[j]))
					o.bufs[j] = nil
				}
			}
			return nil, fmt.Errorf("optim: %s: the momentum buffer of %q on %s: %w", op, p.Name(), p.Data().Device().Name(), err)
		}
		o.bufs[i], first[i], made[i] = b, true, true
	}
	for i := range o.unset {
		o.unset[i] = o.unset[i] && !first[i]
	}
	return first, nil
}

// Close frees the momentum buffers held in device memory and ends the
// optimizer: a later Step is an error, StateBytes is 0. Buffers of host
// parameters are left to the garbage collector. Call it when training
// ends, or before replacing the optimizer, so that a device's allocator
// gets its memory back. It returns the devices' errors, joined; a second
// Close does nothing.
func (o *SGD) Close() error {
	if o.closed {
		return nil
	}
	o.closed = true
	var errs []error
	for i, b := range o.bufs {
		errs = append(errs, freeState(b))
		o.bufs[i] = nil
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("optim: SGD.Close: %w", err)
	}
	return nil
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
		if err := checkBlock(p.Data().LocalData()); err != nil {
			return fmt.Errorf("optim: %s: %w: %q holds %w", op, ErrInvalid, p.Name(), err)
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
		n += stateBytes(b)
	}
	return n
}
