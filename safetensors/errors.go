package safetensors

import (
	"errors"
	"strconv"

	"github.com/b7ea7098/loom"
)

// Sentinel errors. Every error this package returns for bad input is an
// [*Error] that wraps exactly one of them, so callers can test the kind with
// errors.Is.
var (
	// ErrFormat marks a file that breaks the safetensors format.
	ErrFormat = errors.New("invalid safetensors file")
	// ErrChecksum marks tensor data that does not match its stored SHA-256.
	ErrChecksum = errors.New("checksum mismatch")
	// ErrNotFound marks a request for a tensor the file does not hold.
	ErrNotFound = errors.New("no such tensor")
	// ErrInvalid marks a tensor, metadata map or conversion that cannot be
	// written or performed: a bad name, dtype, shape or data length.
	ErrInvalid = loom.NewSentinel("invalid tensor", loom.ErrInvalid)
)

// Error describes one problem with a file, a tensor or a write request.
type Error struct {
	// Path is the file's path when it is known ([Open], [WriteFile]).
	Path string
	// Tensor is the tensor the problem concerns, or "" for the whole file.
	Tensor string
	// Kind is ErrFormat, ErrChecksum, ErrNotFound or ErrInvalid.
	Kind error
	// Msg says what is wrong.
	Msg string
	// Err is the underlying cause (an I/O or JSON error), or nil.
	Err error
}

// Error formats the problem as "safetensors: PATH: tensor "NAME": MSG".
func (e *Error) Error() string {
	s := "safetensors: "
	if e.Path != "" {
		s += e.Path + ": "
	}
	if e.Tensor != "" {
		s += "tensor " + strconv.Quote(e.Tensor) + ": "
	}
	s += e.Msg
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the kind and the underlying cause, so that errors.Is works
// for both.
func (e *Error) Unwrap() []error {
	errs := make([]error, 0, 2)
	if e.Kind != nil {
		errs = append(errs, e.Kind)
	}
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	return errs
}

// withPath returns err with its Path set to path when err is an *Error
// without one.
func withPath(err error, path string) error {
	var e *Error
	if errors.As(err, &e) && e.Path == "" {
		c := *e
		c.Path = path
		return &c
	}
	return err
}

func formatErr(tensor, msg string, cause error) error {
	return &Error{Tensor: tensor, Kind: ErrFormat, Msg: msg, Err: cause}
}

func invalidErr(tensor, msg string) error {
	return &Error{Tensor: tensor, Kind: ErrInvalid, Msg: msg}
}
