package cuda

import (
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// errOutOfMemory is CUDA_ERROR_OUT_OF_MEMORY.
const errOutOfMemory = 2

// blasWorkspace is the cuBLAS/cuBLASLt workspace each device takes from
// its allocator, so that cuBLAS allocates nothing behind it: 32 MiB, what
// PyTorch gives cuBLAS on Hopper (CUBLAS_WORKSPACE_CONFIG :4096:8).
const blasWorkspace = 32 << 20

// DeviceOption configures [OpenDevice].
type DeviceOption func(*deviceConfig)

type deviceConfig struct {
	blas     *BLAS
	blasOpts []BLASOption
	err      error
}

// WithBLAS makes the device's GEMMs run on b instead of the cuBLAS that
// [LoadBLAS] finds at the first GEMM.
func WithBLAS(b *BLAS) DeviceOption {
	return func(c *deviceConfig) {
		if b == nil {
			c.err = errors.New("WithBLAS(nil)")
		}
		c.blas = b
	}
}

// WithBLASOptions are the options of the [LoadBLAS] call the device makes
// at its first GEMM ([WithTF32], [WithCUBLAS], ...); not with [WithBLAS].
func WithBLASOptions(opts ...BLASOption) DeviceOption {
	return func(c *deviceConfig) { c.blasOpts = append(c.blasOpts, opts...) }
}

// Device is one CUDA device as a [device.Device] named "cuda:N": memory
// from a [device.Allocator] over cuMemAlloc_v2, a non-blocking compute
// stream on which allocations, copies and kernels are ordered, and
// [device.Kernels] over loom's NVRTC kernels and cuBLAS. It is safe for
// concurrent use. The kernels are compiled (or read from the kernel
// cache) at their first use, and cuBLAS is loaded at the first GEMM, so a
// device without NVRTC or cuBLAS serves everything that needs neither;
// the op that needs one fails naming the library and its variable.
type Device struct {
	lib     *Lib
	ctx     *Context
	name    string
	compute *Stream
	alloc   *device.Allocator

	mu      sync.Mutex
	streams []*Stream // made by NewStream, closed by Close
	closed  bool

	blasMu   sync.Mutex
	blas     *BLAS
	blasOpts []BLASOption
	handle   *BLASHandle
	ws       device.Buffer // the handle's workspace

	fnMu sync.Mutex
	fns  map[string]Function // by kernel name
}

var _ device.Device = (*Device)(nil)

// OpenDevice opens CUDA device ordinal (0-based) of lib as a device.Device
// named "cuda:ordinal": it retains the primary context, makes the compute
// stream and the caching allocator. An ordinal outside the devices the
// driver shows is an error wrapping ErrInvalid (and loom.ErrInvalid) that
// says how many are visible and CUDA_VISIBLE_DEVICES; a bad option wraps
// ErrInvalid too; the driver's failures are *Error.
func OpenDevice(lib *Lib, ordinal int, opts ...DeviceOption) (*Device, error) {
	var c deviceConfig
	for i, o := range opts {
		if o == nil {
			return nil, fmt.Errorf("cuda: OpenDevice: %w: option %d is nil", ErrInvalid, i)
		}
		o(&c)
		if c.err != nil {
			return nil, fmt.Errorf("cuda: OpenDevice: %w: %v", ErrInvalid, c.err)
		}
	}
	if c.blas != nil && len(c.blasOpts) > 0 {
		return nil, fmt.Errorf("cuda: OpenDevice: %w: WithBLAS and WithBLASOptions together", ErrInvalid)
	}
	n, err := lib.DeviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		vis, ok := os.LookupEnv("CUDA_VISIBLE_DEVICES")
		if !ok {
			vis = "unset"
		}
		return nil, fmt.Errorf("cuda: device %d: %w: %d device(s) visible (CUDA_VISIBLE_DEVICES=%s)", ordinal, ErrInvalid, n, vis)
	}
	ctx, err := lib.Open(ordinal)
	if err != nil {
		return nil, err
	}
	d := &Device{lib: lib, ctx: ctx, name: fmt.Sprintf("cuda:%d", ordinal), blas: c.blas, blasOpts: c.blasOpts}
	if d.compute, err = ctx.NewStream(); err != nil {
		return nil, errors.Join(err, ctx.Close())
	}
	d.alloc, err = device.NewAllocator(d.name, raw{ctx}, ctx.Synchronize,
		device.WithEvents(func() (device.Event, error) { return ctx.NewEvent(false) }))
	if err != nil {
		return nil, errors.Join(err, d.compute.Close(), ctx.Close())
	}
	return d, nil
}

