package fsdp

import "github.com/b7ea7098/loom"

// ErrInvalid is wrapped by errors about arguments or misuse (a bad option, a
// module wrapped twice or after its parent, a pattern that matches no
// module, a parameter holder that is not a ParamSetter, a pooled slot held
// by another unit); it matches loom.ErrInvalid. Ranks that ran different
// units get an error matching loom.ErrMismatch instead.
var ErrInvalid = loom.NewSentinel("fsdp: invalid argument", loom.ErrInvalid)
