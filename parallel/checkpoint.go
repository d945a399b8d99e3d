package parallel

import (
	"context"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/parallel/internal/tree"
)

// Checkpoint makes every module of root's tree whose path matches one of
// patterns (dotted path patterns, "*" matching one segment, as in tp.Plan:
// "h.*" for every GPT block) run its forward body under
// autograd.Checkpoint with opts: it installs an Around wrapper (OnAround),
// so the module's input hooks and computation save no activations and are
// recomputed during backward, while its enter and output hooks run once,
// outside the region. Pass autograd.WithKeepMatrixProducts() (or
// autograd.WithKeepOps) for selective checkpointing.
//
// It composes with the other parallelisms: with tp.Parallelize (before or
// after it: the redistributions a style installs inside the module are
// recomputed, those on the boundary's outside are not), with DDP (each
// parameter's gradient-ready hook still fires once per backward, when the
// checkpointed module's backward is over) and with FSDP (see
// autograd.Tape.Recomputing). Gradients are those of the model without
// checkpointing, bit for bit.
//
// Around wrappers apply to modules whose forward goes through Hooks.Run
// (one input, one output value: LayerNorm, Linear.Forward, Attention, MLP,
// a GPT block); an Embedding, or a Linear with Chunks > 1 (whose
// ForwardChunks does not use Run), is an error. A module matched by
// several patterns, or reachable at several paths, is wrapped once.
// Errors wrap ErrInvalid: a nil module, no patterns, a pattern that
// matches no module, or a module that cannot be wrapped.
func Checkpoint(root Module, patterns []string, opts ...autograd.CheckpointOption) error {
	if len(patterns) == 0 {
		return fmt.Errorf("%w: Checkpoint: no patterns", ErrInvalid)
	}
	type match struct {
		path string
		m    Module
	}
	var mods []match
	if err := Walk(root, func(p string, m Module) error {
		mods = append(mods, match{p, m})
		return nil
	}); err != nil {
		return err
	}
	var wrap []match
	seen := map[Module]bool{}
	for _, pattern := range patterns {
		pat := strings.Split(pattern, ".")
		n := 0
		for _, mm := range mods {
			if !tree.MatchPath(pat, mm.path) {
				continue
			}
			n++
			if tree.Comparable(mm.m) {
				if seen[mm.m] {
					continue
				}
				seen[mm.m] = true
			}
			switch x := mm.m.(type) {
			case *Embedding:
				return fmt.Errorf("%w: Checkpoint: module %q is an Embedding, whose forward takes ids and has no Around wrappers", ErrInvalid, mm.path)
			case *Linear:
				if x.chunks() > 1 {
					return fmt.Errorf("%w: Checkpoint: module %q is a fused Linear (Chunks %d), whose ForwardChunks has no Around wrappers; checkpoint the module that calls it", ErrInvalid, mm.path, x.Chunks)
				}
			}
			if mm.m.Boundary() == nil {
				return fmt.Errorf("%w: Checkpoint: module %q (%T) has no Boundary hooks", ErrInvalid, mm.path, mm.m)
			}
			wrap = append(wrap, mm)
		}
		if n == 0 {
			return fmt.Errorf("%w: Checkpoint: pattern %q matches no module", ErrInvalid, pattern)
		}
	}
	for _, mm := range wrap {
		mm.m.Boundary().OnAround(checkpointAround(opts))
	}
	return nil
}

// checkpointAround is the Around wrapper Checkpoint installs.
func checkpointAround(opts []autograd.CheckpointOption) Around {
	return func(ctx context.Context, x *autograd.Value, next func(context.Context, *autograd.Value) (*autograd.Value, error)) (*autograd.Value, error) {
		if x == nil {
			return nil, nilInput("Checkpoint")
		}
		out, err := autograd.Checkpoint(ctx, []*autograd.Value{x}, func(ctx context.Context, in []*autograd.Value) ([]*autograd.Value, error) {
			y, err := next(ctx, in[0])
			if err != nil {
				return nil, err
			}
			return []*autograd.Value{y}, nil
		}, opts...)
		if err != nil {
			return nil, err
		}
		return out[0], nil
	}
}
