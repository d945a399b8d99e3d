package moe

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
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
// A Layer belongs to one rank, like its router, and is not safe for
// concurrent use: its dispatches reuse one Workspace.
type Layer struct {
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
	return &LayerOutput{Y: y, Routing: r, Handle: h}, nil
}

// OwnParams returns the router weight and the experts' parameters, so that
// a Layer is a parallel.ParamHolder.
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
		return nil, fmt.Errorf("moe: LayerOutput.AddLosses: %w: nil output", ErrInvalid)
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
