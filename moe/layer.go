package moe

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/parallel"
)

// Layer is a mixture-of-experts layer with expert parallelism:
//
//	routing = Router.Route(x)
//	rows, h = Dispatch(x, routing)           # token copies to their experts' ranks
//	out     = Experts.Forward(rows, h)       # each local expert on its rows
//	y       = Combine(out, h, routing.Gates) # back to the tokens, gate-weighted
//
// which is reference/MOE_LAYER.md's layer when the router is configured as there
// (K = 2, Renormalize, AuxCoef 0.01, ZCoef 0.001). The tokens x [N, D] are
// Shard(0) on the token-sharding axes (which must include the
// expert-parallel axis) and Replicate elsewhere; y has x's layout. The
// caller adds the routing's Aux and Z to its loss (LayerOutput.AddLosses).
//
// A Layer is a parallel.Module, a leaf of a model's tree whose own
// parameters are the router weight and the experts' (OwnParams, in that
// order; SetOwnParams replaces them), so that parallel.Params collects
// them, Plan and FullyShard patterns name the layer by its path and FSDP
// can make it a unit. Forward runs its hooks (parallel.Hooks: enter, input
// on x, output on y); SeqLayer makes it a parallel.Layer for Sequential.
//
// A Layer belongs to one rank, like its router, and is not safe for
// concurrent use: its dispatches reuse one Workspace.
type Layer struct {
	parallel.Hooks
	// Router routes the tokens.
	Router *Router
	// Experts computes the experts; its axis is the expert-parallel axis.
	Experts *Experts
	// Dispatch configures the dispatch. An empty Axis means the experts'
	// axis; otherwise it must equal it. A nil Workspace means the layer's
	// own, made on first use and reused by every later Forward.
	Dispatch DispatchConfig

	ws *Workspace
}

// LayerOutput is the result of one Layer.Forward.
type LayerOutput struct {
	// Y is the layer's output, laid out like its input.
	Y *autograd.Value
	// Routing is the router's decision, with the auxiliary losses.
	Routing *Routing
	// Handle is the dispatch's handle; Handle.Stats are the step's
	// diagnostics (its Backward timings fill in during Backward).
	Handle *Handle
}

// Forward runs the layer on this rank's tokens x. It is collective over
// the mesh (the router's all-reduce of counts, the dispatch's count
// exchange when the layout is ragged, and the payload all-to-all-v's of
// dispatch and combine); every rank calls it in the same order. Errors wrap
// ErrInvalid or the error of the step that failed, with the step named.
func (l *Layer) Forward(ctx context.Context, x *autograd.Value) (*LayerOutput, error) {
	const op = "moe: Layer.Forward"
	if l == nil || l.Router == nil || l.Experts == nil {
		return nil, fmt.Errorf("%s: %w: nil layer, router or experts", op, ErrInvalid)
	}
	cfg := l.Dispatch
	if cfg.Axis == "" {
		cfg.Axis = l.Experts.axis
	}
	if cfg.Workspace == nil {
		if l.ws == nil {
			l.ws = new(Workspace)
		}
		cfg.Workspace = l.ws
	}
	if cfg.Axis != l.Experts.axis {
		return nil, fmt.Errorf("%s: %w: dispatch over axis %q, experts over %q", op, ErrInvalid, cfg.Axis, l.Experts.axis)
	}
	if e := l.Router.NumExperts(); e != l.Experts.e {
		return nil, fmt.Errorf("%s: %w: the router has %d experts, the experts module %d", op, ErrInvalid, e, l.Experts.e)
	}
	// The enter hooks run before the parameters are read (FSDP gathers
	// them there), the input hooks on x and the output hooks on y.
	if err := l.Enter(ctx); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	x, err := l.Input(ctx, x)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	r, err := l.Router.Route(ctx, x)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	rows, h, err := Dispatch(ctx, x, r, cfg)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	out, err := l.Experts.Forward(ctx, rows, h)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	y, err := Combine(ctx, out, h, r.Gates)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if y, err = l.Output(ctx, y); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return &LayerOutput{Y: y, Routing: r, Handle: h}, nil
}

// Children returns nil: a Layer is a leaf module (its router and experts
// are parts of it, not modules of the tree).
func (l *Layer) Children() []parallel.Child { return nil }

