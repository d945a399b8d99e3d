// Package loom is a parallel-training layer for Go: a program describes its
// devices as a DeviceMesh with named axes (package mesh) and every tensor by
// a placement on it (package placement), writes its model once in global
// terms (packages autograd, parallel, moe, models), and loom turns each
// change of placement into collectives (package comm and its backends).
// The design is in docs/design.md.
//
// This package holds what every other package shares: the error kinds.
// Each package has sentinels of its own (comm.ErrInvalid,
// placement.ErrInvalid, ...), whose texts name the package's view of the
// problem; every one of them also matches the kind here, so one test finds
// the kind of any loom error:
//
//	if errors.Is(err, loom.ErrInvalid) { // rejected before any data moved
//		...
//	}
package loom

import "errors"

// Error kinds that every package's sentinels of that kind match with
// errors.Is.
var (
	// ErrInvalid: arguments were rejected before any data moved (bad
	// shapes, counts, names, placements or options).
	ErrInvalid = errors.New("invalid argument")
	// ErrMismatch: ranks disagree about something they must agree on (the
	// collective they issue, a tensor's spec, a list of parameters).
	ErrMismatch = errors.New("ranks disagree")
	// ErrUnsupported: the request is well formed but outside what the
	// package or backend does.
	ErrUnsupported = errors.New("unsupported")
)

// NewSentinel returns a package's own sentinel error with the given text;
// errors.Is matches it with itself and with each of kinds (ErrInvalid,
// ErrMismatch, ErrUnsupported).
func NewSentinel(text string, kinds ...error) error {
	return &sentinel{text: text, kinds: kinds}
}

type sentinel struct {
	text  string
	kinds []error
}

func (e *sentinel) Error() string { return e.text }

// Is reports whether target is one of the sentinel's kinds.
func (e *sentinel) Is(target error) bool {
	for _, k := range e.kinds {
		if target == k {
			return true
		}
	}
	return false
}
