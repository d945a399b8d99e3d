package cp

import (
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// ops is where one call's blocks live and its kernels run: host slices
// (hostOps) or a device's buffers (devOps). The methods are written once
// on comm.Buffers over it.
type ops interface {
	// alloc returns n zeroed elements for the call's own use.
	alloc(n int) (comm.Buffer, error)
	// result returns n elements, arbitrary contents, for the op's result.
	result(n int) (comm.Buffer, error)
	fill(b comm.Buffer, v float64) error
	// copy copies src into dst, of the same length.
	copy(dst, src comm.Buffer) error
	forward(out, lse, q, k, v comm.Buffer, s kernels.BlockAttnShape) error
	merge(out, lse, o2, l2 comm.Buffer, dv int) error
	rowDots(delta, dout, out comm.Buffer, dv int) error
	backward(dq, dk, dv, dout, q, k, v, lse, delta comm.Buffer, s kernels.BlockAttnShape) error
	// sync waits for the queued kernels before a transfer touches
	// their blocks.
	sync() error
	// wrap makes a result or gradient DTensor of b.
	wrap(spec *placement.Spec, b comm.Buffer) (*placement.DTensor, error)
}

// hostOps runs the kernels on host slices of T, their GEMMs on the tape's
// BLAS (b) and their tiles on up to w goroutines.
type hostOps[T float] struct {
	b *kernels.BLAS
	w kernels.Workers
}

// view is b's elements as []T (b is a host buffer of T).
func view[T float](b comm.Buffer) []T {
	if comm.IsNil(b) {
		return nil
	}
	h := comm.HostView(b)
	var z T
	if _, ok := any(z).(float32); ok {
		return any(h.Float32s()).([]T)
	}
	return any(h.Float64s()).([]T)
}

func (hostOps[T]) alloc(n int) (comm.Buffer, error)  { return comm.Host(make([]T, n)), nil }
func (hostOps[T]) result(n int) (comm.Buffer, error) { return comm.Host(make([]T, n)), nil }
func (hostOps[T]) fill(b comm.Buffer, v float64) error {
	kernels.Fill(view[T](b), T(v))
	return nil
}
func (hostOps[T]) copy(dst, src comm.Buffer) error {
	copy(view[T](dst), view[T](src))
	return nil
}
func (o hostOps[T]) forward(out, lse, q, k, v comm.Buffer, s kernels.BlockAttnShape) error {
	return kernels.BlockAttentionForward(o.b, o.w, view[T](out), view[T](lse), view[T](q), view[T](k), view[T](v), s)
}
func (hostOps[T]) merge(out, lse, o2, l2 comm.Buffer, dv int) error {
	return kernels.MergeAttention(view[T](out), view[T](lse), view[T](o2), view[T](l2), dv)
}
func (hostOps[T]) rowDots(delta, dout, out comm.Buffer, dv int) error {
	return kernels.AttentionRowDots(view[T](delta), view[T](dout), view[T](out), dv)
}
func (o hostOps[T]) backward(dq, dk, dv, dout, q, k, v, lse, delta comm.Buffer, s kernels.BlockAttnShape) error {
	return kernels.BlockAttentionBackward(o.b, o.w, view[T](dq), view[T](dk), view[T](dv), view[T](dout), view[T](q), view[T](k), view[T](v), view[T](lse), view[T](delta), s)
}
func (hostOps[T]) sync() error { return nil }
func (hostOps[T]) wrap(spec *placement.Spec, b comm.Buffer) (*placement.DTensor, error) {
	return placement.NewLocal(spec, view[T](b))
}

// devOps runs the kernels on a device that has BlockAttentionKernels,
// with the call's blocks in its tape's device scratch.
type devOps struct {
	d    device.Device
	k    device.BlockAttentionKernels
	base device.Kernels
	t    *autograd.Tape
	dt   comm.DType
}

// newDevOps returns the ops of device d, or an error wrapping
// ErrUnsupported naming it when its kernels lack block attention.
func newDevOps(d device.Device, t *autograd.Tape, dt comm.DType) (devOps, error) {
	base := d.Kernels()
	k, ok := base.(device.BlockAttentionKernels)
	if !ok {
		return devOps{}, fmt.Errorf("%w: Attention: device %s has no block attention kernels (device.BlockAttentionKernels: BlockAttention, MergeAttention, AttentionRowDots, BlockAttentionBackward)", ErrUnsupported, d.Name())
	}
	return devOps{d: d, k: k, base: base, t: t, dt: dt}, nil
}

// dev is b as a device buffer (nil for none).
func dev(b comm.Buffer) device.Buffer {
	if comm.IsNil(b) {
		return nil
	}
	return b.(device.Buffer)
}

func (o devOps) alloc(n int) (comm.Buffer, error) {
	b, err := autograd.ScratchBuffer(o.t, o.d, o.dt, n)
	if err != nil {
		return nil, err
	}
	return b, o.base.Fill(b, 0)
}
func (o devOps) result(n int) (comm.Buffer, error)   { return autograd.ResultBuffer(o.t, o.d, o.dt, n) }
func (o devOps) fill(b comm.Buffer, v float64) error { return o.base.Fill(dev(b), v) }
func (o devOps) copy(dst, src comm.Buffer) error {
	if dst.Len() == 0 {
		return nil
	}
	return o.d.Copy(dev(dst), dev(src))
}
func (o devOps) forward(out, lse, q, k, v comm.Buffer, s kernels.BlockAttnShape) error {
	return o.k.BlockAttention(dev(out), dev(lse), dev(q), dev(k), dev(v), s)
}
func (o devOps) merge(out, lse, o2, l2 comm.Buffer, dv int) error {
	return o.k.MergeAttention(dev(out), dev(lse), dev(o2), dev(l2), dv)
}
func (o devOps) rowDots(delta, dout, out comm.Buffer, dv int) error {
	return o.k.AttentionRowDots(dev(delta), dev(dout), dev(out), dv)
}
func (o devOps) backward(dq, dk, dv, dout, q, k, v, lse, delta comm.Buffer, s kernels.BlockAttnShape) error {
	return o.k.BlockAttentionBackward(dev(dq), dev(dk), dev(dv), dev(dout), dev(q), dev(k), dev(v), dev(lse), dev(delta), s)
}
func (o devOps) sync() error { return o.d.Compute().Synchronize() }
func (o devOps) wrap(spec *placement.Spec, b comm.Buffer) (*placement.DTensor, error) {
	return placement.NewLocalOn(spec, dev(b))
}
