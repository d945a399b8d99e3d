package cuda

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/b7ea7098/loom/device"
)

// CUDA flag and status values (cuda.h).
const (
	streamNonBlocking  = 1   // CU_STREAM_NON_BLOCKING
	eventDisableTiming = 2   // CU_EVENT_DISABLE_TIMING
	errNotReady        = 600 // CUDA_ERROR_NOT_READY
	funcMaxDynamicSmem = 8   // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
)

// Stream is a CUDA stream of a [Context]: an ordered queue of kernels,
// copies and event records. [Context.NewStream] makes a non-blocking one
// (CU_STREAM_NON_BLOCKING: it does not wait for the legacy default stream,
// nor does that wait for it); [Context.Legacy] is the legacy default
// stream. Its methods may be called from any goroutine. It implements
// [device.Stream].
type Stream struct {
	ctx    *Context
	h      uintptr
	legacy bool
	closed atomic.Bool
	// afterSync, when set (by OpenDevice, on its compute stream, before
	// the stream is shared), runs after a successful Synchronize and its
	// error is returned: the device's reading of its kernels' checks.
	afterSync func() error
}

var _ device.Stream = (*Stream)(nil)

// NewStream creates a non-blocking stream (cuStreamCreate with
// CU_STREAM_NON_BLOCKING). Close it before the Context.
func (c *Context) NewStream() (*Stream, error) {
	s := &Stream{ctx: c}
	err := c.do("NewStream", func(d *driverFns) error {
		return c.lib.cuCheck("cuStreamCreate", d.cuStreamCreate(&s.h, streamNonBlocking), "creating a stream")
	})
	if err != nil {
		return nil, err
	}
	return s, nil
}

// Legacy returns the legacy default stream (the null CUstream), on which
// the synchronous copies ([CopyToDevice], [Context.CopyDtoD], ...) run.
// It waits for, and is waited for by, blocking streams only, so work on
// streams from [Context.NewStream] is ordered with it only through events
// or synchronisation. Closing it is a no-op.
func (c *Context) Legacy() *Stream { return &Stream{ctx: c, legacy: true} }

// Handle returns the CUstream (0 for the legacy stream), for libraries
// that take one (NCCL, cuBLAS).
func (s *Stream) Handle() uintptr { return s.h }

// Context returns the context the stream belongs to.
func (s *Stream) Context() *Context { return s.ctx }

// do runs f with the stream's context current, after checking that the
// stream is usable.
func (s *Stream) do(what string, f func(d *driverFns) error) error {
	if s == nil || s.ctx == nil {
		return fmt.Errorf("cuda: %s: %w: nil Stream", what, ErrInvalid)
	}
	if s.closed.Load() {
		return fmt.Errorf("cuda: %s: %w: Stream is closed", what, ErrInvalid)
	}
	return s.ctx.do(what, f)
}

// Synchronize blocks until all work queued on the stream has completed
// (cuStreamSynchronize) and returns the first asynchronous error.
func (s *Stream) Synchronize() error {
	err := s.do("Stream.Synchronize", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuStreamSynchronize", d.cuStreamSynchronize(s.h), "")
	})
	if err != nil || s.afterSync == nil {
		return err
	}
	return s.afterSync()
}

// Query reports whether all work queued on the stream has completed
// (cuStreamQuery), without blocking.
func (s *Stream) Query() (bool, error) {
	var done bool
	err := s.do("Stream.Query", func(d *driverFns) error {
		var err error
		done, err = s.ctx.lib.queryResult("cuStreamQuery", d.cuStreamQuery(s.h))
		return err
	})
	return done, err
}

// WaitEvent makes the work queued on s after this call wait for e, an
// *Event of the same context, without blocking the caller
// (cuStreamWaitEvent).
func (s *Stream) WaitEvent(e device.Event) error {
	return s.do("Stream.WaitEvent", func(d *driverFns) error {
		ev, err := s.ctx.event("Stream.WaitEvent", e)
		if err != nil {
			return err
		}
		return s.ctx.lib.cuCheck("cuStreamWaitEvent", d.cuStreamWaitEvent(s.h, ev.h, 0), "")
	})
}

