package nccl

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
)

// CUDA flag values (cuda.h).
const (
	streamNonBlocking   = 1 // CU_STREAM_NON_BLOCKING
	eventDisableTiming  = 2 // CU_EVENT_DISABLE_TIMING
	cudaErrorNotReady   = int32(CUDANotReady)
	cudaErrorInvalidVal = int32(CUDAInvalidValue)
)

// Device is one CUDA device with its primary context retained
// (cuDevicePrimaryCtxRetain), the context NCCL's runtime uses too. Every
// driver and NCCL call this package makes for the device runs on an OS
// thread locked for the call with that context made current
// (cuCtxSetCurrent), since CUDA contexts are per thread. A Device is safe
// for concurrent use. Close it after every buffer, stream, event and
// communicator on it.
type Device struct {
	lib     *Library
	ordinal int
	dev     int32
	ctx     uintptr
	closed  atomic.Bool
	once    sync.Once
}

// OpenDevice retains the primary context of the device with the given
// ordinal (0-based, as CUDA numbers them under CUDA_VISIBLE_DEVICES).
func (l *Library) OpenDevice(ordinal int) (*Device, error) {
	if ordinal < 0 || ordinal > 1<<30 {
		return nil, fmt.Errorf("nccl: %w: device ordinal %d", comm.ErrInvalid, ordinal)
	}
	d := &Device{lib: l, ordinal: ordinal}
	if rc := l.cu.deviceGet(&d.dev, int32(ordinal)); rc != 0 {
		return nil, fmt.Errorf("nccl: device %d: %w", ordinal, l.cudaError("cuDeviceGet", rc))
	}
	if rc := l.cu.devicePrimaryCtxRetain(&d.ctx, d.dev); rc != 0 {
		return nil, fmt.Errorf("nccl: device %d: %w", ordinal, l.cudaError("cuDevicePrimaryCtxRetain", rc))
	}
	return d, nil
}

// Library returns the library the device was opened with.
func (d *Device) Library() *Library { return d.lib }

// Ordinal returns the device's CUDA ordinal.
func (d *Device) Ordinal() int { return d.ordinal }

// Name returns "cuda:N", the Device() string of its buffers.
func (d *Device) Name() string { return fmt.Sprintf("cuda:%d", d.ordinal) }

// PCIBusID returns the device's PCI address as the driver reports it
// (cuDeviceGetPCIBusId), "domain:bus:device.function" in hex, for matching
// CUDA ordinals with NVML's devices (comm/nccl/topology). It fails with
// comm.ErrUnsupported when the driver lacks the entry point.
func (d *Device) PCIBusID() (string, error) {
	if d.lib.cu.deviceGetPCIBusID == nil {
		return "", fmt.Errorf("nccl: %w: the CUDA driver has no cuDeviceGetPCIBusId", comm.ErrUnsupported)
	}
	buf := make([]byte, 64)
	if rc := d.lib.cu.deviceGetPCIBusID(&buf[0], int32(len(buf)), d.dev); rc != 0 {
		return "", fmt.Errorf("nccl: %s: %w", d.Name(), d.lib.cudaError("cuDeviceGetPCIBusId", rc))
	}
	if i := bytes.IndexByte(buf, 0); i >= 0 {
		buf = buf[:i]
	}
	return string(buf), nil
}

// Close releases the primary context (cuDevicePrimaryCtxRelease_v2). Later
// calls on the device fail. Close is idempotent.
func (d *Device) Close() error {
	var err error
	d.once.Do(func() {
		d.closed.Store(true)
		if rc := d.lib.cu.devicePrimaryCtxRelease(d.dev); rc != 0 {
			err = fmt.Errorf("nccl: %s: %w", d.Name(), d.lib.cudaError("cuDevicePrimaryCtxRelease_v2", rc))
		}
	})
	return err
}

