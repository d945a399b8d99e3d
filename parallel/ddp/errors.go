package ddp

import "github.com/b7ea7098/loom"

// ErrInvalid is wrapped by errors about arguments or misuse (a parameter
// that is not a leaf, not Replicate on the dp axis, a gradient laid out in
// a way DDP cannot reduce, Finish inside NoSync); it matches
// loom.ErrInvalid. Ranks that disagree on the parameter list get an error
// matching loom.ErrMismatch instead.
var ErrInvalid = loom.NewSentinel("ddp: invalid argument", loom.ErrInvalid)
