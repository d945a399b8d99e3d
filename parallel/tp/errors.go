package tp

import "github.com/b7ea7098/loom"

// ErrInvalid is wrapped by errors about arguments or misuse (a rule without
// a style or matching no module, a mesh without the axis, a style that does
// not fit the module it matches, tied parameters laid out two ways, logits
// or targets of the wrong layout); it matches loom.ErrInvalid.
var ErrInvalid = loom.NewSentinel("tp: invalid argument", loom.ErrInvalid)
