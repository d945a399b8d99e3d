// Package emu is an emulated device: host memory behind the interfaces of
// package device, so that the device code path (caching allocator,
// asynchronous streams, events, copies, the Kernels op set, collectives on
// device buffers) runs and is tested on machines without a GPU.
//
// A Device named "emu:N" holds 256-byte-aligned Go memory up to a cap
// (WithMemory, default 8 GiB), handed out by a device.Allocator, so that
// out of memory happens, and is recovered from, as on a GPU. Each stream
// is a goroutine running a FIFO of closures; an event is a mark in that
// FIFO, stamped with the host time when the stream reaches it. The
// Kernels call the CPU functions of package kernels that the host path
// calls, on views of the device memory, so float32 results are
// bit-identical to the host's. Buffers implement comm.HostBacked, so
// comm/local collectives run on them in place (after
// device.BeforeCollective).
//
// Work queued on a stream runs later, on the stream's goroutine: an
// error that a kernel finds then (a length that does not match, a target
// out of range) is kept and returned, wrapped with the kernel's name, by
// the next Synchronize of the stream or the device. WithSynchronous makes
// every stream run its work inline instead, returning such errors from
// the call that queued it: for debugging.
package emu

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
)

// DefaultMemory is the memory of a Device made without WithMemory: 8 GiB.
const DefaultMemory int64 = 8 << 30

// align is the alignment of every segment, as cuMemAlloc's (at least 256
// bytes).
const align = 256

// Option configures New.
type Option func(*config)

type config struct {
	memory int64
	sync   bool
	blas   *kernels.BLAS
	err    error
}

// WithMemory caps the device's memory at bytes (at least 1): allocations
// beyond it fail with a *device.OOMError.
func WithMemory(bytes int64) Option {
	return func(c *config) {
		if err := numcheck.Count(device.ErrInvalid, "emu.WithMemory bytes", int(bytes)); err != nil {
			c.err = err
		}
		c.memory = bytes
	}
}

// WithSynchronous makes every stream run its work inline, when it is queued,
// instead of on the stream's goroutine; errors of that work are returned
// by the call that queued it. For debugging: the order of work is the
// order of calls, on every stream.
func WithSynchronous() Option { return func(c *config) { c.sync = true } }

// WithBLAS makes Kernels.Gemm run on b, and the row kernels on b's
// threads, as the host path does with the rank's BLAS. Without it the
// device loads kernels.Default when a kernel first needs it.
func WithBLAS(b *kernels.BLAS) Option {
	return func(c *config) {
		if b == nil {
			c.err = fmt.Errorf("%w: WithBLAS(nil)", device.ErrInvalid)
		}
		c.blas = b
	}
}

// Device is an emulated device. It implements device.Device and is safe
// for concurrent use.
type Device struct {
	name    string
	sync    bool
	raw     *raw
	alloc   *device.Allocator
	compute *Stream

	coll device.Collectives

	mu      sync.Mutex
	streams []*Stream
	closed  bool
	blas    *kernels.BLAS
}

var _ device.CollectiveDevice = (*Device)(nil)

// New returns the emulated device of the given index (at least 0), named
// "emu:index". A negative index or a bad option is an error wrapping
// device.ErrInvalid.
func New(index int, opts ...Option) (*Device, error) {
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "emu.New index", index); err != nil {
		return nil, fmt.Errorf("emu: New: %w", err)
	}
	c := config{memory: DefaultMemory}
	for i, o := range opts {
		if o == nil {
			return nil, fmt.Errorf("emu: New: %w: option %d is nil", device.ErrInvalid, i)
		}
		o(&c)
		if c.err != nil {
			return nil, fmt.Errorf("emu: New: %w", c.err)
		}
	}
	d := &Device{name: fmt.Sprintf("emu:%d", index), sync: c.sync, blas: c.blas}
	d.raw = &raw{name: d.name, capacity: c.memory, segs: map[uintptr][]byte{}}
	d.compute = d.newStream()
	a, err := device.NewAllocator(d.name, d.raw, d.waitAll, device.WithEvents(func() (device.Event, error) { return d.NewEvent(false) }))
	if err != nil {
		d.compute.stop()
		return nil, fmt.Errorf("emu: New: %w", err)
	}
	d.alloc = a
	return d, nil
}

