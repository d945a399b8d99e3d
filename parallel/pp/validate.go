package pp

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// Validate checks s before anything runs: counts and placement; every
// action names a stage the rank holds and a micro-batch in range; each
// (stage, micro-batch) has one F and either one B or one I followed by
// one W, a backward after its forward; in a lowered schedule every send
// has its receive (same micro-batch, stage pair and direction) and
// crossing stages on different ranks communicate, and a simulation of
// the lists with blocking receives finishes. An error names the rank,
// the position in its list and the action; a deadlock is ErrDeadlock and
// names the action each stuck rank waits at.
func (s *Schedule) Validate() error {
	return fmt.Errorf("%w: validate: not built yet", loom.ErrUnsupported)
}

// Infer returns the schedule of a user's own per-rank action lists: the
// ranks are len(actions), the stages and micro-batches those the actions
// name, the placement loop or V, whichever matches the stages each rank
// holds. The schedule is validated.
func Infer(name string, actions [][]Action) (*Schedule, error) {
	return nil, fmt.Errorf("%w: infer: not built yet", loom.ErrUnsupported)
}
