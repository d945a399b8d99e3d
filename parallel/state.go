package parallel

import (
	"fmt"

	"github.com/b7ea7098/loom/placement"
)

// StateDict returns the dropout's random state, the number of forwards
// run in training mode (which with Seed selects the next mask), as the
// int64 entry prefix+"steps", and no tensors: a checkpoint that holds it
// resumes with the masks the uninterrupted run would draw. The checkpoint
// package's Module takes it, under the module's path.
func (d *Dropout) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	return map[string]*placement.DTensor{}, map[string]any{prefix + "steps": int64(d.steps)}, nil
}

// LoadStateDict restores the number of training forwards from the entry
// prefix+"steps". A missing or negative entry, or one of another type, is
// an error wrapping ErrInvalid, and changes nothing.
func (d *Dropout) LoadStateDict(prefix string, entries map[string]any) error {
	n, ok := entries[prefix+"steps"].(int64)
	if !ok || n < 0 {
		return fmt.Errorf("%w: Dropout.LoadStateDict: entry %q is %v (%T), want a count", ErrInvalid, prefix+"steps", entries[prefix+"steps"], entries[prefix+"steps"])
	}
	d.steps = uint64(n)
	return nil
}
