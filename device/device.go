// Package device holds what loom's compute devices share: the [Device],
// [Buffer] and [Kernels] interfaces that the host, the emulated device
// (device/emu) and CUDA implement, the stream and event interfaces that
// order work on a device, the glue that orders collectives after compute
// ([BeforeCollective], [AfterCollective]), and a caching allocator of
// device memory ([Allocator]) in the manner of PyTorch's
// CUDACachingAllocator.
//
// Data lives on one device; an op given buffers of two devices fails with
// an error from [Same] that names the op and both devices, before any data
// moves. The host device ([Host]) is today's Go memory: its buffers wrap
// *comm.HostBuffer, its work runs on the caller's goroutine and it has no
// Kernels (the host path calls package kernels directly).
//
// The allocator asks a [Raw] (the driver: cuMemAlloc_v2/cuMemFree_v2/
// cuMemGetInfo_v2 on CUDA, capped Go memory on the emulated device) for
// large segments and hands out blocks carved from them. A freed block goes
// back to a cache, not to the driver, so a training loop that allocates
// the same sizes every step makes no driver allocation after its first
// step ([Stats].DriverAllocs stays flat). A block is reused only on the
// stream it was allocated on, or, once it was used on other streams
// ([Allocator.RecordStream]), only after events recorded on those streams
// at its free have completed.
//
// All sizes are in bytes.
package device

import (
	"fmt"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
)

// Sentinel errors; test for them with errors.Is.
var (
	// ErrInvalid: arguments rejected before any memory moved (a negative
	// size, a nil stream or Raw, a block freed twice or freed on an
	// allocator that did not allocate it). errors.Is(err,
	// loom.ErrInvalid) matches it too.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrOutOfMemory: the device could not hold an allocation, even after
	// the allocator released its cache and synchronised. Every
	// *OOMError matches it; a Raw's Malloc returns an error matching it
	// when the driver is out of memory (any other Malloc error is
	// returned as it is, without the retries).
	ErrOutOfMemory = loom.NewSentinel("out of memory")
	// ErrMixed: an op was given data on two devices ([Same]).
	// errors.Is(err, loom.ErrInvalid) and errors.Is(err, ErrInvalid)
	// match it too, since it is found before any data moves.
	ErrMixed = loom.NewSentinel("data on different devices", loom.ErrInvalid, ErrInvalid)
)

// Kind is the kind of a Device.
type Kind int

// The kinds of device.
const (
	// KindHost is Go memory on the CPU; work runs on the caller's
	// goroutine.
	KindHost Kind = iota
	// KindCUDA is an NVIDIA GPU behind the CUDA driver.
	KindCUDA
	// KindEmulated is device/emu: host memory behind the device interfaces,
	// with asynchronous streams, for testing the device code path
	// without a GPU.
	KindEmulated
)

// String returns "host", "cuda" or "emulated".
func (k Kind) String() string {
	switch k {
	case KindHost:
		return "host"
	case KindCUDA:
		return "cuda"
	case KindEmulated:
		return "emulated"
	}
	return fmt.Sprintf("Kind(%d)", int(k))
}

// Device is where a tensor's local block lives and its ops run: memory
// from a caching allocator, a compute stream that orders the work, and the
// device-side op set. Methods that queue work (Alloc, the copies, the
// Kernels) queue it on Compute(), so it runs in the order it was issued;
// they return once it is queued, and errors found while it runs are
// returned by the next Synchronize of the stream.
type Device interface {
	// Name is the device's name, "host", "cuda:0" or "emu:1"; it equals
	// Device() of its buffers.
	Name() string
	// Kind is the kind of device.
	Kind() Kind
	// Alloc returns a buffer of n elements of type dt, for use on
	// Compute(). Its contents are undefined (as cuMemAlloc's). An invalid
	// dtype or a negative n is an error wrapping ErrInvalid; memory the
	// device cannot hold is an *OOMError.
	Alloc(dt comm.DType, n int) (Buffer, error)
	// Compute is the stream that ops, copies and allocations use.
	Compute() Stream
	// NewStream makes another stream of the device (a communicator's,
	// say).
	NewStream() (Stream, error)
	// NewEvent makes an event; timing events can measure Since.
	NewEvent(timing bool) (Event, error)
	// CopyFromHost copies src into dst (same dtype and length), ordered
	// on Compute(); src has been read when it returns, so the caller may
	// reuse it at once.
	CopyFromHost(dst Buffer, src *comm.HostBuffer) error
	// CopyToHost copies src into dst (same dtype and length) after the
	// work queued on Compute() and waits for it.
	CopyToHost(dst *comm.HostBuffer, src Buffer) error
	// Copy copies src into dst, both of this device (same dtype and
	// length), ordered on Compute().
	Copy(dst, src Buffer) error
	// RecordStream tells the allocator that b is used on s as well as on
	// Compute() (a collective into it on a communicator's stream), so
	// that after b.Free its memory is reused only once the work queued on
	// s by then has completed.
	RecordStream(b Buffer, s Stream) error
	// Synchronize waits for the work queued on every stream of the
	// device and returns the first error found while it ran.
	Synchronize() error
	// Memory is the device's caching allocator (nil for the host, whose
	// memory is the Go heap's).
	Memory() *Allocator
	// Kernels is the device-side op set (nil for the host, where ops call
	// package kernels directly).
	Kernels() Kernels
	// Close waits for the device's work, stops its streams and releases
	// its memory; the device and its buffers are not used afterwards.
	Close() error
}

