package parallel

import "github.com/b7ea7098/loom"

// ErrInvalid is wrapped by errors about arguments or misuse of the module
// tree and its layers (a nil module or input, dims that are not positive, a
// pattern that matches no module, parameters of the wrong shape given to a
// ParamSetter); it matches loom.ErrInvalid.
var ErrInvalid = loom.NewSentinel("parallel: invalid argument", loom.ErrInvalid)