// Name is "emu:N".
func (d *Device) Name() string { return d.name }

// Kind is device.KindEmulated.
func (d *Device) Kind() device.Kind { return device.KindEmulated }

// Compute is the stream ops, copies and allocations use.
func (d *Device) Compute() device.Stream { return d.compute }

// Memory is the device's caching allocator.
func (d *Device) Memory() *device.Allocator { return d.alloc }

// Collectives is the device's state for device.BeforeCollective and
// device.AfterCollective: pooled events and the works compute waits for,
// whose errors Synchronize returns.
func (d *Device) Collectives() *device.Collectives { return &d.coll }

// Kernels is the device's op set, on the CPU kernels.
func (d *Device) Kernels() device.Kernels { return emuKernels{d} }

// NewStream makes another stream, a goroutine of its own (inline under
// WithSynchronous). It runs until Close.
func (d *Device) NewStream() (device.Stream, error) {
	if err := d.live("NewStream"); err != nil {
		return nil, err
	}
	return d.newStream(), nil
}

// NewEvent makes an event; timing events can measure Since.
func (d *Device) NewEvent(timing bool) (device.Event, error) {
	if err := d.live("NewEvent"); err != nil {
		return nil, err
	}
	return &Event{dev: d, timing: timing}, nil
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

// blasOrDefault is the device's BLAS, loading kernels.Default on first
// use.
func (d *Device) blasOrDefault() (*kernels.BLAS, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.blas == nil {
		b, err := kernels.Default()
		if err != nil {
			return nil, fmt.Errorf("%s: loading the default BLAS: %w", d.name, err)
		}
		d.blas = b
	}
	return d.blas, nil
}

// Alloc returns a buffer of n elements of type dt for use on Compute(),
// from the caching allocator. Its contents are undefined. An invalid
// dtype or negative n wraps device.ErrInvalid; memory beyond the cap is
// a *device.OOMError.
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
	mem := d.raw.view(blk.Ptr, bytes)
	h, err := comm.HostBytes(dt, mem)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("%s: Alloc: internal: %w", d.name, err), d.alloc.Free(blk))
	}
	return d.newBuffer(h, blk), nil
}

// newBuffer wraps an allocated block as an owning buffer, with a cleanup
// that frees the block once the buffer and its slices are unreachable: a
// safety net for a buffer dropped without Free (op results a caller never
// frees), as device/cuda's buffers have. The stream order still holds:
// work queued before the buffer was lost runs before any reuse, since the
// block is reused on the stream it was allocated on, after that work.
func (d *Device) newBuffer(h *comm.HostBuffer, blk device.Block) *Buffer {
	b := &Buffer{dev: d, host: h, own: &owner{alloc: d.alloc, blk: blk}}
	runtime.AddCleanup(b, func(o *owner) {
		// Nobody can free the buffer any more. The error has no one to
		// go to (after Close the allocator has emptied its cache anyway).
		if !o.freed.Swap(true) {
			_ = o.alloc.Free(o.blk)
		}
	}, b.own)
	return b
}

// RecordStream tells the allocator that b is used on s too, so that
// after b.Free its memory is reused only once the work queued on s by
// then has run.
func (d *Device) RecordStream(b device.Buffer, s device.Stream) error {
	buf, err := d.buffer("RecordStream", "b", b, false)
	if err != nil {
		return err
	}
	st, err := d.stream("RecordStream", s)
	if err != nil {
		return err
	}
	return d.alloc.RecordStream(buf.own.blk, st)
}

// CopyFromHost copies src into dst on Compute(); src is copied aside
// before it returns, so the caller may reuse it at once.
func (d *Device) CopyFromHost(dst device.Buffer, src *comm.HostBuffer) error {
	b, err := d.buffer("CopyFromHost", "dst", dst, false)
	if err != nil {
		return err
	}
	if err := device.CheckCopy(d.name, "CopyFromHost", dst, src); err != nil {
		return err
	}
	staged := append([]byte(nil), src.Bytes()...)
	to := b.host.Bytes()
	return d.compute.launch("CopyFromHost", func() error { copy(to, staged); return nil })
}