// Name is "cuda:N".
func (d *Device) Name() string { return d.name }

// Kind is device.KindCUDA.
func (d *Device) Kind() device.Kind { return device.KindCUDA }

// Context is the device's primary context.
func (d *Device) Context() *Context { return d.ctx }

// Compute is the non-blocking stream ops, copies and allocations use.
func (d *Device) Compute() device.Stream { return d.compute }

// Memory is the device's caching allocator.
func (d *Device) Memory() *device.Allocator { return d.alloc }

// Kernels is the device's op set: NVRTC kernels and cuBLAS on the compute
// stream.
func (d *Device) Kernels() device.Kernels { return cudaKernels{d} }

// NewStream makes another non-blocking stream of the device; Close closes
// it.
func (d *Device) NewStream() (device.Stream, error) {
	if err := d.live("NewStream"); err != nil {
		return nil, err
	}
	s, err := d.ctx.NewStream()
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.streams = append(d.streams, s)
	d.mu.Unlock()
	return s, nil
}

// NewEvent makes an event; timing events can measure Since. The caller
// closes it.
func (d *Device) NewEvent(timing bool) (device.Event, error) {
	if err := d.live("NewEvent"); err != nil {
		return nil, err
	}
	return d.ctx.NewEvent(timing)
}

// live returns an error after Close.
func (d *Device) live(op string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return fmt.Errorf("%s: %s: %w: the device is closed", d.name, op, device.ErrInvalid)
	}
	return nil
}

// Alloc returns a buffer of n elements of type dt for use on Compute(),
// from the caching allocator; its contents are undefined. An invalid
// dtype or a negative n wraps device.ErrInvalid; memory the device cannot
// hold is a *device.OOMError.
func (d *Device) Alloc(dt comm.DType, n int) (device.Buffer, error) {
	if err := d.live("Alloc"); err != nil {
		return nil, err
	}
	if !dt.Valid() {
		return nil, fmt.Errorf("%s: Alloc: %w: invalid dtype %v", d.name, device.ErrInvalid, dt)
	}
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "Alloc length", n); err != nil {
		return nil, fmt.Errorf("%s: Alloc: %w", d.name, err)
	}
	bytes, ok := checked.Mul(n, dt.Size())
	if !ok {
		return nil, fmt.Errorf("%s: Alloc: %w: %d %v elements overflow int", d.name, device.ErrInvalid, n, dt)
	}
	blk, err := d.alloc.Alloc(int64(bytes), d.compute)
	if err != nil {
		return nil, err
	}
	return newBuffer(d, dt, n, blk), nil
}

// RecordStream tells the allocator that b is used on s too, so that after
// b.Free its memory is reused only once the work queued on s by then has
// completed.
func (d *Device) RecordStream(b device.Buffer, s device.Stream) error {
	buf, err := d.buffer("RecordStream", "b", b, false)
	if err != nil {
		return err
	}
	st, ok := s.(*Stream)
	if !ok || st == nil || st.ctx != d.ctx {
		return fmt.Errorf("%s: RecordStream: %w: a stream of another device (%T)", d.name, device.ErrInvalid, s)
	}
	return d.alloc.RecordStream(buf.root().own.blk, st)
}

// CopyFromHost copies src into dst on Compute() (cuMemcpyHtoDAsync_v2
// from pageable memory: the driver has read src when it returns).
func (d *Device) CopyFromHost(dst device.Buffer, src *comm.HostBuffer) error {
	b, err := d.buffer("CopyFromHost", "dst", dst, false)
	if err != nil {
		return err
	}
	if err := device.CheckCopy(d.name, "CopyFromHost", dst, src); err != nil {
		return err
	}
	if err := CopyToDeviceAsync(d.compute, b.raw(), src.Bytes()); err != nil {
		return fmt.Errorf("%s: CopyFromHost: %w", d.name, err)
	}
	return nil
}

// CopyToHost copies src into dst after the work queued on Compute(), and
// waits for it.
func (d *Device) CopyToHost(dst *comm.HostBuffer, src device.Buffer) error {
	b, err := d.buffer("CopyToHost", "src", src, false)
	if err != nil {
		return err
	}
	if err := device.CheckCopy(d.name, "CopyToHost", dst, src); err != nil {
		return err
	}
	if err := CopyFromDeviceAsync(d.compute, dst.Bytes(), b.raw()); err != nil {
		return fmt.Errorf("%s: CopyToHost: %w", d.name, err)
	}
	return nil
}