// Close destroys the stream (cuStreamDestroy_v2); work already queued
// still completes. Closing twice, or closing the legacy stream, is a
// no-op.
func (s *Stream) Close() error {
	if s == nil || s.legacy || s.closed.Swap(true) {
		return nil
	}
	return s.ctx.do("Stream.Close", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuStreamDestroy_v2", d.cuStreamDestroy_v2(s.h), "")
	})
}

// Event is a CUDA event of a [Context]: a point in a stream's queue. It
// implements [device.Event]. Only events made with timing can measure
// time ([Event.Since]); the others are cheaper to record and wait for.
type Event struct {
	ctx    *Context
	h      uintptr
	timing bool
	closed atomic.Bool
}

var _ device.Event = (*Event)(nil)

// NewEvent creates an event (cuEventCreate), with timing or, when timing
// is false, with CU_EVENT_DISABLE_TIMING. Close it before the Context.
func (c *Context) NewEvent(timing bool) (*Event, error) {
	e := &Event{ctx: c, timing: timing}
	flags := uint32(0)
	if !timing {
		flags = eventDisableTiming
	}
	err := c.do("NewEvent", func(d *driverFns) error {
		return c.lib.cuCheck("cuEventCreate", d.cuEventCreate(&e.h, flags), "creating an event")
	})
	if err != nil {
		return nil, err
	}
	return e, nil
}

// Handle returns the CUevent.
func (e *Event) Handle() uintptr { return e.h }

// event checks that e is a live *Event of c.
func (c *Context) event(what string, e device.Event) (*Event, error) {
	ev, ok := e.(*Event)
	switch {
	case !ok || ev == nil:
		return nil, fmt.Errorf("cuda: %s: %w: event %T is not a CUDA event", what, ErrInvalid, e)
	case ev.ctx != c:
		return nil, fmt.Errorf("cuda: %s: %w: event of device %d used on device %d", what, ErrInvalid, ev.ctx.ordinal, c.ordinal)
	case ev.closed.Load():
		return nil, fmt.Errorf("cuda: %s: %w: Event is closed", what, ErrInvalid)
	}
	return ev, nil
}

// do runs f with the event's context current, after checking that the
// event is usable.
func (e *Event) do(what string, f func(d *driverFns) error) error {
	if e == nil || e.ctx == nil {
		return fmt.Errorf("cuda: %s: %w: nil Event", what, ErrInvalid)
	}
	if e.closed.Load() {
		return fmt.Errorf("cuda: %s: %w: Event is closed", what, ErrInvalid)
	}
	return e.ctx.do(what, f)
}

// Record places the event at the current end of s's queue
// (cuEventRecord); s is a *Stream of the same context.
func (e *Event) Record(s device.Stream) error {
	st, ok := s.(*Stream)
	if !ok || st == nil {
		return fmt.Errorf("cuda: Event.Record: %w: stream %T is not a CUDA stream", ErrInvalid, s)
	}
	if e != nil && st.ctx != e.ctx {
		return fmt.Errorf("cuda: Event.Record: %w: stream of another context", ErrInvalid)
	}
	if st.closed.Load() {
		return fmt.Errorf("cuda: Event.Record: %w: Stream is closed", ErrInvalid)
	}
	return e.do("Event.Record", func(d *driverFns) error {
		return e.ctx.lib.cuCheck("cuEventRecord", d.cuEventRecord(e.h, st.h), "")
	})
}

// Synchronize blocks until the event has completed (cuEventSynchronize).
// An event never recorded counts as completed.
func (e *Event) Synchronize() error {
	return e.do("Event.Synchronize", func(d *driverFns) error {
		return e.ctx.lib.cuCheck("cuEventSynchronize", d.cuEventSynchronize(e.h), "")
	})
}