// Buffer is memory of a Device: a comm.Buffer (DType, Len, Slice, Device)
// that knows its device. Slice returns a Buffer of the same device over
// the same memory.
type Buffer interface {
	comm.Buffer
	// Owner is the device the memory belongs to.
	Owner() Device
	// Ptr is the address of the first element: a device address on CUDA,
	// a host address on the host and the emulated device; 0 when empty.
	Ptr() uintptr
	// Free gives the memory back to the device's allocator, ordered after
	// the work queued on the streams it was used on. On a device with an
	// allocator, a buffer made by Slice does not own its memory, so its
	// Free is an error wrapping ErrInvalid, as is a second Free; the
	// host's Free does nothing (the garbage collector owns Go memory).
	Free() error
}

// Same returns nil when a and b are the same device, and otherwise an
// error matching ErrMixed (and loom.ErrInvalid) that names op and both
// devices: "autograd: Linear: inputs on cuda:0 and host". A nil device is
// the host.
func Same(op string, a, b Device) error {
	if a == nil {
		a = Host()
	}
	if b == nil {
		b = Host()
	}
	if a == b {
		return nil
	}
	if a.Name() == b.Name() {
		// Two devices of one name (two emu.New(0), say) hold different memory.
		return fmt.Errorf("%s: %w: inputs on two devices named %s", op, ErrMixed, a.Name())
	}
	return fmt.Errorf("%s: %w: inputs on %s and %s", op, ErrMixed, a.Name(), b.Name())
}

// Stream is an ordered queue of work on a device (a CUDA stream). Values
// are compared with ==, so an implementation is a pointer or another
// comparable type.
type Stream interface {
	// WaitEvent makes work queued on the stream after this call wait
	// until e has completed, without blocking the caller.
	WaitEvent(e Event) error
	// Synchronize blocks until every piece of work queued on the stream
	// has completed.
	Synchronize() error
	// Query reports whether every piece of work queued on the stream has
	// completed, without blocking.
	Query() (bool, error)
}

// Event marks a point in a stream's queue (a CUDA event).
type Event interface {
	// Record places the event at the current end of s's queue; it
	// completes when the work queued on s before it has.
	Record(s Stream) error
	// Synchronize blocks until the event has completed.
	Synchronize() error
	// Query reports whether the event has completed, without blocking.
	Query() (bool, error)
	// Since is the device time from start's completion to this event's.
	Since(start Event) (time.Duration, error)
	// Close releases the event; it is not used afterwards.
	Close() error
}

// Raw is the device memory the allocator caches: the driver's
// allocation calls. Its methods are called with the allocator's lock
// held, so they must not call back into the allocator.
type Raw interface {
	// Malloc returns the address of bytes of fresh device memory. When
	// the device has not that much free, the error matches
	// ErrOutOfMemory.
	Malloc(bytes int64) (uintptr, error)
	// Free returns memory that Malloc returned to the device.
	Free(p uintptr) error
	// MemInfo is the device's free and total memory, in bytes, as the
	// driver sees them (all processes' allocations count).
	MemInfo() (free, total int64)
}

