package parallel

import (
	"context"
	"fmt"
	"strconv"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/parallel/internal/tree"
)

// Layer is a module whose forward takes one value and returns one: what
// Sequential chains (Linear, LayerNorm, MLP, Attention, Activation,
// Dropout, Sequential itself, or a user's module).
type Layer interface {
	Module
	// Forward computes the layer's output from x, running its hooks
	// (Hooks.Run).
	Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error)
}

// Sequential runs its layers in order, each on the previous one's output,
// like PyTorch's nn.Sequential. Its children are named "0", "1", … by
// position, so tp.Plan and fsdp.FullyShard patterns name them as "0", "2.fc" or
// "*". Its own hooks wrap the whole chain; each layer's run inside it.
type Sequential struct {
	Hooks
	Layers []Layer
}

// NewSequential chains layers (at least one; none nil). Errors wrap
// ErrInvalid.
func NewSequential(layers ...Layer) (*Sequential, error) {
	if len(layers) == 0 {
		return nil, fmt.Errorf("%w: NewSequential: no layers", ErrInvalid)
	}
	for i, l := range layers {
		if tree.IsNil(l) {
			return nil, fmt.Errorf("%w: NewSequential: layer %d is nil", ErrInvalid, i)
		}
	}
	return &Sequential{Layers: layers}, nil
}

// Children returns the layers, named by their position.
func (s *Sequential) Children() []Child {
	out := make([]Child, len(s.Layers))
	for i, l := range s.Layers {
		out[i] = Child{Name: strconv.Itoa(i), Module: l}
	}
	return out
}

// Forward runs the layers in order inside the Sequential's own hooks
// (Hooks.Run), so that hooks installed on it (FSDP's gather, TP's
// layouts, checkpointing) fire. A nil Sequential or layer, or a nil x, is
// an error wrapping ErrInvalid; a layer's error is returned wrapped with
// its position.
func (s *Sequential) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if s == nil || len(s.Layers) == 0 {
		return nil, fmt.Errorf("%w: Sequential: nil or empty", ErrInvalid)
	}
	if x == nil {
		return nil, nilInput("Sequential")
	}
	return s.Run(ctx, x, func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
		for i, l := range s.Layers {
			if tree.IsNil(l) {
				return nil, fmt.Errorf("%w: Sequential: layer %d is nil", ErrInvalid, i)
			}
			var err error
			if x, err = l.Forward(ctx, x); err != nil {
				return nil, fmt.Errorf("parallel: Sequential layer %d: %w", i, err)
			}
		}
		return x, nil
	})
}

// Activation is a parameter-free module applying an element-wise
// function: NewReLU, NewSiLU, NewTanh, NewSigmoid and NewGELU make the
// usual ones. Its sharding is the function's rule: any layout but Partial
// passes through.
type Activation struct {
	Hooks
	// Name names the function in errors ("ReLU").
	Name string
	// Fn is the function, an autograd op of one value.
	Fn func(*autograd.Value) (*autograd.Value, error)
}

// NewReLU returns an Activation applying autograd.ReLU.
func NewReLU() *Activation { return &Activation{Name: "ReLU", Fn: autograd.ReLU} }

// NewSiLU returns an Activation applying autograd.SiLU.
func NewSiLU() *Activation { return &Activation{Name: "SiLU", Fn: autograd.SiLU} }

// NewTanh returns an Activation applying autograd.Tanh.
func NewTanh() *Activation { return &Activation{Name: "Tanh", Fn: autograd.Tanh} }

// NewSigmoid returns an Activation applying autograd.Sigmoid.
func NewSigmoid() *Activation { return &Activation{Name: "Sigmoid", Fn: autograd.Sigmoid} }

// NewGELU returns an Activation applying autograd.GELU.
func NewGELU() *Activation { return &Activation{Name: "GELU", Fn: autograd.GELU} }

// Children returns nil: an Activation is a leaf module.
func (a *Activation) Children() []Child { return nil }

// Forward runs the hooks and the function. A nil Activation, Fn or x is
// an error wrapping ErrInvalid.
func (a *Activation) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if a == nil || a.Fn == nil {
		return nil, fmt.Errorf("%w: Activation: nil module or function", ErrInvalid)
	}
	if x == nil {
		return nil, nilInput(a.Name)
	}
	y, err := a.Run(ctx, x, func(_ context.Context, x *autograd.Value) (*autograd.Value, error) { return a.Fn(x) })
	if err != nil {
		return nil, fmt.Errorf("parallel: %s: %w", a.Name, err)
	}
	return y, nil
}

// Dropout is the dropout module: in training mode (the default) each
// Forward is autograd.Dropout(x, P, Seed, n) with n the number of forwards
// run in training mode so far, so that successive steps draw new masks,
// ranks draw the masks of a serial run whatever the layout, and an
// activation checkpoint's recomputation draws its forward's mask again. In
// evaluation mode (Eval, SetTraining(false)) it is the identity. Every
// rank must run the same forwards; give each Dropout of a model its own
// Seed, or two of them drop the same elements of same-shaped inputs.
type Dropout struct {
	Hooks
	// P is the probability of dropping an element, in [0, 1).
	P float64
	// Seed selects the masks.
	Seed uint64

	steps uint64
	eval  bool
}

// NewDropout returns a Dropout in training mode dropping with probability
// p (in [0, 1), else an error wrapping ErrInvalid) under seed.
func NewDropout(p float64, seed uint64) (*Dropout, error) {
	if err := numcheck.Fraction(ErrInvalid, "NewDropout: dropout probability", p); err != nil {
		return nil, err
	}
	return &Dropout{P: p, Seed: seed}, nil
}

// Children returns nil: a Dropout is a leaf module.
func (d *Dropout) Children() []Child { return nil }

// SetTraining switches between training (on: drop) and evaluation (off:
// the identity).
func (d *Dropout) SetTraining(on bool) { d.eval = !on }

// Training reports whether d drops (training mode).
func (d *Dropout) Training() bool { return !d.eval }

// Forward runs the hooks and the dropout (the identity in evaluation
// mode). A nil Dropout or x, or P outside [0, 1), is an error wrapping
// ErrInvalid.
func (d *Dropout) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if d == nil {
		return nil, fmt.Errorf("%w: Dropout: nil module", ErrInvalid)
	}
	if x == nil {
		return nil, nilInput("Dropout")
	}
	if err := numcheck.Fraction(ErrInvalid, "Dropout: dropout probability", d.P); err != nil {
		return nil, err
	}
	eval, step := d.eval, d.steps
	if !eval {
		d.steps++
	}
	y, err := d.Run(ctx, x, func(_ context.Context, x *autograd.Value) (*autograd.Value, error) {
		if eval {
			return x, nil
		}
		return autograd.Dropout(x, d.P, d.Seed, step)
	})
	if err != nil {
		return nil, fmt.Errorf("parallel: Dropout: %w", err)
	}
	return y, nil
}
