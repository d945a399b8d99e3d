package optim

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// AdamWCoeffs are the scalar coefficients of one AdamW step (PyTorch 1.13
// semantics, reference/TINY_GPT.md §4), computed in float64. Update rounds each of
// them once to the element type and then does every tensor operation in
// that type.
type AdamWCoeffs struct {
	Decay         float64 // 1 − lr·wd
	Beta1         float64 // β1
	OneMinusBeta1 float64 // 1 − β1
	Beta2         float64 // β2
	OneMinusBeta2 float64 // 1 − β2
	SqrtBC2       float64 // sqrt(1 − β2^t)
	Step          float64 // −lr / (1 − β1^t)
	Eps           float64 // ε
}

// Coefficients returns the coefficients of AdamW step t (t ≥ 1) for
// learning rate lr, decoupled weight decay wd, betas β1, β2 and ε.
func Coefficients(lr, wd, beta1, beta2, eps float64, t int) AdamWCoeffs {
	bc1 := 1 - math.Pow(beta1, float64(t))
	bc2 := 1 - math.Pow(beta2, float64(t))
	return AdamWCoeffs{
		Decay:         1 - lr*wd,
		Beta1:         beta1,
		OneMinusBeta1: 1 - beta1,
		Beta2:         beta2,
		OneMinusBeta2: 1 - beta2,
		SqrtBC2:       math.Sqrt(bc2),
		Step:          -lr / bc1,
		Eps:           eps,
	}
}

// Float is the element types Update works on.
type Float interface{ ~float32 | ~float64 }

// Update applies one AdamW step element-wise to parameters p with gradient
// g and moments m and v (all the same length; p, m and v are updated in
// place). Each coefficient is rounded once to T; then, in T arithmetic and
// in this order (reference/TINY_GPT.md §4's bit-exact recipe):
//
//	p   = p·c_wd
//	m   = m·β1 + c1·g
//	v   = v·β2 + (c2·g)·g
//	den = sqrt(v)/c_bc2 + ε
//	p   = p + (c_step·m)/den
//
// Every intermediate is rounded to T and nothing is fused: it is
// kernels.AdamW, eight lanes at a time for float32 where the CPU has AVX2.
// Slices of different lengths are an error wrapping ErrInvalid, and
// nothing is updated.
func Update[T Float](c AdamWCoeffs, p, g, m, v []T) error {
	if len(g) != len(p) || len(m) != len(p) || len(v) != len(p) {
		return fmt.Errorf("optim: Update: %w: lengths p %d, g %d, m %d, v %d differ", ErrInvalid, len(p), len(g), len(m), len(v))
	}
	k := &[8]T{T(c.Decay), T(c.Beta1), T(c.OneMinusBeta1), T(c.Beta2), T(c.OneMinusBeta2), T(c.SqrtBC2), T(c.Step), T(c.Eps)}
	if err := kernels.AdamW(p, g, m, v, k); err != nil {
		return fmt.Errorf("optim: Update: %w", err)
	}
	return nil
}

// AdamW is the AdamW optimizer over a fixed list of autograd leaves
// (PyTorch 1.13 torch.optim.AdamW with amsgrad=False, maximize=False):
// decoupled weight decay applied to every parameter first, then the Adam
// update with bias correction, ε added after sqrt(v)/sqrt(bc2). Every
// parameter has its own moments m and v (zero at first) and its own step
// count t, which starts at 1 and advances only on steps where the
// parameter has a gradient. A parameter with no gradient is an error,
// unless the optimizer was made with WithAllowFrozen: then it is skipped
// entirely, like PyTorch's grad None.
type AdamW struct {
	// LR, WeightDecay, Beta1, Beta2 and Eps are the hyper-parameters, as
	// set by NewAdamW's options; they may be changed between steps (a
	// learning-rate schedule sets LR), and Step checks them again.
	LR, WeightDecay, Beta1, Beta2, Eps float64

	params []*autograd.Value
	state  []adamState
	frozen bool // AllowFrozen
	closed bool // Close
}

type adamState struct {
	m, v any // []float32, []float64 or a device.Buffer, like the local block
	t    int
}

// adamWOptions are the options NewAdamW takes.
var adamWOptions = []string{"WithLR", "WithBetas", "WithEps", "WithWeightDecay", "WithAllowFrozen"}

