package autograd

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is. Errors from the placement
// package (planning, redistribution, collectives) are wrapped unchanged.
var (
	// ErrInvalid: the arguments were rejected before any data moved (a nil
	// value, values from different tapes, mismatched shapes or dtypes, a
	// loss that is not a scalar, a value from a tape pass already cleared).
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrRule: an op's sharding rule rejects its input placements. The
	// message names the mismatch and the placements that would work. It
	// matches loom.ErrInvalid: the op is refused before any data moves.
	ErrRule = loom.NewSentinel("sharding rule", loom.ErrInvalid)
	// ErrGradPlacement: gradients meeting at one value (or a gradient
	// arriving at an op's backward) are laid out so that combining them
	// would need a collective. loom never inserts one the caller did not
	// ask for; the message names both placements.
	ErrGradPlacement = errors.New("gradient placement needs communication")
	// ErrUnsupported: the op is well formed but has no form for its
	// inputs' device or dtype (an op that runs on the host only, float64
	// on a device). It matches loom.ErrUnsupported.
	ErrUnsupported = loom.NewSentinel("unsupported", loom.ErrUnsupported)
)

func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("autograd: %s: %w: %s", op, ErrInvalid, fmt.Sprintf(format, args...))
}

func rulef(op, format string, args ...any) error {
	return fmt.Errorf("autograd: %s: %w: %s", op, ErrRule, fmt.Sprintf(format, args...))
}

func gradPlacementf(op, format string, args ...any) error {
	return fmt.Errorf("autograd: %s: %w: %s", op, ErrGradPlacement, fmt.Sprintf(format, args...))
}

func unsupportedf(op, format string, args ...any) error {
	return fmt.Errorf("autograd: %s: %w: %s", op, ErrUnsupported, fmt.Sprintf(format, args...))
}