// CopyToHost copies src into dst after the work queued on Compute(), and
// waits for it. An error of that work is returned.
func (d *Device) CopyToHost(dst *comm.HostBuffer, src device.Buffer) error {
	b, err := d.buffer("CopyToHost", "src", src, false)
	if err != nil {
		return err
	}
	if err := device.CheckCopy(d.name, "CopyToHost", dst, src); err != nil {
		return err
	}
	from, to := b.host.Bytes(), dst.Bytes()
	if err := d.compute.launch("CopyToHost", func() error { copy(to, from); return nil }); err != nil {
		return err
	}
	return d.compute.Synchronize()
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
	to, from := db.host.Bytes(), sb.host.Bytes()
	return d.compute.launch("Copy", func() error { copy(to, from); return nil })
}

// Synchronize waits for the work queued on every stream and returns the
// errors found while it ran, then those of the collectives compute waited
// for (device.AfterCollective), each returned once.
func (d *Device) Synchronize() error {
	var errs []error
	for _, s := range d.allStreams() {
		errs = append(errs, s.Synchronize())
	}
	errs = append(errs, d.coll.Wait(context.Background()))
	return errors.Join(errs...)
}

// waitAll waits for every stream without taking their errors: the
// allocator's sync function, which must leave the errors to Synchronize.
func (d *Device) waitAll() error {
	for _, s := range d.allStreams() {
		s.wait(s.issuedSeq())
	}
	return nil
}

func (d *Device) allStreams() []*Stream {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]*Stream(nil), d.streams...)
}

// Close waits for the device's work, stops its streams and gives its
// memory back; buffers still allocated are invalid afterwards. It
// returns the errors the work found and those of emptying the cache.
// Closing twice returns nil.
func (d *Device) Close() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return nil
	}
	d.closed = true
	d.mu.Unlock()
	err := d.Synchronize()
	for _, s := range d.allStreams() {
		s.stop()
	}
	return errors.Join(err, d.coll.Close(), d.alloc.EmptyCache())
}

// buffer checks that b is a live buffer of d (nil allowed when optional)
// and returns it; name is the argument's name, for errors.
func (d *Device) buffer(op, name string, b device.Buffer, optional bool) (*Buffer, error) {
	if b == nil || comm.IsNil(b) {
		if optional {
			return nil, nil
		}
		return nil, fmt.Errorf("%s: %s: %w: %s is nil", d.name, op, device.ErrInvalid, name)
	}
	eb, ok := b.(*Buffer)
	if !ok || eb.dev != d {
		if err := device.Same(d.name+": "+op, d, b.Owner()); err != nil {
			return nil, fmt.Errorf("%w (%s)", err, name)
		}
		return nil, fmt.Errorf("%s: %s: %w: %s is a %T", d.name, op, device.ErrInvalid, name, b)
	}
	if eb.own.freed.Load() {
		return nil, fmt.Errorf("%s: %s: %w: %s was freed", d.name, op, device.ErrInvalid, name)
	}
	return eb, nil
}

// stream checks that s is a stream of d.
func (d *Device) stream(op string, s device.Stream) (*Stream, error) {
	st, ok := s.(*Stream)
	if !ok || st == nil || st.dev != d {
		return nil, fmt.Errorf("%s: %s: %w: a stream of another device (%T)", d.name, op, device.ErrInvalid, s)
	}
	return st, nil
}

// raw is the device memory: Go memory up to a cap. Segments are
// 256-byte aligned and kept reachable by segs until freed.
type raw struct {
	name     string
	mu       sync.Mutex
	capacity int64
	used     int64
	segs     map[uintptr][]byte // by aligned address
	starts   []uintptr          // the keys of segs, sorted
}

