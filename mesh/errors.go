package mesh

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: the arguments of a call were rejected (bad shape, bad or
	// duplicate axis names, coordinates or ranks out of range). Every
	// argument error of this package matches it, unknown axes included.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrUnknownAxis: an axis name is not one of the mesh's axes. Errors
	// that match it also match ErrInvalid.
	ErrUnknownAxis = loom.NewSentinel("unknown axis", loom.ErrInvalid)
)

// invalidf returns an error for operation op that wraps ErrInvalid.
func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("mesh: %s: %w: %s", op, ErrInvalid, fmt.Sprintf(format, args...))
}

// unknownAxisError names an axis that a mesh does not have, and the axes it
// does have.
type unknownAxisError struct {
	op    string
	name  string
	known []string
}

func (e *unknownAxisError) Error() string {
	return fmt.Sprintf("mesh: %s: unknown axis %q (mesh axes: %s)", e.op, e.name, strings.Join(e.known, ", "))
}

// Unwrap returns ErrUnknownAxis and ErrInvalid, so errors.Is matches either.
func (e *unknownAxisError) Unwrap() []error { return []error{ErrUnknownAxis, ErrInvalid} }
