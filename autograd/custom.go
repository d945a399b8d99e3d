package autograd

import (
	"context"
	"fmt"
	"slices"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// CustomForward computes a Custom op's result. It may communicate (every
// rank runs it at the same point of its forward pass). The result is owned
// by autograd afterwards and must not be modified.
type CustomForward func() (*placement.DTensor, error)

// CustomBackward maps the gradient g of a Custom op's output to one
// gradient per input, in the order of the inputs (nil where an input needs
// none; gradients of inputs that do not require grad are ignored). Each
// gradient must have its input's global shape, dtype and mesh; its
// placements are the author's statement of what the local block means, as
// for every op (a sum of contributions is Partial(sum), the whole value on
// every rank Replicate, a rank's piece Shard or Routed).
//
// g has the output's global shape and mesh, in whatever linear layout the
// downstream ops produced (typically the output's spec, or the output's
// spec with Replicate axes turned Partial(sum)); a backward that cannot
// use the layout it gets should fail with an error wrapping
// ErrGradPlacement rather than communicate behind the caller's back. g
// belongs to autograd: it may be returned (or a view of it) as a gradient,
// but must not be modified or kept after the function returns. The
// gradients returned are owned by autograd afterwards.
//
// The function may communicate. Backward runs it on every rank at the same
// point of the reverse walk, because every rank recorded the same ops; it
// runs at most once per Backward pass, never under NoGrad.
type CustomBackward func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error)

// Custom records an op whose forward and backward the caller computes, and
// which may run collectives in either direction: the general form of the
// ops that move data between ranks in ways no Redistribute plan describes,
// such as the MoE dispatch and combine, which are each other's backward
// through a routing handle. Unlike LocalFunc it checks no placements: the
// author is responsible for every layout, on the output and on every
// gradient (see CustomBackward).
//
// Custom first validates inputs (non-empty, non-nil, one tape, none from a
// tape pass already cleared) and, when the op will be recorded (recording
// is on and some input requires grad), that backward is not nil; only then
// does it run forward. Its result becomes the op's output, on the inputs'
// world. name names the op on the tape, in Observer reports and in errors.
// Like every op, Custom must be called on every rank in the same order.
//
// A custom op runs wherever its inputs are (all on one device, or the op
// fails with device.ErrMixed): on a device other than the host their
// LocalData are device.Buffers, and forward and backward compute with the
// device's Kernels into ResultBuffer and ScratchBuffer (or memory they own
// and free themselves), wrapping results with placement.NewLocalOn.
//
// Errors wrap ErrInvalid (bad arguments, a result on another world, a
// gradient of the wrong shape, dtype or mesh, or the wrong number of
// gradients); errors from forward and backward are returned wrapped with
// name (errors.Is still finds them).
func Custom(name string, inputs []*Value, forward CustomForward, backward CustomBackward) (*Value, error) {
	if name == "" {
		return nil, invalidf("Custom", "the op has no name; errors and the tape name ops by it")
	}
	if len(inputs) == 0 {
		return nil, invalidf(name, "no inputs; a custom op needs at least one to know its tape")
	}
	if forward == nil {
		return nil, invalidf(name, "nil forward function")
	}
	// A custom op runs wherever its inputs are: its functions get their
	// device's blocks (device.Buffer) as LocalData.
	t, err := checkInputsOn(name, true, inputs...)
	if err != nil {
		return nil, err
	}
	recorded := t.recording() && slices.ContainsFunc(inputs, (*Value).RequiresGrad)
	if recorded && backward == nil {
		return nil, invalidf(name, "nil backward function, but an input requires grad and recording is on")
	}
	out, err := forward()
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: forward: %w", name, err)
	}
	if out == nil {
		return nil, invalidf(name, "forward returned a nil tensor and no error")
	}
	if out.Spec().Mesh().World() != inputs[0].Spec().Mesh().World() {
		return nil, invalidf(name, "forward returned a tensor on mesh %v, built on another world communicator than the inputs' mesh %v", out.Spec().Mesh(), inputs[0].Spec().Mesh())
	}
	ins := slices.Clone(inputs)
	back := func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		grads, err := backward(ctx, g)
		if err != nil {
			return nil, fmt.Errorf("autograd: %s: backward: %w", name, err)
		}
		if len(grads) != len(ins) {
			return nil, invalidf(name, "backward returned %d gradients for %d inputs", len(grads), len(ins))
		}
		for i, gi := range grads {
			if gi == nil {
				continue
			}
			if !ins[i].requiresGrad {
				grads[i] = nil
				continue
			}
			if err := checkCustomGrad(name, i, ins[i], gi); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}
	return t.record(name, out, ins, back), nil
}

