package pp

import "github.com/b7ea7098/loom"

// ErrMismatch: a tensor received from another stage does not fit this
// stage (a header of another number of mesh axes, an unknown dtype or
// placement, a local length its spec does not give), or a stage's output
// is not what the schedule needs (a last stage whose output is not a
// scalar loss).
var ErrMismatch = loom.NewSentinel("pp: mismatch", loom.ErrMismatch)
