package rendezvous

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/b7ea7098/loom"
)

// Sentinel causes; test for them with errors.Is.
var (
	// ErrTimeout: a call outlived its time limit (the client timeout, the
	// context's deadline, or the deadline it carried to the server). Errors
	// that match ErrTimeout also match context.DeadlineExceeded.
	ErrTimeout = errors.New("timed out")
	// ErrConnLost: the connection to the server broke (the server closed,
	// crashed or became unreachable) while the call was pending or before it.
	ErrConnLost = errors.New("connection to rendezvous server lost")
	// ErrClosed: the Client was closed.
	ErrClosed = errors.New("client closed")
	// ErrFrameTooLarge: a frame exceeded the maximum frame size.
	ErrFrameTooLarge = errors.New("frame too large")
	// ErrProtocol: a peer sent bytes that do not follow the protocol.
	ErrProtocol = errors.New("protocol error")
	// ErrInvalid: a call's arguments were rejected before anything was sent.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
)

// Error is the error every Client call returns. It names the operation,
// the key (or keys) and the server address.
type Error struct {
	Op   string // "get", "set", "wait", "add", "delete", "barrier", "dial"
	Key  string // the key; for wait, the keys joined by ","; empty for dial
	Addr string // the server address
	Err  error  // the cause
}

// Error implements error.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("rendezvous ")
	b.WriteString(e.Op)
	if e.Key != "" {
		fmt.Fprintf(&b, " %q", e.Key)
	}
	fmt.Fprintf(&b, " (server %s): %v", e.Addr, e.Err)
	return b.String()
}

// Unwrap returns the cause.
func (e *Error) Unwrap() error { return e.Err }

// ServerError is an error the server reported for a request.
type ServerError struct {
	Msg string
}

// Error implements error.
func (e *ServerError) Error() string { return "server: " + e.Msg }

// timeoutError is the cause of a call that ran out of time.
type timeoutError struct {
	what string
}

func (e *timeoutError) Error() string { return "timed out (" + e.what + ")" }

// Is makes a timeout match both ErrTimeout and context.DeadlineExceeded.
func (e *timeoutError) Is(target error) bool {
	return target == ErrTimeout || target == context.DeadlineExceeded
}

func clientTimeout(d time.Duration) error {
	return &timeoutError{what: fmt.Sprintf("client timeout %v", d)}
}

// ctxError turns a done context into the cause a call reports.
func ctxError(ctx context.Context) error {
	cause := context.Cause(ctx)
	if cause == nil {
		cause = ctx.Err()
	}
	if errors.Is(cause, ErrTimeout) {
		return cause
	}
	if errors.Is(cause, context.DeadlineExceeded) {
		return &timeoutError{what: "context deadline exceeded"}
	}
	return cause
}