// Copy copies src into dst (both of this device) on Compute().
func (d *Device) Copy(dst, src device.Buffer) error {
	db, err := d.buffer("Copy", "dst", dst, false)
	if err != nil {
		return err
	}
	sb, err := d.buffer("Copy", "src", src, false)
	if err != nil {
		return err
	}
	if err := device.CheckCopy(d.name, "Copy", dst, src); err != nil {
		return err
	}
	if err := d.compute.Copy(db.raw(), sb.raw(), db.bytes()); err != nil {
		return fmt.Errorf("%s: Copy: %w", d.name, err)
	}
	return nil
}

// Synchronize waits for the work queued on every stream of the device
// (cuCtxSynchronize) and returns the first asynchronous error.
func (d *Device) Synchronize() error {
	if err := d.live("Synchronize"); err != nil {
		return err
	}
	return d.ctx.Synchronize()
}

// Close waits for the device's work, frees the cuBLAS handle and its
// workspace, gives the allocator's memory back to the driver, closes the
// streams of NewStream and the compute stream, and releases the context.
// Buffers still allocated are invalid afterwards (their memory stays
// reserved until the context goes). Closing twice returns nil.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	streams := d.streams
	d.streams = nil
	d.mu.Unlock()
	errs := []error{d.ctx.Synchronize()}
	d.blasMu.Lock()
	if d.handle != nil {
		errs = append(errs, d.ctx.do("Close", func(*driverFns) error { return d.handle.Close() }))
		d.handle = nil
	}
	if d.ws != nil {
		errs = append(errs, d.ws.(*DeviceBuffer).free())
		d.ws = nil
	}
	d.blasMu.Unlock()
	errs = append(errs, d.alloc.EmptyCache())
	for _, s := range streams {
		errs = append(errs, s.Close())
	}
	errs = append(errs, d.compute.Close(), d.ctx.Close())
	return errors.Join(errs...)
}

// buffer checks that b is a live buffer of d (nil allowed when optional)
// and returns it; name is the argument's name, for errors.
func (d *Device) buffer(op, name string, b device.Buffer, optional bool) (*DeviceBuffer, error) {
	if b == nil || comm.IsNil(b) {
		if optional {
			return nil, nil
		}
		return nil, fmt.Errorf("%s: %s: %w: %s is nil", d.name, op, device.ErrInvalid, name)
	}
	cb, ok := b.(*DeviceBuffer)
	if !ok || cb.dev != d {
		if err := device.Same(d.name+": "+op, d, b.Owner()); err != nil {
			return nil, fmt.Errorf("%w (%s)", err, name)
		}
		return nil, fmt.Errorf("%s: %s: %w: %s is a %T", d.name, op, device.ErrInvalid, name, b)
	}
	if cb.root().own.freed.Load() {
		return nil, fmt.Errorf("%s: %s: %w: %s was freed", d.name, op, device.ErrInvalid, name)
	}
	return cb, nil
}

// raw is the device memory the allocator caches: cuMemAlloc_v2,
// cuMemFree_v2 and cuMemGetInfo_v2 of one context.
type raw struct{ ctx *Context }

// Malloc allocates bytes of device memory; CUDA_ERROR_OUT_OF_MEMORY
// matches device.ErrOutOfMemory.
func (r raw) Malloc(bytes int64) (uintptr, error) {
	if int64(int(bytes)) != bytes {
		return 0, fmt.Errorf("cuda: %d bytes do not fit an int: %w", bytes, device.ErrOutOfMemory)
	}
	b, err := r.ctx.Alloc(int(bytes))
	if err != nil {
		var e *Error
		if errors.As(err, &e) && e.Code == errOutOfMemory {
			return 0, fmt.Errorf("%w: %w", device.ErrOutOfMemory, err)
		}
		return 0, err
	}
	return uintptr(b.Ptr), nil
}

// Free frees memory of Malloc, after the work queued on every stream:
// the allocator frees cached segments whose last kernels may not have
// run yet, and the driver documents its implicit synchronisation only
// for cudaFree.
func (r raw) Free(p uintptr) error {
	if err := r.ctx.Synchronize(); err != nil {
		return err
	}
	return r.ctx.Free(Buffer{Ptr: DevicePtr(p), Bytes: 1})
}

// MemInfo is the driver's free and total memory; zeros when it cannot
// say (the allocator only reports them).
func (r raw) MemInfo() (free, total int64) {
	f, t, err := r.ctx.MemInfo()
	if err != nil {
		return 0, 0
	}
	return f, t
}
