package cp

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: the arguments were refused before any data moved: a
	// layout the method cannot take (the sequence not sharded over the cp
	// axis, a sharded head dim, a Partial input), heads that do not divide
	// over cp for Ulysses, an unknown method or a bad option.
	ErrInvalid = loom.NewSentinel("cp: invalid argument", loom.ErrInvalid)
	// ErrUnsupported: the inputs live on a device whose kernels lack
	// block attention (device.BlockAttentionKernels).
	ErrUnsupported = loom.NewSentinel("cp: unsupported", loom.ErrUnsupported)
)

// invalidf returns an error wrapping ErrInvalid, naming op.
func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("%w: %s: %s", ErrInvalid, op, fmt.Sprintf(format, args...))
}