// run calls f on a locked OS thread with the device's context current.
func (d *Device) run(f func() error) error {
	if d.closed.Load() {
		return fmt.Errorf("nccl: %s: %w: device closed", d.Name(), comm.ErrInvalid)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if rc := d.lib.cu.ctxSetCurrent(d.ctx); rc != 0 {
		return fmt.Errorf("nccl: %s: %w", d.Name(), d.lib.cudaError("cuCtxSetCurrent", rc))
	}
	return f()
}

// cuda runs one driver call with the context current and wraps a failure.
func (d *Device) cuda(call string, f func() int32) error {
	return d.run(func() error {
		if rc := f(); rc != 0 {
			return fmt.Errorf("nccl: %s: %w", d.Name(), d.lib.cudaError(call, rc))
		}
		return nil
	})
}

// Synchronize waits for all work on the device (cuCtxSynchronize).
func (d *Device) Synchronize() error {
	return d.cuda("cuCtxSynchronize", d.lib.cu.ctxSynchronize)
}

// allocation is one cuMemAlloc_v2 block, shared by a buffer's slices.
type allocation struct {
	ptr   uintptr
	bytes int
	freed atomic.Bool
}

// DeviceBuffer is a typed span of device memory on one Device. It
// implements comm.Buffer, so the NCCL communicator takes it (and host
// buffers) in the same calls. Slices share the allocation; the buffer
// returned by Alloc owns it and frees it with Free.
type DeviceBuffer struct {
	dev   *Device
	dtype comm.DType
	ptr   uintptr
	n     int
	alloc *allocation
	owner bool
}

var _ comm.Buffer = (*DeviceBuffer)(nil)

// Alloc allocates n elements of type dt (cuMemAlloc_v2). The memory is not
// initialised. A zero-length buffer allocates nothing and has address 0.
func (d *Device) Alloc(dt comm.DType, n int) (*DeviceBuffer, error) {
	if !dt.Valid() {
		return nil, fmt.Errorf("nccl: %w: invalid dtype %v", comm.ErrInvalid, dt)
	}
	size, ok := checked.Mul(n, dt.Size())
	if n < 0 || !ok {
		return nil, fmt.Errorf("nccl: Alloc: %w: buffer length %d of %v (%d bytes an element)", comm.ErrInvalid, n, dt, dt.Size())
	}
	b := &DeviceBuffer{dev: d, dtype: dt, n: n, owner: true}
	if n == 0 {
		return b, nil
	}
	a := &allocation{bytes: size}
	if err := d.cuda("cuMemAlloc_v2", func() int32 { return d.lib.cu.memAlloc(&a.ptr, uintptr(a.bytes)) }); err != nil {
		return nil, fmt.Errorf("%w (allocating %d bytes)", err, a.bytes)
	}
	b.ptr, b.alloc = a.ptr, a
	return b, nil
}

// Upload allocates a buffer like src and copies src into it.
func (d *Device) Upload(src *comm.HostBuffer) (*DeviceBuffer, error) {
	if src == nil {
		return nil, fmt.Errorf("nccl: %w: nil host buffer", comm.ErrInvalid)
	}
	b, err := d.Alloc(src.DType(), src.Len())
	if err != nil {
		return nil, err
	}
	if err := b.CopyFromHost(src); err != nil {
		return nil, errors.Join(err, b.Free())
	}
	return b, nil
}

// DType implements comm.Buffer.
func (b *DeviceBuffer) DType() comm.DType {
	if b == nil {
		return 0
	}
	return b.dtype
}

// Len implements comm.Buffer: the length in elements (0 for a nil buffer).
func (b *DeviceBuffer) Len() int {
	if b == nil {
		return 0
	}
	return b.n
}

// Device implements comm.Buffer: "cuda:N".
func (b *DeviceBuffer) Device() string {
	if b == nil || b.dev == nil {
		return "cuda:?"
	}
	return b.dev.Name()
}

// Slice implements comm.Buffer: elements [lo, hi) over the same memory.
// It panics if the bounds are out of range, like a Go slice expression.
func (b *DeviceBuffer) Slice(lo, hi int) comm.Buffer { return b.SliceDevice(lo, hi) }

// SliceDevice is Slice with a concrete result type.
func (b *DeviceBuffer) SliceDevice(lo, hi int) *DeviceBuffer {
	if lo < 0 || hi < lo || hi > b.n {
		panic(fmt.Sprintf("nccl: slice bounds [%d:%d] out of range for a buffer of %d elements", lo, hi, b.n))
	}
	return &DeviceBuffer{dev: b.dev, dtype: b.dtype, ptr: b.ptr + uintptr(lo*b.dtype.Size()), n: hi - lo, alloc: b.alloc}
}

// Ptr returns the device address of the first element (a CUdeviceptr), 0
// for an empty buffer.
func (b *DeviceBuffer) Ptr() uintptr {
	if b == nil || b.n == 0 {
		return 0
	}
	return b.ptr
}

// Bytes returns the length in bytes.
func (b *DeviceBuffer) Bytes() int { return b.Len() * b.dtype.Size() }

// Owner returns the device the memory is on.
func (b *DeviceBuffer) Owner() *Device { return b.dev }

// Free releases the memory (cuMemFree_v2). Only the buffer Alloc returned
// may free it; slices of it become invalid. Free is idempotent.
func (b *DeviceBuffer) Free() error {
	if b == nil || b.alloc == nil {
		return nil
	}
	if !b.owner {
		return fmt.Errorf("nccl: %w: Free of a slice; free the buffer Alloc returned", comm.ErrInvalid)
	}
	if b.alloc.freed.Swap(true) {
		return nil
	}
	d := b.dev
	return d.cuda("cuMemFree_v2", func() int32 { return d.lib.cu.memFree(b.alloc.ptr) })
}

func (b *DeviceBuffer) check(h *comm.HostBuffer, what string) error {
	if h == nil {
		return fmt.Errorf("nccl: %w: %s: nil host buffer", comm.ErrInvalid, what)
	}
	if h.DType() != b.dtype || h.Len() != b.n {
		return fmt.Errorf("nccl: %w: %s: host buffer is %d %v, device buffer %d %v", comm.ErrInvalid, what, h.Len(), h.DType(), b.n, b.dtype)
	}
	if b.alloc != nil && b.alloc.freed.Load() {
		return fmt.Errorf("nccl: %w: %s: device buffer freed", comm.ErrInvalid, what)
	}
	return nil
}

// CopyFromHost copies src, which must have the same type and length, into
// the buffer (cuMemcpyHtoD_v2, synchronous).
func (b *DeviceBuffer) CopyFromHost(src *comm.HostBuffer) error {
	if err := b.check(src, "CopyFromHost"); err != nil {
		return err
	}
	if b.n == 0 {
		return nil
	}
	return copyHtoD(b.dev, b.ptr, src.Bytes())
}

// CopyToHost copies the buffer into dst, which must have the same type and
// length (cuMemcpyDtoH_v2, synchronous).
func (b *DeviceBuffer) CopyToHost(dst *comm.HostBuffer) error {
	if err := b.check(dst, "CopyToHost"); err != nil {
		return err
	}
	if b.n == 0 {
		return nil
	}
	return copyDtoH(b.dev, dst.Bytes(), b.ptr)
}

// Download copies the buffer into a new host buffer.
func (b *DeviceBuffer) Download() (*comm.HostBuffer, error) {
	h, err := comm.NewHostBuffer(b.dtype, b.n)
	if err != nil {
		return nil, err
	}
	if err := b.CopyToHost(h); err != nil {
		return nil, err
	}
	return h, nil
}

func copyHtoD(d *Device, dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	err := d.cuda("cuMemcpyHtoD_v2", func() int32 {
		return d.lib.cu.memcpyHtoD(dst, unsafe.Pointer(&src[0]), uintptr(len(src)))
	})
	runtime.KeepAlive(src)
	return err
}

func copyDtoH(d *Device, dst []byte, src uintptr) error {
	if len(dst) == 0 {
		return nil
	}
	err := d.cuda("cuMemcpyDtoH_v2", func() int32 {
		return d.lib.cu.memcpyDtoH(unsafe.Pointer(&dst[0]), src, uintptr(len(dst)))
	})
	runtime.KeepAlive(dst)
	return err
}

// Stream is a CUDA stream (CUstream, the same handle as cudaStream_t).
type Stream struct {
	dev    *Device
	h      uintptr
	closed atomic.Bool
}

// NewStream creates a stream that does not synchronise with the legacy
// default stream (CU_STREAM_NON_BLOCKING).
func (d *Device) NewStream() (*Stream, error) {
	s := &Stream{dev: d}
	if err := d.cuda("cuStreamCreate", func() int32 { return d.lib.cu.streamCreate(&s.h, streamNonBlocking) }); err != nil {
		return nil, err
	}
	return s, nil
}

// Handle returns the CUstream.
func (s *Stream) Handle() uintptr { return s.h }

// Synchronize waits for the stream's work (cuStreamSynchronize). It blocks
// without a time limit; Communicator work is waited for through its Work.
func (s *Stream) Synchronize() error {
	return s.dev.cuda("cuStreamSynchronize", func() int32 { return s.dev.lib.cu.streamSynchronize(s.h) })
}

// Query reports whether the stream's work has completed (cuStreamQuery).
func (s *Stream) Query() (bool, error) {
	return query(s.dev, "cuStreamQuery", func() int32 { return s.dev.lib.cu.streamQuery(s.h) })
}

// WaitEvent makes later work on the stream wait for e (cuStreamWaitEvent).
func (s *Stream) WaitEvent(e *Event) error {
	return s.dev.cuda("cuStreamWaitEvent", func() int32 { return s.dev.lib.cu.streamWaitEvent(s.h, e.h, 0) })
}

// Close destroys the stream (cuStreamDestroy_v2). Idempotent.
func (s *Stream) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	return s.dev.cuda("cuStreamDestroy_v2", func() int32 { return s.dev.lib.cu.streamDestroy(s.h) })
}

