package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// SetGrad replaces a leaf's accumulated gradient with g (nil drops it, like
// ZeroGrad). It is how data parallelism installs a reduced gradient: DDP
// all-reduces the Partial(sum) gradients backward produced and sets the
// result, laid out Replicate on the data-parallel axis, so that an
// optimizer accepts it. g must have the leaf's global shape, dtype and mesh
// shape; its placements are the caller's statement of what the local block
// means. The leaf takes ownership of g (later Backward calls replace it
// rather than modify it). SetGrad may not be called from a gradient hook
// while Backward is running (the pass is still accumulating). Errors wrap
// ErrInvalid.
func (v *Value) SetGrad(g *placement.DTensor) error {
	const op = "SetGrad"
	if v == nil {
		return invalidf(op, "nil value")
	}
	if !v.leaf || !v.requiresGrad {
		return invalidf(op, "%q is not a leaf that requires grad", v.name)
	}
	if v.tape != nil && v.tape.walking {
		return invalidf(op, "%q: SetGrad called during Backward (from a gradient hook)", v.name)
	}
	if g == nil {
		v.freeOwnedGrad(nil)
		v.grad, v.fresh, v.ownGrad = nil, 0, false
		return nil
	}
	vs, gs := v.data.Spec(), g.Spec()
	if !slices.Equal(vs.Shape(), gs.Shape()) {
		return invalidf(op, "%q: gradient of global shape %v for a value of shape %v", v.name, gs.Shape(), vs.Shape())
	}
	if vs.DType() != gs.DType() {
		return invalidf(op, "%q: gradient of dtype %v for a value of dtype %v", v.name, gs.DType(), vs.DType())
	}
	if !slices.Equal(vs.Mesh().Shape(), gs.Mesh().Shape()) || !slices.Equal(vs.Mesh().Names(), gs.Mesh().Names()) {
		return invalidf(op, "%q: gradient on mesh %v for a value on mesh %v", v.name, gs.Mesh(), vs.Mesh())
	}
	if err := device.Same(op, v.data.Device(), g.Device()); err != nil {
		return fmt.Errorf("autograd: %w (%q's gradient must be on its value's device): %w", err, v.name, ErrInvalid)
	}
	v.freeOwnedGrad(g)
	v.grad, v.fresh, v.ownGrad = g, 0, false
	return nil
}

// freeOwnedGrad frees the leaf's gradient when it is device memory that
// Backward allocated for the leaf (as ZeroGrad does) and not the block of
// next, the gradient that replaces it: device memory has no garbage
// collector, so a dropped gradient would stay allocated.
func (v *Value) freeOwnedGrad(next *placement.DTensor) {
	if v.grad == nil || !v.ownGrad {
		return
	}
	if b := bufOf(v.grad); b != nil && (next == nil || !sharesMemory(b, bufOf(next))) {
		_ = b.Free() // a failure means a closed device, which holds nothing
	}
}

// sharesMemory reports whether c lies in b's memory (a view of it), so
// that freeing b would free c's memory too.
func sharesMemory(b, c device.Buffer) bool {
	if c == nil || c.Owner() != b.Owner() {
		return false
	}
	size := uintptr(b.Len() * b.DType().Size())
	return c.Ptr() >= b.Ptr() && c.Ptr() < b.Ptr()+max(size, 1)
}

// freeOwnedSpare frees the memory kept for the leaf's next gradient when
// it is a device buffer the leaf owns, unless it is keep.
func (v *Value) freeOwnedSpare(keep any) {
	if !v.ownSpare {
		return
	}
	if b, ok := v.spare.(device.Buffer); ok {
		if k, same := keep.(device.Buffer); !same || k != b {
			_ = b.Free() // a failure means a closed device, which holds nothing
		}
	}
}
