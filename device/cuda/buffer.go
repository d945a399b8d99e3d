package cuda

import (
	"fmt"
	"runtime"
	"sync/atomic"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// DeviceBuffer is memory of a CUDA [Device]: a device.Buffer whose
// elements live in device memory, which the host cannot address (it is
// not a comm.HostBacked). Copy it with the device's CopyFromHost and
// CopyToHost. A buffer from Alloc owns its memory, and Free gives it back
// to the allocator; one that is dropped without Free is freed when the
// garbage collector finds it unreachable, as a safety net (the memory
// stays held until then). Slices share the memory of the buffer they come
// from and keep it reachable.
type DeviceBuffer struct {
	dev  *Device
	dt   comm.DType
	ptr  uintptr
	n    int
	own  *owner        // the allocation; nil for a slice
	from *DeviceBuffer // the owning buffer of a slice
}

// owner is an allocation; it must not point back at its buffer, so that
// the buffer's cleanup can run.
type owner struct {
	alloc *device.Allocator
	blk   device.Block
	freed atomic.Bool
}

var _ device.Buffer = (*DeviceBuffer)(nil)

// newBuffer wraps an allocated block as an owning buffer, with the
// cleanup that frees it if it is lost.
func newBuffer(d *Device, dt comm.DType, n int, blk device.Block) *DeviceBuffer {
	b := &DeviceBuffer{dev: d, dt: dt, ptr: blk.Ptr, n: n, own: &owner{alloc: d.alloc, blk: blk}}
	runtime.AddCleanup(b, func(o *owner) {
		// A buffer nobody can free any more: give its memory back. The
		// error has no one to go to (a closed device's allocator is
		// gone anyway).
		if !o.freed.Swap(true) {
			_ = o.alloc.Free(o.blk)
		}
	}, b.own)
	return b
}

// root is the buffer that owns b's memory.
func (b *DeviceBuffer) root() *DeviceBuffer {
	if b.from != nil {
		return b.from
	}
	return b
}

// DType is the element type.
func (b *DeviceBuffer) DType() comm.DType { return b.dt }

// Len is the length in elements.
func (b *DeviceBuffer) Len() int { return b.n }

// Device is the device's name, "cuda:N".
func (b *DeviceBuffer) Device() string { return b.dev.name }

// Owner is the device.
func (b *DeviceBuffer) Owner() device.Device { return b.dev }

// Ptr is the device address of the first element; 0 when empty.
func (b *DeviceBuffer) Ptr() uintptr {
	if b.n == 0 {
		return 0
	}
	return b.ptr
}

// Slice returns elements [lo, hi) as a *DeviceBuffer over the same
// memory; it panics when the bounds are out of range, like a slice
// expression. Its Free is an error: the buffer it came from owns the
// memory.
func (b *DeviceBuffer) Slice(lo, hi int) comm.Buffer {
	if lo < 0 || hi < lo || hi > b.n {
		panic(fmt.Sprintf("cuda: DeviceBuffer.Slice: bounds [%d:%d] out of range with length %d", lo, hi, b.n))
	}
	return &DeviceBuffer{dev: b.dev, dt: b.dt, ptr: b.ptr + uintptr(lo*b.dt.Size()), n: hi - lo, from: b.root()}
}

// Free gives the memory back to the allocator, ordered after the work
// queued on the streams it was used on (Device.RecordStream). Freeing a
// slice, or freeing twice, is an error wrapping device.ErrInvalid.
func (b *DeviceBuffer) Free() error {
	if b.from != nil {
		return fmt.Errorf("%s: Free: %w: a slice does not own its memory; free the buffer it came from", b.dev.name, device.ErrInvalid)
	}
	return b.free()
}

func (b *DeviceBuffer) free() error {
	if b.own.freed.Swap(true) {
		return fmt.Errorf("%s: Free: %w: the buffer was freed already", b.dev.name, device.ErrInvalid)
	}
	if err := b.own.alloc.Free(b.own.blk); err != nil {
		b.own.freed.Store(false)
		return err
	}
	return nil
}

// bytes is the buffer's size in bytes.
func (b *DeviceBuffer) bytes() int { return b.n * b.dt.Size() }

// raw is the buffer as the driver-level Buffer that copies and launches
// take; the null pointer when empty.
func (b *DeviceBuffer) raw() Buffer {
	if b == nil || b.n == 0 {
		return Buffer{}
	}
	return Buffer{Ptr: DevicePtr(b.ptr), Bytes: b.bytes()}
}