// Event is a CUDA event without timing (CU_EVENT_DISABLE_TIMING).
type Event struct {
	dev    *Device
	h      uintptr
	closed atomic.Bool
}

// NewEvent creates an event.
func (d *Device) NewEvent() (*Event, error) {
	e := &Event{dev: d}
	if err := d.cuda("cuEventCreate", func() int32 { return d.lib.cu.eventCreate(&e.h, eventDisableTiming) }); err != nil {
		return nil, err
	}
	return e, nil
}

// Handle returns the CUevent.
func (e *Event) Handle() uintptr { return e.h }

// Record captures the work enqueued on s so far (cuEventRecord).
func (e *Event) Record(s *Stream) error {
	return e.dev.cuda("cuEventRecord", func() int32 { return e.dev.lib.cu.eventRecord(e.h, s.h) })
}

// Query reports whether the captured work has completed (cuEventQuery).
func (e *Event) Query() (bool, error) {
	return query(e.dev, "cuEventQuery", func() int32 { return e.dev.lib.cu.eventQuery(e.h) })
}

// Synchronize waits for the captured work (cuEventSynchronize), without a
// time limit.
func (e *Event) Synchronize() error {
	return e.dev.cuda("cuEventSynchronize", func() int32 { return e.dev.lib.cu.eventSynchronize(e.h) })
}

// Close destroys the event (cuEventDestroy_v2). Idempotent.
func (e *Event) Close() error {
	if e.closed.Swap(true) {
		return nil
	}
	return e.dev.cuda("cuEventDestroy_v2", func() int32 { return e.dev.lib.cu.eventDestroy(e.h) })
}

// query runs a query call: CUDA_SUCCESS is true, CUDA_ERROR_NOT_READY
// false, anything else an error.
func query(d *Device, call string, f func() int32) (bool, error) {
	var rc int32
	if err := d.run(func() error { rc = f(); return nil }); err != nil {
		return false, err
	}
	switch rc {
	case 0:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	}
	return false, fmt.Errorf("nccl: %s: %w", d.Name(), d.lib.cudaError(call, rc))
}
