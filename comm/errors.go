package comm

import (
	"errors"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: a call's arguments were rejected before any data moved.
	ErrInvalid = loom.NewSentinel("invalid call", loom.ErrInvalid)
	// ErrTimeout: a blocking call outlived the communicator's timeout.
	ErrTimeout = errors.New("timed out")
	// ErrAborted: the communicator was aborted, by this rank or another.
	ErrAborted = errors.New("communicator aborted")
	// ErrMismatch: ranks issued different collectives at the same sequence number.
	ErrMismatch = loom.NewSentinel("collective mismatch", loom.ErrMismatch)
	// ErrUnsupported: the backend cannot do what was asked (an algorithm that
	// does not apply, device memory on a host backend).
	ErrUnsupported = loom.NewSentinel("unsupported", loom.ErrUnsupported)
)

// Error is the error every blocking call returns: it names the rank that saw
// it, the operation and its sequence number on the communicator, and the peer
// involved when there is one (-1 otherwise).
type Error struct {
	Backend string
	Rank    int
	Op      Op
	Seq     uint64
	Peer    int
	Err     error
}

// Error implements error.
func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "loom/comm %s: rank %d: %v #%d", e.Backend, e.Rank, e.Op, e.Seq)
	if e.Peer >= 0 {
		fmt.Fprintf(&b, " (peer %d)", e.Peer)
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	return b.String()
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// AbortError is the cause carried by every call that fails because the
// communicator was aborted; it names the rank that aborted it and why.
type AbortError struct {
	Rank  int // the rank that aborted, or -1 when not known
	Cause error
}

// Error implements error.
func (e *AbortError) Error() string {
	if e.Rank < 0 {
		return fmt.Sprintf("communicator aborted: %v", e.Cause)
	}
	return fmt.Sprintf("communicator aborted by rank %d: %v", e.Rank, e.Cause)
}

// Unwrap returns both ErrAborted and the cause, so errors.Is matches either.
func (e *AbortError) Unwrap() []error { return []error{ErrAborted, e.Cause} }

// MismatchError reports ranks that issued different collectives at the same
// point of their sequence. Calls[r] is what rank r issued.
type MismatchError struct {
	Calls []Fingerprint
}

// Error implements error; it lists every rank's call, marking those that
// differ from rank 0's.
func (e *MismatchError) Error() string {
	var b strings.Builder
	b.WriteString("ranks issued different collectives:")
	for r, f := range e.Calls {
		mark := ""
		if r > 0 && !f.Matches(e.Calls[0]) {
			mark = "  <- differs from rank 0"
		}
		fmt.Fprintf(&b, "\n  rank %d: %v%s", r, f, mark)
	}
	return b.String()
}

// Unwrap returns ErrMismatch.
func (e *MismatchError) Unwrap() error { return ErrMismatch }