// NewAdamW returns an AdamW optimizer for params (leaves that require
// grad, each listed once, holding float32 or float64) with PyTorch 1.13's
// defaults unless opts say otherwise: LR 1e-3, Betas (0.9, 0.999), Eps
// 1e-8, WeightDecay 0.01, no WithAllowFrozen. Errors wrap ErrInvalid: a bad
// parameter list, an option AdamW does not take, or invalid
// hyper-parameters (NaN and ±Inf always; a negative learning rate or
// weight decay, a beta outside [0, 1), an ε that is not > 0), naming the
// option.
func NewAdamW(params []*autograd.Value, opts ...Option) (*AdamW, error) {
	const op = "NewAdamW"
	if err := checkParams(op, params); err != nil {
		return nil, err
	}
	c, err := newConfig(op, config{lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01}, adamWOptions, opts)
	if err != nil {
		return nil, err
	}
	o := &AdamW{
		LR: c.lr, WeightDecay: c.weightDecay, Beta1: c.beta1, Beta2: c.beta2, Eps: c.eps,
		params: slices.Clone(params),
		state:  make([]adamState, len(params)),
		frozen: c.frozen,
	}
	if err := o.check(op); err != nil {
		return nil, err
	}
	return o, nil
}

// StepCount returns how many updates parameter i has received, or -1 if i
// is out of range.
func (o *AdamW) StepCount(i int) int {
	if i < 0 || i >= len(o.state) {
		return -1
	}
	return o.state[i].t
}

// Step updates every parameter, in place, from the local block of its
// gradient; a parameter without a gradient is an error naming it, or is
// skipped with WithAllowFrozen. Call it after Backward (which leaves the
// tape empty) and before the next forward pass: it rewrites the leaves'
// local blocks, which values recorded earlier may share. The gradient's
// local block must line up with the parameter's: on every mesh axis of
// size > 1 either both are sharded on the same dim or neither is, and the
// gradient is not Partial (reduce it first, e.g. DDP's all-reduce). It
// checks the hyper-parameters and every parameter before updating any;
// errors wrap ErrInvalid, and on an error nothing has changed.
//
// A parameter on a device is updated by the device's Kernels.AdamW from a
// gradient on the same device (one elsewhere is an error matching
// device.ErrMixed), with moments allocated on that device at its first
// update (an allocation error, such as *device.OOMError, frees what this
// Step allocated and changes nothing). The update is queued on the
// device's compute stream: Step returns once it is queued, and an error
// found while it runs is returned by the device's next Synchronize.
// After Close, Step is an error wrapping ErrInvalid.
func (o *AdamW) Step() error {
	const op = "AdamW.Step"
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
		if err := sameBlock(op, p, o.state[i].m); err != nil {
			return err
		}
	}
	if err := o.allocState(op); err != nil {
		return err
	}
	for i, p := range o.params {
		g := p.Grad()
		if g == nil {
			continue
		}
		st := &o.state[i]
		c := Coefficients(o.LR, o.WeightDecay, o.Beta1, o.Beta2, o.Eps, st.t+1)
		var err error
		switch pd := p.Data().LocalData().(type) {
		case []float32:
			err = Update(c, pd, g.LocalData().([]float32), st.m.([]float32), st.v.([]float32))
		case []float64:
			err = Update(c, pd, g.LocalData().([]float64), st.m.([]float64), st.v.([]float64))
		case device.Buffer:
			err = pd.Owner().Kernels().AdamW(pd, deviceBlock(g), st.m.(device.Buffer), st.v.(device.Buffer), c.array())
		}
		if err != nil {
			// lineUp checked the blocks' shapes and devices, so this is a
			// bug or a closed device, not bad input; earlier parameters
			// are already updated.
			return fmt.Errorf("optim: %s: %q: %w", op, p.Name(), err)
		}
		st.t++
	}
	return nil
}

// array is c in kernels.AdamW's order.
func (c AdamWCoeffs) array() [8]float64 {
	return [8]float64{c.Decay, c.Beta1, c.OneMinusBeta1, c.Beta2, c.OneMinusBeta2, c.SqrtBC2, c.Step, c.Eps}
}

// allocState makes the zero moments of every parameter that has a
// gradient and no state yet, where the parameter lives. On an error it
// frees what it made, so that nothing has changed.
func (o *AdamW) allocState(op string) error {
	var made []int
	for i, p := range o.params {
		st := &o.state[i]
		if p.Grad() == nil || st.m != nil {
			continue
		}
		m, err := newState(p.Data(), true)
		var v any
		if err == nil {
			if v, err = newState(p.Data(), true); err != nil {
				err = errors.Join(err, freeState(m))
			}
		}
		if err != nil {
			for _, j := range made {
				err = errors.Join(err, freeState(o.state[j].m), freeState(o.state[j].v))
				o.state[j].m, o.state[j].v = nil, nil
			}
			return fmt.Errorf("optim: %s: the moments of %q on %s: %w", op, p.Name(), p.Data().Device().Name(), err)
		}
		st.m, st.v = m, v
		made = append(made, i)
	}
	return nil
}