// Query reports whether the event has completed (cuEventQuery), without
// blocking.
func (e *Event) Query() (bool, error) {
	var done bool
	err := e.do("Event.Query", func(d *driverFns) error {
		var err error
		done, err = e.ctx.lib.queryResult("cuEventQuery", d.cuEventQuery(e.h))
		return err
	})
	return done, err
}

// Since returns the device time from start's completion to e's
// (cuEventElapsedTime, about 0.5 µs resolution). Both must be timing
// events of the same context that have completed (a CUDA_ERROR_NOT_READY
// *Error otherwise).
func (e *Event) Since(start device.Event) (time.Duration, error) {
	if e == nil || e.ctx == nil {
		return 0, fmt.Errorf("cuda: Event.Since: %w: nil Event", ErrInvalid)
	}
	st, err := e.ctx.event("Event.Since", start)
	if err != nil {
		return 0, err
	}
	if !e.timing || !st.timing {
		return 0, fmt.Errorf("cuda: Event.Since: %w: an event made without timing cannot measure time", ErrInvalid)
	}
	var ms float32
	err = e.do("Event.Since", func(d *driverFns) error {
		return e.ctx.lib.cuCheck("cuEventElapsedTime", d.cuEventElapsedTime(&ms, st.h, e.h), "")
	})
	if err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Close destroys the event (cuEventDestroy_v2). Closing twice is a no-op.
func (e *Event) Close() error {
	if e == nil || e.closed.Swap(true) {
		return nil
	}
	return e.ctx.do("Event.Close", func(d *driverFns) error {
		return e.ctx.lib.cuCheck("cuEventDestroy_v2", d.cuEventDestroy_v2(e.h), "")
	})
}

// queryResult reads the CUresult of a query call: CUDA_SUCCESS is done,
// CUDA_ERROR_NOT_READY not yet, anything else an *Error.
func (l *Lib) queryResult(call string, res int32) (bool, error) {
	switch res {
	case 0:
		return true, nil
	case errNotReady:
		return false, nil
	}
	return false, l.cuCheck(call, res, "")
}

// Time returns the device time of the work f queues on s, between two
// timing events recorded on s before and after f (cuEventElapsedTime,
// about 0.5 µs resolution); it waits for that work. f's own error is
// returned as is.
func (s *Stream) Time(f func() error) (time.Duration, error) {
	if s == nil || s.ctx == nil {
		return 0, fmt.Errorf("cuda: Stream.Time: %w: nil Stream", ErrInvalid)
	}
	start, err := s.ctx.NewEvent(true)
	if err != nil {
		return 0, err
	}
	// A failure to destroy an event leaks a handle and is not worth
	// failing a timing that succeeded, so Close errors are dropped.
	defer func() { _ = start.Close() }()
	end, err := s.ctx.NewEvent(true)
	if err != nil {
		return 0, err
	}
	defer func() { _ = end.Close() }()
	if err := start.Record(s); err != nil {
		return 0, err
	}
	if err := f(); err != nil {
		return 0, err
	}
	if err := end.Record(s); err != nil {
		return 0, err
	}
	if err := end.Synchronize(); err != nil {
		return 0, err
	}
	return end.Since(start)
}

// CopyToDeviceAsync queues a copy of src into the start of dst on s
// (cuMemcpyHtoDAsync_v2). src is Go (pageable) memory, which the driver
// stages before the call returns, so src may be reused at once; the copy
// into dst happens in s's order. It returns an error when src does not
// fit.
func CopyToDeviceAsync[T Elem](s *Stream, dst Buffer, src []T) error {
	n := len(src) * int(unsafe.Sizeof(*new(T)))
	if n > dst.Bytes {
		return fmt.Errorf("cuda: CopyToDeviceAsync: %w: %d bytes into a %d-byte buffer", ErrInvalid, n, dst.Bytes)
	}
	if n == 0 {
		return nil
	}
	err := s.do("CopyToDeviceAsync", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuMemcpyHtoDAsync_v2",
			d.cuMemcpyHtoDAsync_v2(uint64(dst.Ptr), unsafe.Pointer(unsafe.SliceData(src)), uintptr(n), s.h),
			fmt.Sprintf("copying %d bytes to the device", n))
	})
	runtime.KeepAlive(src)
	return err
}

