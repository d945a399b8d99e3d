package comm

import (
	"errors"
	"fmt"
	"strings"
	"time"

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
// it, the operation and its sequence number on the communicator, the label
// the caller gave the operation (WithLabel) and the peer involved when there
// is one (-1 otherwise).
type Error struct {
	Backend string
	// Comm names the communicator when it is not the world one and the
	// backend knows its name ("world/split3.c0"); "" otherwise.
	Comm string
	// Rank is this rank in the communicator; WorldRank is its rank in the
	// world, meaningful only when Comm is set.
	Rank, WorldRank int
	Op              Op
	Seq             uint64
	// Label is the label the caller attached to the operation with
	// WithLabel ("fsdp unit blocks.1 all-gather"), or "".
	Label string
	Peer  int
	Err   error
}

// Error implements error.
func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "loom/comm %s", e.Backend)
	if e.Comm != "" {
		fmt.Fprintf(&b, " %s", e.Comm)
	}
	fmt.Fprintf(&b, ": rank %d", e.Rank)
	if e.Comm != "" && e.WorldRank != e.Rank {
		fmt.Fprintf(&b, " (world rank %d)", e.WorldRank)
	}
	fmt.Fprintf(&b, ": %v #%d", e.Op, e.Seq)
	if e.Label != "" {
		fmt.Fprintf(&b, " [%s]", e.Label)
	}
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

// TimeoutError is the cause of a call that outlived the communicator's
// timeout, from a backend that can tell which ranks kept it waiting (the
// local backend: every member of a collective registers its arrival, so
// a timed-out call looks up who has not arrived and, when such a rank is
// itself blocked in another communicator's call, whom that call waits
// for, down to the ranks that wait for nothing). NCCL and MPI cannot tell:
// their timeouts wrap ErrTimeout without a TimeoutError.
type TimeoutError struct {
	// After is the timeout that expired.
	After time.Duration
	// Late lists, in world ranks and ascending, the ranks found to keep the
	// call waiting without waiting for any other: the ranks to blame. It is
	// empty when every rank has arrived (one is slow inside the call) or
	// when the ranks wait for each other in a cycle.
	Late []int
	// Detail says what the call waited for, in words: "waiting for rank 1,
	// which has not joined this call".
	Detail string
}

// Error implements error.
func (e *TimeoutError) Error() string {
	s := ErrTimeout.Error()
	if e.After > 0 {
		s += " after " + e.After.String()
	}
	if e.Detail != "" {
		s += " " + e.Detail
	}
	return s
}

// Unwrap returns ErrTimeout.
func (e *TimeoutError) Unwrap() error { return ErrTimeout }

// LateRanks returns the world ranks err blames for a timeout (its
// TimeoutError's Late, also through an abort that carries one), or nil.
func LateRanks(err error) []int {
	var te *TimeoutError
	if errors.As(err, &te) {
		return te.Late
	}
	return nil
}
