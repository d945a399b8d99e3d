package placement

import (
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// A DTensor's local block lives on a device. On the host (the default) it
// is a []float32 or []float64; on another device (device/emu, CUDA) it is
// a device.Buffer of the spec's dtype, and LocalData returns that buffer.
// The device is recorded on the tensor, not on its Spec: specs and plans
// describe layouts and are shared by tensors on every device.

// Device returns the device that holds the local block: device.Host() for
// a []float32 or []float64 block.
func (t *DTensor) Device() device.Device {
	if b, ok := t.data.(device.Buffer); ok {
		return b.Owner()
	}
	return device.Host()
}

// LocalBuffer returns the local block as a comm.Buffer over the tensor's
// memory (no copy): a *comm.HostBuffer for a host block, the
// device.Buffer otherwise.
func (t *DTensor) LocalBuffer() comm.Buffer {
	switch d := t.data.(type) {
	case []float32:
		return comm.Host(d)
	case []float64:
		return comm.Host(d)
	}
	return t.data.(device.Buffer)
}

// NewLocalOn wraps this rank's block, held in b, as a DTensor without
// copying and without communicating, as NewLocal does for host slices: b
// has the spec's dtype and prod(spec.LocalShape()) elements in row-major
// order. The DTensor takes ownership of b. A buffer of the host device
// becomes a host block (its []float32 or []float64), so host tensors look
// the same however they were made. Errors wrap ErrInvalid (ErrUnsupported
// for Routed placements without row counts).
func NewLocalOn(spec *Spec, b device.Buffer) (*DTensor, error) {
	const op = "NewLocalOn"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if comm.IsNil(b) {
		return nil, invalidf(op, "nil buffer")
	}
	if b.Owner() == nil || b.Owner().Kind() == device.KindHost {
		h := comm.HostView(b)
		if h == nil {
			return nil, invalidf(op, "a host buffer (%T) without a host view", b)
		}
		switch h.DType() {
		case comm.Float32:
			return NewLocal(spec, h.Float32s())
		case comm.Float64:
			return NewLocal(spec, h.Float64s())
		}
		return nil, invalidf(op, "buffer is %v, the spec says %v", h.DType(), spec.l.dtype)
	}
	if spec.l.hasRouted() && spec.l.rows == nil {
		return nil, unsupportedf(op, "a Routed spec without row counts has no local shape (WithRoutedRows; the moe package's dispatch builds Routed tensors)")
	}
	want := spec.LocalShape()
	if b.DType() != spec.l.dtype {
		return nil, invalidf(op, "buffer on %s is %v, the spec says %v", b.Device(), b.DType(), spec.l.dtype)
	}
	if b.Len() != prod(want) {
		return nil, invalidf(op, "buffer on %s has %d elements, local shape %v holds %d", b.Device(), b.Len(), want, prod(want))
	}
	return &DTensor{spec: spec, shape: slices.Clone(want), data: b}, nil
}

// To returns the tensor with its local block on d: t itself when it is
// there already, otherwise a copy (host to device, device to host, or
// through the host between two devices) with the same spec. It is the
// explicit copy for I/O, checkpoints and tests; ops never move data
// between devices. The copy is ordered on the devices' compute streams
// and has completed on the host side when To returns (a copy to the host
// waits for the device's queued work). Errors are the devices'
// (allocation, a closed device), wrapped with context.
func (t *DTensor) To(d device.Device) (*DTensor, error) {
	const op = "To"
	if d == nil {
		d = device.Host()
	}
	src := t.Device()
	if device.Same(op, src, d) == nil {
		return t, nil
	}
	host := t
	if src.Kind() != device.KindHost {
		data, err := hostCopy(op, t.data.(device.Buffer), false)
		if err != nil {
			return nil, err
		}
		host = &DTensor{spec: t.spec, shape: slices.Clone(t.shape), data: data}
	}
	if d.Kind() == device.KindHost {
		return host, nil
	}
	b, err := d.Alloc(t.spec.l.dtype, prod(t.shape))
	if err != nil {
		return nil, wrapf(op, err, "allocating the local block on %s", d.Name())
	}
	if err := d.CopyFromHost(b, host.LocalBuffer().(*comm.HostBuffer)); err != nil {
		_ = b.Free()
		return nil, wrapf(op, err, "copying the local block to %s", d.Name())
	}
	return &DTensor{spec: t.spec, shape: slices.Clone(t.shape), data: b}, nil
}