func (r *raw) Malloc(n int64) (uintptr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n > r.capacity-r.used {
		return 0, fmt.Errorf("%s: %d bytes requested with %d of %d free: %w", r.name, n, r.capacity-r.used, r.capacity, device.ErrOutOfMemory)
	}
	mem := make([]byte, n+align)
	off := int((align - uintptr(unsafe.Pointer(&mem[0]))%align) % align)
	mem = mem[off : off+int(n) : off+int(n)]
	p := uintptr(unsafe.Pointer(&mem[0]))
	r.segs[p] = mem
	i := sort.Search(len(r.starts), func(i int) bool { return r.starts[i] > p })
	r.starts = append(r.starts, 0)
	copy(r.starts[i+1:], r.starts[i:])
	r.starts[i] = p
	r.used += n
	return p, nil
}

func (r *raw) Free(p uintptr) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	mem, ok := r.segs[p]
	if !ok {
		return fmt.Errorf("%s: free of %#x, which is not a segment", r.name, p)
	}
	delete(r.segs, p)
	i := sort.Search(len(r.starts), func(i int) bool { return r.starts[i] >= p })
	r.starts = append(r.starts[:i], r.starts[i+1:]...)
	r.used -= int64(len(mem))
	return nil
}

func (r *raw) MemInfo() (free, total int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.capacity - r.used, r.capacity
}

// view is the n bytes at p, inside a segment.
func (r *raw) view(p uintptr, n int) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sort.Search(len(r.starts), func(i int) bool { return r.starts[i] > p }) - 1
	mem := r.segs[r.starts[i]]
	off := int(p - r.starts[i])
	return mem[off : off+n : off+n]
}

// Buffer is memory of an emulated device. It implements device.Buffer and
// comm.HostBacked. A buffer from Alloc owns its memory and Free gives it
// back; one dropped without Free is freed when the garbage collector finds
// it and its slices unreachable (a safety net: the memory stays held
// until then). Slices keep the buffer they come from reachable.
type Buffer struct {
	dev  *Device
	host *comm.HostBuffer
	own  *owner
	from *Buffer // the owning buffer of a slice; nil for the owner
}

// owner is the allocation a buffer and its slices share; it must not point
// back at the buffer, so that the buffer's cleanup can run.
type owner struct {
	alloc *device.Allocator
	blk   device.Block
	freed atomic.Bool
}

var (
	_ device.Buffer   = (*Buffer)(nil)
	_ comm.HostBacked = (*Buffer)(nil)
)

// DType is the element type.
func (b *Buffer) DType() comm.DType { return b.host.DType() }

// Len is the length in elements.
func (b *Buffer) Len() int { return b.host.Len() }

// Device is the device's name, "emu:N".
func (b *Buffer) Device() string { return b.dev.name }

// Owner is the device.
func (b *Buffer) Owner() device.Device { return b.dev }

// Slice returns elements [lo, hi) as a *Buffer over the same memory; it
// panics when the bounds are out of range, like a slice expression. Its
// Free is an error: the buffer it came from owns the memory.
func (b *Buffer) Slice(lo, hi int) comm.Buffer {
	root := b
	if b.from != nil {
		root = b.from
	}
	return &Buffer{dev: b.dev, host: b.host.SliceHost(lo, hi), own: b.own, from: root}
}

// Ptr is the host address of the first element, 0 when empty.
func (b *Buffer) Ptr() uintptr {
	if by := b.host.Bytes(); len(by) > 0 {
		return uintptr(unsafe.Pointer(&by[0]))
	}
	return 0
}

// HostView is the buffer's memory as a host buffer (comm.HostBacked). Work
// queued on the device's streams may be using it: synchronise first
// (device.BeforeCollective does).
func (b *Buffer) HostView() *comm.HostBuffer { return b.host }

// Free gives the memory back to the allocator, ordered after the work
// queued on the streams it was used on (Device.RecordStream). Freeing a
// slice, or freeing twice, is an error wrapping device.ErrInvalid.
func (b *Buffer) Free() error {
	if b.from != nil {
		return fmt.Errorf("%s: Free: %w: a slice does not own its memory; free the buffer it came from", b.dev.name, device.ErrInvalid)
	}
	if b.own.freed.Swap(true) {
		return fmt.Errorf("%s: Free: %w: the buffer was freed already", b.dev.name, device.ErrInvalid)
	}
	if err := b.dev.alloc.Free(b.own.blk); err != nil {
		b.own.freed.Store(false)
		return err
	}
	return nil
}
