package parallel

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/parallel/internal/tree"
)

// Module is one node of a model's layer tree. A model is written once, in
// global terms, from modules; tp.Parallelize then changes how their parameters
// and activations are laid out without touching the model's code.
type Module interface {
	// Children returns the direct submodules, in a fixed order, each with
	// its name (a path segment such as "attn" or "0").
	Children() []Child
	// Boundary returns the hooks that run on the module's inputs and
	// outputs; styles install redistributions there.
	Boundary() *Hooks
}

// Child is a named submodule.
type Child struct {
	Name   string
	Module Module
}

// Hook transforms a value crossing a module boundary, typically a
// Redistribute to the layout the next computation expects.
type Hook func(ctx context.Context, v *autograd.Value) (*autograd.Value, error)

// EnterHook runs when a module's forward begins, before the module reads
// its parameters: FSDP gathers the module's parameters there.
type EnterHook func(ctx context.Context) error

// Around wraps the body of a module's forward (its input hooks and its
// computation, see Hooks.Run): it calls next with the input, or
// arranges for it to be called (activation checkpointing runs it once
// without saving activations and again during backward), and returns
// next's result.
type Around func(ctx context.Context, x *autograd.Value, next func(context.Context, *autograd.Value) (*autograd.Value, error)) (*autograd.Value, error)

// Hooks holds a module's boundary hooks: enter hooks (the forward is
// starting), input and output hooks (on every value crossing the
// boundary) and around wrappers (of the forward's body). The zero value
// has none and is ready to use; embedding Hooks in a module implements
// Boundary.
//
// A module's Forward cooperates with them: a module of one input and one
// output value calls Run; any other calls Enter before it reads its
// parameters, Input on each input value and Output on each output value,
// after its computation (Around wrappers then do not apply).
type Hooks struct {
	enter  []EnterHook
	in     []Hook
	out    []Hook
	around []Around
}

// Boundary returns b itself, so that embedding Hooks implements that half
// of Module.
func (b *Hooks) Boundary() *Hooks { return b }

// OnEnter appends a hook run, in order, when the module's forward begins.
func (b *Hooks) OnEnter(h EnterHook) { b.enter = append(b.enter, h) }

// OnInput appends a hook run, in order, on every input value.
func (b *Hooks) OnInput(h Hook) { b.in = append(b.in, h) }

// OnOutput appends a hook run, in order, on every output value.
func (b *Hooks) OnOutput(h Hook) { b.out = append(b.out, h) }

// OnAround appends a wrapper of the forward's body; the first appended is
// the outermost.
func (b *Hooks) OnAround(a Around) { b.around = append(b.around, a) }

// Count returns how many hooks and wrappers are installed (enter, input,
// output and Around together): 0 for a module no parallelism has touched.
func (b *Hooks) Count() int { return len(b.enter) + len(b.in) + len(b.out) + len(b.around) }

// Enter runs the enter hooks.
func (b *Hooks) Enter(ctx context.Context) error {
	for _, h := range b.enter {
		if err := h(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Input runs the input hooks on v.
func (b *Hooks) Input(ctx context.Context, v *autograd.Value) (*autograd.Value, error) {
	return runHooks(ctx, b.in, v)
}

// Output runs the output hooks on v.
func (b *Hooks) Output(ctx context.Context, v *autograd.Value) (*autograd.Value, error) {
	return runHooks(ctx, b.out, v)
}

// Run is the forward of a module of one input and one output value: it
// runs the enter hooks, then the body (the input hooks on x, then compute)
// inside the Around wrappers, then the output hooks on the result. Errors
// from hooks are returned as they are; errors from compute too.
func (b *Hooks) Run(ctx context.Context, x *autograd.Value, compute func(context.Context, *autograd.Value) (*autograd.Value, error)) (*autograd.Value, error) {
	if err := b.Enter(ctx); err != nil {
		return nil, err
	}
	body := func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
		x, err := b.Input(ctx, x)
		if err != nil {
			return nil, err
		}
		return compute(ctx, x)
	}
	for i := len(b.around) - 1; i >= 0; i-- {
		a, next := b.around[i], body
		body = func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) { return a(ctx, x, next) }
	}
	y, err := body(ctx, x)
	if err != nil {
		return nil, err
	}
	return b.Output(ctx, y)
}

func runHooks(ctx context.Context, hooks []Hook, v *autograd.Value) (*autograd.Value, error) {
	for _, h := range hooks {
		var err error
		if v, err = h(ctx, v); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// Walk calls fn for root (path "") and every submodule, depth first in
// Children order, with its dotted path ("h.0.attn.qkv"). A module that
// appears at several paths is visited at each of them. It stops at the
// first error fn returns. A nil module (also a nil pointer of a module
// type) is an error wrapping ErrInvalid.
func Walk(root Module, fn func(path string, m Module) error) error {
	if tree.IsNil(root) {
		return fmt.Errorf("%w: Walk: nil module", ErrInvalid)
	}
	return walk("", root, fn)
}

func walk(path string, m Module, fn func(string, Module) error) error {
	if err := fn(path, m); err != nil {
		return err
	}
	for _, c := range m.Children() {
		if tree.IsNil(c.Module) {
			return fmt.Errorf("%w: module %q: child %q is nil", ErrInvalid, path, c.Name)
		}
		p := c.Name
		if path != "" {
			p = path + "." + c.Name
		}
		if err := walk(p, c.Module, fn); err != nil {
			return err
		}
	}
	return nil
}

// ParamHolder is implemented by modules that own parameters directly (not
// through children).
type ParamHolder interface {
	// OwnParams returns the module's own parameter leaves (not its
	// children's); nil entries are skipped.
	OwnParams() []*autograd.Value
}

// Params returns the parameter leaves of root and all its submodules in
// Walk order, each once.
func Params(root Module) ([]*autograd.Value, error) {
	var out []*autograd.Value
	seen := map[*autograd.Value]bool{}
	err := Walk(root, func(_ string, m Module) error {
		h, ok := m.(ParamHolder)
		if !ok {
			return nil
		}
		for _, p := range h.OwnParams() {
			if p != nil && !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
		return nil
	})
	return out, err
}

// nilInput is the error of a layer op called with a nil input.
func nilInput(op string) error { return fmt.Errorf("%w: %s: nil input", ErrInvalid, op) }

// ParamSetter is implemented by ParamHolders whose parameter fields can be
// replaced: FSDP swaps a module's sharded parameter leaves for their
// gathered copies while its forward runs, and back afterwards.
type ParamSetter interface {
	ParamHolder
	// SetOwnParams replaces the module's own parameters with ps, one per
	// entry of OwnParams in the same order (nil where OwnParams has nil).
	// It fails, changing nothing, when the count or a nil entry differs.
	SetOwnParams(ps []*autograd.Value) error
}

// checkSetParams checks ps against a module's current own parameters for
// SetOwnParams: the same count, and nil exactly where they are nil.
func checkSetParams(what string, cur, ps []*autograd.Value) error {
	if len(ps) != len(cur) {
		return fmt.Errorf("%w: %s.SetOwnParams: %d parameters for %d", ErrInvalid, what, len(ps), len(cur))
	}
	for i := range ps {
		if (ps[i] == nil) != (cur[i] == nil) {
			return fmt.Errorf("%w: %s.SetOwnParams: parameter %d is nil in one list and not the other", ErrInvalid, what, i)
		}
	}
	return nil
}