// CopyFromDeviceAsync copies the start of src into dst in s's order
// (cuMemcpyDtoHAsync_v2). dst is Go (pageable) memory, so the driver
// returns only once the copy, and the work queued on s before it, has
// completed. It returns an error when src is shorter than dst.
func CopyFromDeviceAsync[T Elem](s *Stream, dst []T, src Buffer) error {
	n := len(dst) * int(unsafe.Sizeof(*new(T)))
	if n > src.Bytes {
		return fmt.Errorf("cuda: CopyFromDeviceAsync: %w: %d bytes from a %d-byte buffer", ErrInvalid, n, src.Bytes)
	}
	if n == 0 {
		return nil
	}
	err := s.do("CopyFromDeviceAsync", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuMemcpyDtoHAsync_v2",
			d.cuMemcpyDtoHAsync_v2(unsafe.Pointer(unsafe.SliceData(dst)), uint64(src.Ptr), uintptr(n), s.h),
			fmt.Sprintf("copying %d bytes from the device", n))
	})
	runtime.KeepAlive(dst)
	return err
}

// Copy queues a copy of the first bytes bytes of src to dst on s
// (cuMemcpyDtoDAsync_v2).
func (s *Stream) Copy(dst, src Buffer, bytes int) error {
	if bytes < 0 || bytes > dst.Bytes || bytes > src.Bytes {
		return fmt.Errorf("cuda: Stream.Copy: %w: %d bytes from a %d-byte into a %d-byte buffer", ErrInvalid, bytes, src.Bytes, dst.Bytes)
	}
	if bytes == 0 {
		return nil
	}
	return s.do("Stream.Copy", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuMemcpyDtoDAsync_v2", d.cuMemcpyDtoDAsync_v2(uint64(dst.Ptr), uint64(src.Ptr), uintptr(bytes), s.h),
			fmt.Sprintf("copying %d bytes", bytes))
	})
}

// Memset8 queues setting the first n bytes of b to v on s
// (cuMemsetD8Async).
func (s *Stream) Memset8(b Buffer, v uint8, n int) error {
	if n < 0 || n > b.Bytes {
		return fmt.Errorf("cuda: Stream.Memset8: %w: %d bytes of a %d-byte buffer", ErrInvalid, n, b.Bytes)
	}
	if n == 0 {
		return nil
	}
	return s.do("Stream.Memset8", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuMemsetD8Async", d.cuMemsetD8Async(uint64(b.Ptr), v, uintptr(n), s.h),
			fmt.Sprintf("setting %d bytes", n))
	})
}

// Memset32 queues setting the first n 4-byte words of b to v on s
// (cuMemsetD32Async); b's address must be a multiple of 4. It fills
// float32 buffers with math.Float32bits(x).
func (s *Stream) Memset32(b Buffer, v uint32, n int) error {
	if n < 0 || n > b.Bytes/4 {
		return fmt.Errorf("cuda: Stream.Memset32: %w: %d words of a %d-byte buffer", ErrInvalid, n, b.Bytes)
	}
	if b.Ptr%4 != 0 {
		return fmt.Errorf("cuda: Stream.Memset32: %w: address %#x is not 4-byte aligned", ErrInvalid, uint64(b.Ptr))
	}
	if n == 0 {
		return nil
	}
	return s.do("Stream.Memset32", func(d *driverFns) error {
		return s.ctx.lib.cuCheck("cuMemsetD32Async", d.cuMemsetD32Async(uint64(b.Ptr), v, uintptr(n), s.h),
			fmt.Sprintf("setting %d words", n))
	})
}
