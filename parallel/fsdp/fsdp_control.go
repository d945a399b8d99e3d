package fsdp

import (
	"context"
	"errors"
	"fmt"
)

// Explicit control, for callers that decide when parameters are gathered
// and gradients reduced rather than leaving it to the units' hooks: a
// pipeline schedule's UNSHARD, RESHARD and REDUCE_GRAD actions (PyTorch
// FSDP2's unshard, reshard, set_requires_gradient_sync and
// set_reshard_after_backward, which torch.distributed.pipelining drives
// the same way). One step of a pipeline stage under FSDP is then
//
//	f.SetRequiresGradientSync(false)  // once: reduce only at Finish
//	f.SetReshardAfterBackward(false)  // once: keep them until Reshard
//	h, _ := f.UnshardAsync(ctx)       // UNSHARD: the all-gathers start
//	h.Wait(ctx)                       // before the stage's first compute
//	... the forwards and backwards of the step's micro-batches, interleaved ...
//	f.Finish(ctx)                     // REDUCE_GRAD: one reduce-scatter of the sum
//	f.Reshard(ctx)                    // RESHARD
//
// with New's WithReshard(false) (reshard-after-forward off, as torchtitan
// does under pipelining: one all-gather per unit and step). The hooks
// still gather whatever is not gathered when a unit is entered, so the
// controls change when communication happens, never what is computed.

// Unsharding is the all-gathers UnshardAsync started; Wait completes them.
type Unsharding struct {
	f     *FSDP
	units []*fsdpUnit
}

// Wait completes the all-gathers (those a unit's hook has not completed
// already) and checks that every rank gathered the same units. It may be
// called more than once. Errors are those of the units' hooks: a failed
// all-gather wrapped with the unit's path, ErrMismatch when the ranks
// gathered different units.
func (h *Unsharding) Wait(ctx context.Context) error {
	if h == nil {
		return nil
	}
	var errs []error
	for _, u := range h.units {
		if err := h.f.complete(ctx, u); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// UnshardAsync starts the all-gather of the parameters of the units at
// paths (Wrap's paths; every unit when none is given) and returns at
// once: the caller overlaps it with other work and calls Wait before the
// units compute (a unit entered first waits itself). Units stay gathered
// until their reshard policy frees them (after forward by WithReshard,
// after backward unless SetReshardAfterBackward(false)), Reshard or
// Finish. FSDP has two staging buffers, so at most two units' all-gathers
// are in flight: starting a third completes the first. Units resharded
// after forward share two pooled buffers; one whose buffer another unit
// holds is skipped, to be gathered when entered. Every rank of the shard
// group calls it alike (a collective). Errors wrap ErrInvalid (a path
// that is not a unit, Close has run) or are the all-gather's.
func (f *FSDP) UnshardAsync(ctx context.Context, paths ...string) (*Unsharding, error) {
	us, err := f.controlled("UnshardAsync", paths)
	if err != nil {
		return nil, err
	}
	if !f.ready {
		if err := f.setup(); err != nil {
			return nil, err
		}
	}
	h := &Unsharding{f: f}
	for _, u := range us {
		ok, err := f.issue(ctx, u, u.reshard != 0)
		if err != nil {
			return nil, err
		}
		if ok {
			h.units = append(h.units, u)
		}
	}
	return h, nil
}

// Unshard is UnshardAsync followed by Wait: the units at paths (every
// unit when none) are gathered when it returns. Errors are theirs.
func (f *FSDP) Unshard(ctx context.Context, paths ...string) error {
	h, err := f.UnshardAsync(ctx, paths...)
	if err != nil {
		return err
	}
	return h.Wait(ctx)
}

// Reshard frees the gathered parameters of the units at paths (every unit
// when none): an all-gather in flight is completed first, and the
// modules get their sharded leaves back. The next use gathers again.
// Gradients accumulated under SetRequiresGradientSync(false) are kept for
// Finish. Errors wrap ErrInvalid (a path that is not a unit) or are the
// completed all-gather's.
func (f *FSDP) Reshard(ctx context.Context, paths ...string) error {
	us, err := f.controlled("Reshard", paths)
	if err != nil {
		return err
	}
	var errs []error
	for _, u := range us {
		if err := f.complete(ctx, u); err != nil {
			errs = append(errs, err)
		}
		if u.swapped {
			if err := f.swap(u, false); err != nil {
				errs = append(errs, err)
			}
		}
		f.release(u)
	}
	return errors.Join(errs...)
}

// SetRequiresGradientSync turns the gradient reduction of backward passes
// on (true, the default) or off. Off, no backward reduces anything: every
// pass's gradients (any number of micro-batches, their forwards and
// backwards interleaved, a backward split in an input and a weight half)
// add up unsharded on the gathered leaves, and Finish reduce-scatters
// their sum once, exactly as one pass over the whole batch would be
// reduced (the scale is WithAverage's or WithGradientDivideFactor's
// alone: no division by the number of passes). It differs from NoSync,
// which a forward following a backward ends with a reduction; this lasts
// until turned on again, and Finish may run while it is off.
func (f *FSDP) SetRequiresGradientSync(on bool) { f.noGradSync = !on }

// SetReshardAfterBackward sets whether a unit frees its gathered
// parameters after its backward (true, the default under ZeRO-3) or keeps
// them until Reshard or Finish (false), so that the forwards and
// backwards of a step's further micro-batches gather nothing. It applies
// to the units kept gathered after forward (WithReshard(false), the
// root): units resharded after forward share two pooled buffers and are
// freed after backward regardless.
func (f *FSDP) SetReshardAfterBackward(on bool) { f.keepAfterB = !on }

// reshardsAfterBackward reports whether u's hooks free its parameters
// after its backward.
func (f *FSDP) reshardsAfterBackward(u *fsdpUnit) bool {
	return f.cfg.stage == 3 && (!f.keepAfterB || u.reshard != 0)
}

// controlled returns the units at paths (every unit when none), for op.
func (f *FSDP) controlled(op string, paths []string) ([]*fsdpUnit, error) {
	if f.closed {
		return nil, fmt.Errorf("%w: FSDP.%s: FSDP.Close has run", ErrInvalid, op)
	}
	if len(f.units) == 0 {
		return nil, fmt.Errorf("%w: FSDP.%s: no units wrapped", ErrInvalid, op)
	}
	if len(paths) == 0 {
		return f.units, nil
	}
	out := make([]*fsdpUnit, 0, len(paths))
	for _, p := range paths {
		u := f.unitAt(p)
		if u == nil {
			return nil, fmt.Errorf("%w: FSDP.%s: %q is not a unit", ErrInvalid, op, p)
		}
		out = append(out, u)
	}
	return out, nil
}

// unitAt returns the unit Wrap gave path, or nil.
func (f *FSDP) unitAt(path string) *fsdpUnit {
	for _, u := range f.units {
		if u.path == path {
			return u
		}
	}
	return nil
}
