package nccl

import (
	"errors"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/dynlib"
)

// ErrUnavailable is matched (errors.Is) by every error that means NCCL or
// CUDA cannot be used on this machine: a library is missing or lacks
// entry points, the NCCL is too old, the platform has no loader, or the
// driver finds no device. Tests skip on it.
var ErrUnavailable = errors.New("nccl: NCCL/CUDA not available")

// Result is an ncclResult_t. It implements error, so a call's failure can
// be tested with errors.Is(err, nccl.RemoteError).
type Result int32

// The values of ncclResult_t (nccl.h). Timeout exists from NCCL 2.30.3.
const (
	Success            Result = 0
	UnhandledCudaError Result = 1
	SystemError        Result = 2
	InternalError      Result = 3
	InvalidArgument    Result = 4
	InvalidUsage       Result = 5
	RemoteError        Result = 6
	InProgress         Result = 7
	Timeout            Result = 8
)

var resultNames = map[Result]string{
	Success:            "ncclSuccess",
	UnhandledCudaError: "ncclUnhandledCudaError",
	SystemError:        "ncclSystemError",
	InternalError:      "ncclInternalError",
	InvalidArgument:    "ncclInvalidArgument",
	InvalidUsage:       "ncclInvalidUsage",
	RemoteError:        "ncclRemoteError",
	InProgress:         "ncclInProgress",
	Timeout:            "ncclTimeout",
}

// String returns the C name of the result ("ncclRemoteError"), or
// "ncclResult(N)" for a value this package does not know.
func (r Result) String() string {
	if s, ok := resultNames[r]; ok {
		return s
	}
	return fmt.Sprintf("ncclResult(%d)", int32(r))
}

// Error implements error with the C name.
func (r Result) Error() string { return r.String() }

// NCCLError is a failed NCCL call: which call, its result, NCCL's
// description of the result (ncclGetErrorString) and, when the library
// has one, the text of ncclGetLastError, which names the cause.
//
// It matches (errors.Is) its Result, and comm.ErrInvalid for
// ncclInvalidArgument and ncclInvalidUsage, comm.ErrTimeout for
// ncclTimeout.
type NCCLError struct {
	Call   string // "ncclAllReduce", "ncclCommGetAsyncError", ...
	Code   Result
	Msg    string // ncclGetErrorString
	Detail string // ncclGetLastError, "" when empty or unavailable
}

// Error implements error.
func (e *NCCLError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %v", e.Call, e.Code)
	if e.Msg != "" {
		fmt.Fprintf(&b, " (%s)", e.Msg)
	}
	if e.Detail != "" {
		fmt.Fprintf(&b, ": %s", e.Detail)
	}
	return b.String()
}

// Unwrap returns the Result and the comm sentinel it maps to, if any.
func (e *NCCLError) Unwrap() []error {
	out := []error{e.Code}
	switch e.Code {
	case InvalidArgument, InvalidUsage:
		out = append(out, comm.ErrInvalid)
	case Timeout:
		out = append(out, comm.ErrTimeout)
	}
	return out
}

// Attempt is one library Load tried.
type Attempt struct {
	Library string // "nccl" or "cuda"
	Name    string // the soname or path given to dlopen
	Err     error  // why it was rejected; nil for the one kept
}

// String formats the attempt as "cuda libcuda.so.1: ok" or with the reason.
func (a Attempt) String() string { return dynlib.Attempt(a).String() }

// LoadError is returned by Load when a library cannot be used. Tried lists
// every candidate and why it failed. It matches ErrUnavailable, and the
// underlying driver error when cuInit failed.
type LoadError struct {
	Library string // "nccl" or "cuda"
	Reason  string
	// Env is the environment variable that points to another copy of the
	// library (LOOM_NCCL, LOOM_CUDA_DRIVER), when one would help.
	Env   string
	Tried []Attempt
	Err   error // an underlying error (cuInit's), or nil
}

// Error implements error.
func (e *LoadError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "nccl: %s: %s", e.Library, e.Reason)
	if e.Env != "" {
		fmt.Fprintf(&b, "; set %s to the path of another copy", e.Env)
	}
	for _, a := range e.Tried {
		fmt.Fprintf(&b, "\n\t%v", a)
	}
	if e.Err != nil {
		fmt.Fprintf(&b, "\n\t%v", e.Err)
	}
	return b.String()
}

// Unwrap returns ErrUnavailable and the underlying error.
func (e *LoadError) Unwrap() []error {
	if e.Err != nil {
		return []error{ErrUnavailable, e.Err}
	}
	return []error{ErrUnavailable}
}