// SetOwnParams replaces the router weight and the experts' W1, b1, W2 and
// b2, in OwnParams order (parallel.ParamSetter; FSDP swaps in the gathered
// parameters while the layer runs). The new values must be laid out as the
// old ones; a count or nil entry that differs is an error wrapping
// ErrInvalid, and nothing changes.
func (l *Layer) SetOwnParams(ps []*autograd.Value) error {
	cur := l.OwnParams()
	if l == nil || l.Router == nil || l.Experts == nil || len(ps) != len(cur) {
		return fmt.Errorf("%w: Layer.SetOwnParams: %d parameters for %d", ErrInvalid, len(ps), len(cur))
	}
	for i, p := range ps {
		if p == nil {
			return fmt.Errorf("%w: Layer.SetOwnParams: parameter %d is nil", ErrInvalid, i)
		}
	}
	l.Router.Weight = ps[0]
	l.Experts.W1, l.Experts.B1, l.Experts.W2, l.Experts.B2 = ps[1], ps[2], ps[3], ps[4]
	return nil
}

// OwnParams returns the router weight and the experts' parameters (W1, b1,
// W2, b2), so that a Layer is a parallel.ParamHolder.
func (l *Layer) OwnParams() []*autograd.Value {
	var ps []*autograd.Value
	if l == nil {
		return nil
	}
	if l.Router != nil {
		ps = append(ps, l.Router.OwnParams()...)
	}
	if l.Experts != nil {
		ps = append(ps, l.Experts.OwnParams()...)
	}
	return ps
}

// AddLosses returns task + Aux + Z, skipping the losses the router has
// turned off. task must be a scalar laid out like them (shape [],
// Partial(sum) on the token-sharding axes, Replicate elsewhere), as
// autograd.Sum of a token-sharded value is. Errors are autograd.Add's.
func (o *LayerOutput) AddLosses(task *autograd.Value) (*autograd.Value, error) {
	if o == nil || o.Routing == nil {
		return nil, fmt.Errorf("%w: LayerOutput.AddLosses: nil output", ErrInvalid)
	}
	loss := task
	for _, extra := range []*autograd.Value{o.Routing.Aux, o.Routing.Z} {
		if extra == nil {
			continue
		}
		var err error
		if loss, err = autograd.Add(loss, extra); err != nil {
			return nil, fmt.Errorf("moe: LayerOutput.AddLosses: %w", err)
		}
	}
	return loss, nil
}

// SeqLayer is a Layer as a parallel.Layer, for parallel.Sequential: its
// Forward returns the layer's output y and keeps the routing of every
// forward, whose auxiliary losses AddLosses adds to the task loss. It is
// the same module as its Layer (leaf, parameters and hooks).
type SeqLayer struct {
	*Layer
	outs []*LayerOutput
	eval bool
}

// SetTraining selects training mode (on, the default: Forward keeps the
// routing for AddLosses) or evaluation mode (off: it keeps nothing, since
// no loss is trained on); parallel.Train and parallel.Eval call it.
func (s *SeqLayer) SetTraining(on bool) {
	s.eval = !on
	if !on {
		s.outs = nil
	}
}

// Forward runs Layer.Forward on x and returns its y.
func (s *SeqLayer) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	if s == nil {
		return nil, fmt.Errorf("%w: SeqLayer.Forward: nil layer", ErrInvalid)
	}
	out, err := s.Layer.Forward(ctx, x)
	if err != nil {
		return nil, err
	}
	if !s.eval {
		s.outs = append(s.outs, out)
	}
	return out.Y, nil
}

// AddLosses returns task plus the routing losses (Aux and Z) of every
// forward since the last AddLosses, and forgets them; task must be laid
// out like them (LayerOutput.AddLosses). Without a forward it returns
// task.
func (s *SeqLayer) AddLosses(task *autograd.Value) (*autograd.Value, error) {
	if s == nil {
		return nil, fmt.Errorf("%w: SeqLayer.AddLosses: nil layer", ErrInvalid)
	}
	outs := s.outs
	s.outs = nil
	loss := task
	for _, o := range outs {
		var err error
		if loss, err = o.AddLosses(loss); err != nil {
			return nil, err
		}
	}
	return loss, nil
}
