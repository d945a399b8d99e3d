package optim

import (
	"fmt"
	"math"
	"strings"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// Option configures NewAdamW, NewSGD or ClipGradNorm. Options that mean
// the same for several (WeightDecay, WithAllowFrozen) are shared; giving one
// an option it does not take (Momentum to AdamW, Betas to SGD, WithNormType
// to an optimizer) is an error wrapping ErrInvalid rather than a setting
// silently ignored. When an option is given twice, the last one wins.
type Option func(*config)

// config holds every optimizer's hyper-parameters, defaulted by the
// constructor, plus the set of options given so that a constructor can
// reject those it does not take.
type config struct {
	lr, beta1, beta2, eps, weightDecay float64
	momentum, dampening                float64
	nesterov, maximize                 bool
	frozen                             bool // AllowFrozen
	normType                           float64
	errNonfinite                       bool
	given                              []string // option names, in call order
}

func (c *config) set(name string) { c.given = append(c.given, name) }

// WithLR sets AdamW's learning rate (default 1e-3, as torch.optim.AdamW), in
// parameter units per unit of the normalised update. SGD takes its
// learning rate positionally, as torch.optim.SGD requires one.
func WithLR(lr float64) Option { return func(c *config) { c.lr = lr; c.set("WithLR") } }

// WithBetas sets AdamW's moment decay rates β1 and β2, each in [0, 1)
// (default 0.9 and 0.999, as torch.optim.AdamW).
func WithBetas(beta1, beta2 float64) Option {
	return func(c *config) { c.beta1, c.beta2 = beta1, beta2; c.set("WithBetas") }
}

// WithEps sets AdamW's ε, added to sqrt(v̂) before dividing (default 1e-8, as
// torch.optim.AdamW). It must be > 0: PyTorch accepts 0, which divides 0
// by 0 wherever a gradient has always been 0.
func WithEps(eps float64) Option { return func(c *config) { c.eps = eps; c.set("WithEps") } }

// WithWeightDecay sets the weight decay λ ≥ 0. For AdamW it is decoupled:
// every step first multiplies the parameter by 1 − lr·λ (default 0.01, as
// torch.optim.AdamW). For SGD it is coupled L2 regularisation: λ·p is
// added to the gradient before momentum (default 0, as torch.optim.SGD).
func WithWeightDecay(wd float64) Option {
	return func(c *config) { c.weightDecay = wd; c.set("WithWeightDecay") }
}

// WithMomentum sets SGD's momentum factor μ ≥ 0 (default 0: no momentum
// buffer, as torch.optim.SGD).
func WithMomentum(mu float64) Option {
	return func(c *config) { c.momentum = mu; c.set("WithMomentum") }
}

// WithDampening sets SGD's dampening τ: later steps add (1 − τ)·g to the
// momentum buffer (the first step sets it to g). Default 0, as
// torch.optim.SGD.
func WithDampening(tau float64) Option {
	return func(c *config) { c.dampening = tau; c.set("WithDampening") }
}

// WithNesterov makes SGD use Nesterov momentum; it needs Momentum > 0 and
// zero Dampening. Off by default, as torch.optim.SGD.
func WithNesterov() Option { return func(c *config) { c.nesterov = true; c.set("WithNesterov") } }

// WithMaximize makes SGD ascend the objective instead of descending it. Off
// by default, as torch.optim.SGD.
func WithMaximize() Option { return func(c *config) { c.maximize = true; c.set("WithMaximize") } }

// WithAllowFrozen lets a parameter have no gradient in a step: AdamW.Step and
// SGD.Step skip it (PyTorch's grad None: no decay, no moment or step
// count advance) and ClipGradNorm leaves it out of the norm. Without it a
// parameter with no gradient is an error wrapping ErrInvalid that names
// it, because it usually means something is silently wrong: a list that
// holds leaves the model no longer uses, a layer the loss does not reach,
// a forgotten DDP.Finish or FSDP.Finish. Give it for parameters that are
// frozen on purpose, or used only in some steps. The check is per rank;
// DDP and FSDP make every rank agree on which parameters have a
// gradient (one that no rank gave a gradient gets none), so after them
// it fails alike on every rank.
func WithAllowFrozen() Option { return func(c *config) { c.frozen = true; c.set("WithAllowFrozen") } }

// newConfig applies opts over the defaults d and rejects any option not in
// takes, naming it.
func newConfig(op string, d config, takes []string, opts []Option) (config, error) {
	c := d
	for _, o := range opts {
		if o == nil {
			return c, fmt.Errorf("optim: %s: %w: nil option", op, ErrInvalid)
		}
		o(&c)
	}
	for _, name := range c.given {
		ok := false
		for _, t := range takes {
			ok = ok || t == name
		}
		if !ok {
			return c, fmt.Errorf("optim: %s: %w: option %s does not apply (it takes %s)", op, ErrInvalid, name, strings.Join(takes, ", "))
		}
	}
	c.given = nil
	return c, nil
}

// noGrad is the error for parameters without a gradient in a step that
// does not WithAllowFrozen: names lists them, in list order.
func noGrad(op string, names []string) error {
	if len(names) == 0 {
		return nil
	}
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = fmt.Sprintf("%q", n)
	}
	what := "parameter " + q[0] + " has"
	if len(q) > 1 {
		what = fmt.Sprintf("%d parameters have", len(q))
		if len(q) > 8 {
			q = append(q[:8], "...")
		}
		what += " (" + strings.Join(q, ", ") + ")"
	}
	return fmt.Errorf("optim: %s: %w: %s no gradient: a leaf the model no longer uses (collected before a layout change that replaced it?), a layer the loss does not reach, or a missing DDP or FSDP Finish; give WithAllowFrozen for parameters frozen on purpose", op, ErrInvalid, what)
}

// sameBlock checks that optimizer state made for p (nil: none yet) still
// has the size of p's local block: a parameter laid out anew after the
// optimizer's first step (Parallelize, FSDP) would otherwise be updated
// from state of another layout.
func sameBlock(op string, p *autograd.Value, state any) error {
	if state == nil {
		return nil
	}
	if err := device.Same("optimizer state and parameter", stateDevice(state), p.Data().Device()); err != nil {
		return fmt.Errorf("optim: %s: %w: %q was moved to another device after the optimizer's first step; make the optimizer after moving parameters: %w", op, ErrInvalid, p.Name(), err)
	}
	if n, want := stateBytes(state), stateBytes(p.Data().LocalData()); n != want {
		return fmt.Errorf("optim: %s: %w: %q was laid out anew after the optimizer's first step (its state has %d bytes, its local block %d); lay parameters out (Parallelize, FSDP) before making the optimizer", op, ErrInvalid, p.Name(), n, want)
	}
	return nil
}

// checkNums returns the first error of numcheck rules, prefixed with op.
func checkNums(op string, errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return fmt.Errorf("optim: %s: %w", op, err)
		}
	}
	return nil
}

// normOrder checks a norm order for checkNums: p > 0 and finite, or +Inf
// (the largest absolute element).
func normOrder(p float64) error {
	if math.IsInf(p, 1) {
		return nil
	}
	return numcheck.Positive(ErrInvalid, "NormType", p)
}
