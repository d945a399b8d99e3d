// Package optim holds optimizers that update autograd leaves in place, one
// local block at a time: on every rank each parameter's local block is
// updated from the matching local block of its gradient, so the same code
// serves replicated parameters (every rank updates its full copy) and
// sharded ones (FSDP: every rank updates its shard). No optimizer
// communicates; gradients must already be reduced (not Partial). The
// optimizers are AdamW and SGD, with PyTorch 1.13's semantics and
// defaults: required arguments are positional (the parameters, and SGD's
// learning rate, which torch.optim.SGD requires too), everything else is
// an Option. ClipGradNorm, global gradient-norm clipping, is the one
// function here that communicates: one all-reduce of a scalar per set of
// mesh axes that shard gradients.
//
// Parameters may live on a device (placement.DTensor.Device): each is
// updated by its device's Kernels from a gradient on the same device,
// with its optimizer state allocated there at its first update and freed
// by the optimizer's Close, and the results are those of the host path.
//
// Arguments rejected before anything changed (a bad parameter list,
// invalid hyper-parameters, an option the optimizer does not take, a
// parameter without a gradient when WithAllowFrozen is not given, a gradient
// laid out unlike its parameter) wrap ErrInvalid.
package optim

import "github.com/b7ea7098/loom"

var (
	// ErrInvalid marks arguments rejected before any parameter or
	// gradient changed; errors.Is(err, loom.ErrInvalid) matches it too.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrNonfinite is ClipGradNorm's error (with WithErrorIfNonfinite) for a
	// total gradient norm that is NaN or infinite; no gradient was scaled.
	ErrNonfinite = loom.NewSentinel("non-finite gradient norm")
)