// Close frees the moments held in device memory and ends the optimizer:
// a later Step is an error, StateBytes is 0. Moments of host parameters
// are left to the garbage collector. Call it when training ends, or
// before replacing the optimizer, so that a device's allocator gets its
// memory back. It returns the devices' errors, joined; a second Close
// does nothing.
func (o *AdamW) Close() error {
	if o.closed {
		return nil
	}
	o.closed = true
	var errs []error
	for i := range o.state {
		errs = append(errs, freeState(o.state[i].m), freeState(o.state[i].v))
		o.state[i] = adamState{}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("optim: AdamW.Close: %w", err)
	}
	return nil
}

// check rejects hyper-parameters that torch.optim.AdamW rejects, and
// those that would turn parameters into NaN or Inf (non-finite values,
// ε = 0), by internal/numcheck's rules. A learning rate of 0 is valid:
// warm-up schedules start there.
func (o *AdamW) check(op string) error {
	return checkNums(op,
		numcheck.NonNegative(ErrInvalid, "LR", o.LR),
		numcheck.NonNegative(ErrInvalid, "WeightDecay", o.WeightDecay),
		numcheck.Fraction(ErrInvalid, "Beta1", o.Beta1),
		numcheck.Fraction(ErrInvalid, "Beta2", o.Beta2),
		numcheck.Positive(ErrInvalid, "Eps", o.Eps))
}

// checkGrads checks, before a step changes anything, that every parameter
// has a gradient (unless frozen ones are allowed) whose local block lines
// up with the parameter's.
func checkGrads(op string, params []*autograd.Value, frozen bool) error {
	var (
		errs    []error
		missing []string
	)
	for _, p := range params {
		g := p.Grad()
		if g == nil {
			if !frozen {
				missing = append(missing, p.Name())
			}
			continue
		}
		if err := lineUp(p.Data(), g); err != nil {
			errs = append(errs, fmt.Errorf("optim: %s: %w: %q: %w", op, ErrInvalid, p.Name(), err))
		}
	}
	return errors.Join(append([]error{noGrad(op, missing)}, errs...)...)
}

// lineUp checks that g's local block is the gradient of p's local block.
func lineUp(p, g *placement.DTensor) error {
	ps, gs := p.Spec(), g.Spec()
	if ps.DType() != gs.DType() || !slices.Equal(ps.Shape(), gs.Shape()) {
		return fmt.Errorf("gradient %v does not match the parameter %v in dtype or shape", gs, ps)
	}
	sizes := ps.Mesh().Shape()
	pp, gp := ps.Placements(), gs.Placements()
	for a, n := range sizes {
		if n == 1 {
			continue
		}
		name := ps.Mesh().Names()[a]
		if gp[a].IsPartial() {
			return fmt.Errorf("gradient is %v on mesh axis %q: reduce it before the optimizer step", gp[a], name)
		}
		if pp[a].IsShard() != gp[a].IsShard() || (pp[a].IsShard() && pp[a].Dim() != gp[a].Dim()) {
			return fmt.Errorf("gradient is %v on mesh axis %q where the parameter is %v: redistribute it to the parameter's layout first", gp[a], name, pp[a])
		}
	}
	for d := range ps.Shape() {
		// Equal block shapes are not enough: axes sharding one dim in
		// another order hold other elements.
		if !slices.Equal(ps.Order(d), gs.Order(d)) {
			return fmt.Errorf("gradient shards dim %d over mesh axes %v where the parameter uses %v: redistribute it to the parameter's layout first", d, gs.Order(d), ps.Order(d))
		}
	}
	if ps.Mesh().World() != gs.Mesh().World() || !slices.Equal(ps.Mesh().WorldRanks(), gs.Mesh().WorldRanks()) {
		return fmt.Errorf("gradient is on mesh %v, the parameter on %v", gs.Mesh(), ps.Mesh())
	}
	if !slices.Equal(p.LocalShape(), g.LocalShape()) {
		return fmt.Errorf("gradient block %v does not line up with the parameter block %v", g.LocalShape(), p.LocalShape())
	}
	if err := checkBlock(g.LocalData()); err != nil {
		return fmt.Errorf("gradient holds %w", err)
	}
	// An update reads the gradient where the parameter lives.
	return device.Same("the parameter and its gradient", p.Device(), g.Device())
}

// StateBytes returns the bytes of optimizer state this rank holds: the two
// moment buffers of every parameter updated so far, each the size of the
// parameter's local block (so sharded parameters hold sharded state).
func (o *AdamW) StateBytes() int64 {
	var n int64
	for _, st := range o.state {
		n += stateBytes(st.m) + stateBytes(st.v)
	}
	return n
}
