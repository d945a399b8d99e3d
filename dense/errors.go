package dense

import (
	"fmt"

	"github.com/b7ea7098/loom"
)

// ErrInvalid marks a conversion that cannot be performed: a nil, masked or
// empty tensor, a dtype the other side has no equivalent for, or a shape
// that does not match. It matches loom.ErrInvalid.
var ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)

// invalidf returns an error for operation op that wraps ErrInvalid.
func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("dense: %s: %w: %s", op, ErrInvalid, fmt.Sprintf(format, args...))
}
