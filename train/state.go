package train

import (
	"fmt"

	"github.com/b7ea7098/loom/placement"
)

// State dicts: a Sampler's position and a Trainer's step are entries of
// a checkpoint (package checkpoint's Stateful), so that a resumed run
// gives the batches and learning rates the uninterrupted one would.

// StateDict returns the sampler's position as the int64 entries
// prefix+"epoch" and prefix+"index" (SamplerState), and no tensors. The
// position is the global batch's, the same on every rank, so it restores
// on any number of data-parallel ranks.
func (s *Sampler) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	return map[string]*placement.DTensor{}, map[string]any{
		prefix + "epoch": int64(s.pos.Epoch),
		prefix + "index": int64(s.pos.Index),
	}, nil
}

// LoadStateDict restores the position StateDict saved under prefix
// (Restore). A missing entry, one of another type, or a position outside
// this sampler's epochs (a dataset or batch size that changed) is an
// error wrapping ErrInvalid, and the position is unchanged.
func (s *Sampler) LoadStateDict(prefix string, entries map[string]any) error {
	const op = "train: Sampler.LoadStateDict"
	epoch, err := intEntry(op, entries, prefix+"epoch")
	if err != nil {
		return err
	}
	index, err := intEntry(op, entries, prefix+"index")
	if err != nil {
		return err
	}
	if err := s.Restore(SamplerState{Epoch: epoch, Index: index}); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	return nil
}

// StateDict returns the number of steps taken as the int64 entry
// prefix+"step", and no tensors: the learning-rate schedule's position
// (WithSchedule reads the schedule at Steps()). The model and the
// optimizer are parts of their own (checkpoint.Module, the optimizer's
// StateDict).
func (t *Trainer[B]) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	return map[string]*placement.DTensor{}, map[string]any{prefix + "step": int64(t.step)}, nil
}

// LoadStateDict sets the number of steps taken from the entry
// prefix+"step" (Resume). A missing or negative entry, or one of another
// type, is an error wrapping ErrInvalid.
func (t *Trainer[B]) LoadStateDict(prefix string, entries map[string]any) error {
	const op = "train: Trainer.LoadStateDict"
	n, err := intEntry(op, entries, prefix+"step")
	if err != nil {
		return err
	}
	if err := t.Resume(n); err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	return nil
}

// intEntry returns the int64 entry name as an int, or an error wrapping
// ErrInvalid naming it.
func intEntry(op string, entries map[string]any, name string) (int, error) {
	v, ok := entries[name]
	if !ok {
		return 0, fmt.Errorf("%s: %w: no entry %q", op, ErrInvalid, name)
	}
	n, ok := v.(int64)
	if !ok {
		return 0, fmt.Errorf("%s: %w: entry %q is %T, want int64", op, ErrInvalid, name, v)
	}
	return int(n), nil
}
