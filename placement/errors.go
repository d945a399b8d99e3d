package placement

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: the arguments were rejected before any data moved (a bad
	// shape or placement, a tensor on another mesh, a plan applied to the
	// wrong tensor).
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrMismatch: ranks disagree about something they must agree on (the
	// global shape, dtype or placements of a tensor built from local
	// pieces). Every rank returns it, before any tensor data moves.
	ErrMismatch = loom.NewSentinel("ranks disagree", loom.ErrMismatch)
	// ErrUnsupported: the request is well formed but outside what this
	// package does (redistributing Routed placements, which the moe
	// package's dispatch and combine move; the plan-only backward of
	// Partial(max|min), which ExtremumGrad computes from forward values).
	ErrUnsupported = loom.NewSentinel("unsupported", loom.ErrUnsupported)
)

// invalidf returns an error for operation op that wraps ErrInvalid.
func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("placement: %s: %w: %s", op, ErrInvalid, fmt.Sprintf(format, args...))
}

// unsupportedf returns an error for operation op that wraps ErrUnsupported.
func unsupportedf(op, format string, args ...any) error {
	return fmt.Errorf("placement: %s: %w: %s", op, ErrUnsupported, fmt.Sprintf(format, args...))
}

// mismatchf returns an error for operation op that wraps ErrMismatch.
func mismatchf(op, format string, args ...any) error {
	return fmt.Errorf("placement: %s: %w: %s", op, ErrMismatch, fmt.Sprintf(format, args...))
}

// wrapf returns err for operation op with context, keeping err's chain.
func wrapf(op string, err error, format string, args ...any) error {
	return fmt.Errorf("placement: %s: %s: %w", op, fmt.Sprintf(format, args...), err)
}