// checkCustomGrad checks that gradient g of input i matches the input's
// global shape, dtype and mesh.
func checkCustomGrad(name string, i int, in *Value, g *placement.DTensor) error {
	vs, gs := in.Spec(), g.Spec()
	what := fmt.Sprintf("the gradient of input %d (%q)", i, in.name)
	if !slices.Equal(vs.Shape(), gs.Shape()) {
		return invalidf(name, "%s has global shape %v; the input's is %v", what, gs.Shape(), vs.Shape())
	}
	if vs.DType() != gs.DType() {
		return invalidf(name, "%s is %v; the input is %v", what, gs.DType(), vs.DType())
	}
	if err := sameMeshes(name+" "+what, vs, gs); err != nil {
		return err
	}
	return nil
}

// ResultBlock returns n elements for the local block of an op's result on
// tape t, for a Custom forward that writes every element: freshly
// allocated (zeroed) memory or, on a tape made WithRecycling, memory the
// tape recycles, with arbitrary contents, that lives until the tape's next
// Recycle. A nil t gives fresh memory. The result is never nil; n <= 0
// gives an empty block.
func ResultBlock[T kernels.Float](t *Tape, n int) []T { return blockAs[T](t.result(), n) }

// ScratchBlock returns n elements of t's arena, with arbitrary contents,
// for a gradient a CustomBackward returns or for what a Custom op keeps
// for its backward: Backward gives a gradient's memory back once it has
// consumed it, and everything when the tape is cleared, for the next pass
// to reuse. A nil t gives fresh memory. The result is never nil; n <= 0
// gives an empty block.
func ScratchBlock[T kernels.Float](t *Tape, n int) []T { return blockAs[T](t.scratch(), n) }

// ResultBuffer is ResultBlock on device d: n elements of dtype dt for the
// local block of a Custom op's result, with arbitrary contents (device
// memory is never zeroed). On a tape made WithRecycling the tape frees it
// at its next Recycle; otherwise the caller owns it (Buffer.Free). Errors
// are d's (an invalid dtype or n, out of memory), wrapped.
func ResultBuffer(t *Tape, d device.Device, dt comm.DType, n int) (device.Buffer, error) {
	return devBlock(t.result(), d, dt, n)
}

// ScratchBuffer is ScratchBlock on device d: n elements of dtype dt of
// t's device scratch, with arbitrary contents, freed once Backward has
// consumed it as a gradient or when the tape is cleared. A nil t gives
// memory the caller owns. Errors are d's, wrapped.
func ScratchBuffer(t *Tape, d device.Device, dt comm.DType, n int) (device.Buffer, error) {
	return devBlock(t.scratch(), d, dt, n)
}

// blockAs is block for any kernels.Float: the arena keeps float32 and
// float64 blocks, which a type with either underlying type shares.
func blockAs[T kernels.Float](a alloc, n int) []T {
	if n <= 0 {
		return []T{} // never nil, like make's; no panic for n < 0
	}
	var z T
	if unsafe.Sizeof(z) == 4 {
		b := block[float32](a, n)
		return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b))
	}
	b := block[float64](a, n)
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(b))), len(b))
}
