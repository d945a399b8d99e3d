package checkpoint

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: the arguments were refused before any file was written
	// or any tensor built: a bad option, a Partial or Routed tensor, an
	// entry of an unsupported type, a checkpoint of another model (missing
	// or extra tensors, other shapes or dtypes), a step that exists.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrMismatch: ranks disagree about what they save (a tensor's layout,
	// the entries, the step). Every rank returns it before any data moves.
	ErrMismatch = loom.NewSentinel("ranks disagree", loom.ErrMismatch)
	// ErrCorrupt: a checkpoint's files are damaged: a manifest that does
	// not parse or whose checksum fails, a truncated data file, a chunk
	// whose checksum fails (the error names the file and the tensor).
	ErrCorrupt = loom.NewSentinel("damaged checkpoint")
	// ErrLocked: another writer holds the checkpoint folder's lock; the
	// error names the holder as it recorded itself.
	ErrLocked = loom.NewSentinel("checkpoint folder locked by another writer")
	// ErrNotFound: the folder holds no complete checkpoint.
	ErrNotFound = loom.NewSentinel("no complete checkpoint")
)

// kinds lists the sentinels in the order of their one-byte codes, which
// carry an error's kind to the other ranks (see exchange).
var kinds = []struct {
	code byte
	err  error
}{
	{'I', ErrInvalid}, {'M', ErrMismatch}, {'C', ErrCorrupt}, {'L', ErrLocked}, {'N', ErrNotFound},
}

// kindCode returns the code of err's kind, 'E' for any other error.
func kindCode(err error) byte {
	for _, k := range kinds {
		if errors.Is(err, k.err) {
			return k.code
		}
	}
	return 'E'
}

// kindOf returns the sentinel of code, or nil for 'E'.
func kindOf(code byte) error {
	for _, k := range kinds {
		if k.code == code {
			return k.err
		}
	}
	return nil
}

func invalidf(op, format string, args ...any) error {
	return fmt.Errorf("checkpoint: %s: %w: %s", op, ErrInvalid, fmt.Sprintf(format, args...))
}

func mismatchf(op, format string, args ...any) error {
	return fmt.Errorf("checkpoint: %s: %w: %s", op, ErrMismatch, fmt.Sprintf(format, args...))
}

func corruptf(op, format string, args ...any) error {
	return fmt.Errorf("checkpoint: %s: %w: %s", op, ErrCorrupt, fmt.Sprintf(format, args...))
}

// wrapf returns err for op with context, keeping err's chain.
func wrapf(op string, err error, format string, args ...any) error {
	return fmt.Errorf("checkpoint: %s: %s: %w", op, fmt.Sprintf(format, args...), err)
}