// Stats describes an allocator's memory, in bytes and counts.
type Stats struct {
	// Allocated is the bytes of blocks handed out and not yet freed,
	// after rounding (a 100-byte request holds 512).
	Allocated int64 `json:"allocated"`
	// Reserved is the bytes of segments held from the driver: Allocated,
	// Pending and the cached free blocks.
	Reserved int64 `json:"reserved"`
	// Pending is the bytes of freed blocks waiting for events on other
	// streams before they can be reused.
	Pending int64 `json:"pending"`
	// PeakAllocated and PeakReserved are the largest Allocated and
	// Reserved since the allocator was made or ResetPeak was last called.
	PeakAllocated int64 `json:"peak_allocated"`
	PeakReserved  int64 `json:"peak_reserved"`
	// LargestFree is the largest cached free block: the largest request
	// that needs no driver allocation (on the stream that holds it).
	LargestFree int64 `json:"largest_free"`
	// Fragmentation is 1 − LargestFree/(Reserved − Allocated − Pending),
	// the share of the cached free memory outside its largest block; 0
	// when nothing is cached.
	Fragmentation float64 `json:"fragmentation"`
	// Segments is the number of driver allocations held now.
	Segments int64 `json:"segments"`
	// DriverAllocs and DriverFrees count the Raw's successful Malloc and
	// Free calls since the allocator was made.
	DriverAllocs int64 `json:"driver_allocs"`
	DriverFrees  int64 `json:"driver_frees"`
	// Retries counts allocations that released the cache and asked the
	// driver again after it had run out of memory.
	Retries int64 `json:"retries"`
	// OOMs counts allocations that failed with an *OOMError.
	OOMs int64 `json:"ooms"`
}

// OOMError is an allocation the device could not hold even after the
// allocator released every cached segment it could and, given a sync
// function, synchronised and retried. The allocator is unchanged apart
// from its cache, so a smaller request may then succeed.
// errors.Is(err, ErrOutOfMemory) matches it.
type OOMError struct {
	// Device is the allocator's name ("cuda:0").
	Device string
	// Requested is the bytes asked for; Rounded the block size it was
	// rounded to; Segment the driver allocation that failed (0 when the
	// request is too large to round).
	Requested, Rounded, Segment int64
	// Free and Total are the device's free and total memory after the
	// cache was released, from Raw.MemInfo.
	Free, Total int64
	// Stats are the allocator's statistics at the failure.
	Stats Stats
	// Synced tells whether the allocator synchronised the device before
	// giving up (it does when it was given a sync function).
	Synced bool
}

// Error says what was requested and what is held, for example:
//
//	device: cuda:0: out of memory allocating 80.0 GiB (85899345920 bytes, rounded to 85899345920, segment 85899345920): loom holds 1.2 GiB allocated, 2.0 GiB reserved (3 segments, 0 B pending, fragmentation 0.40); device free 139.0 GiB of 140.4 GiB; cache released and retried after synchronising
func (e *OOMError) Error() string {
	how := "cache released and retried after synchronising"
	switch {
	case e.Segment == 0:
		how = "too large for any segment; nothing tried"
	case !e.Synced:
		how = "cache released and retried (no sync function to wait for pending frees)"
	}
	return fmt.Sprintf("device: %s: out of memory allocating %s (%d bytes, rounded to %d, segment %d): "+
		"loom holds %s allocated, %s reserved (%d segments, %s pending, fragmentation %.2f); device free %s of %s; %s",
		e.Device, formatBytes(e.Requested), e.Requested, e.Rounded, e.Segment,
		formatBytes(e.Stats.Allocated), formatBytes(e.Stats.Reserved), e.Stats.Segments,
		formatBytes(e.Stats.Pending), e.Stats.Fragmentation, formatBytes(e.Free), formatBytes(e.Total), how)
}

// Is reports whether target is ErrOutOfMemory.
func (e *OOMError) Is(target error) bool { return target == ErrOutOfMemory }

// formatBytes writes n in the largest binary unit that keeps it ≥ 1.
func formatBytes(n int64) string {
	const k = 1024
	switch {
	case n >= k*k*k:
		return fmt.Sprintf("%.1f GiB", float64(n)/(k*k*k))
	case n >= k*k:
		return fmt.Sprintf("%.1f MiB", float64(n)/(k*k))
	case n >= k:
		return fmt.Sprintf("%.1f KiB", float64(n)/k)
	}
	return fmt.Sprintf("%d B", n)
}

// invalidf returns an error of allocator name's operation op that wraps
// ErrInvalid.
func invalidf(name, op, format string, args ...any) error {
	return fmt.Errorf("device: %s: %s: %w: %s", name, op, ErrInvalid, fmt.Sprintf(format, args...))
}
