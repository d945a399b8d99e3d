package device

import (
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// hostDevice is the host: a comparable value without state, so that every
// Host() is the same device (==).
type hostDevice struct{}

// hostStream is the host's one stream. Host work runs on the caller's
// goroutine, so it has always completed.
type hostStream struct{}

// Host returns the host device: Go memory, with work done on the caller's
// goroutine when it is issued. Its Alloc returns buffers over a
// *comm.HostBuffer (HostView), its streams have always completed, its
// events measure host time, and Memory and Kernels are nil.
func Host() Device { return hostDevice{} }

func (hostDevice) Name() string       { return "host" }
func (hostDevice) Kind() Kind         { return KindHost }
func (hostDevice) Compute() Stream    { return hostStream{} }
func (hostDevice) Memory() *Allocator { return nil }
func (hostDevice) Kernels() Kernels   { return nil }
func (hostDevice) Synchronize() error { return nil }
func (hostDevice) Close() error       { return nil }

func (hostDevice) NewStream() (Stream, error) { return hostStream{}, nil }

func (hostDevice) NewEvent(bool) (Event, error) { return &hostEvent{}, nil }

// Alloc returns n zeroed elements of type dt in Go memory.
func (hostDevice) Alloc(dt comm.DType, n int) (Buffer, error) {
	h, err := comm.NewHostBuffer(dt, n)
	if err != nil {
		return nil, fmt.Errorf("device: host: Alloc: %w", err)
	}
	return &hostBuffer{h: h}, nil
}

// RecordStream has nothing to order: host work is done when issued.
func (hostDevice) RecordStream(b Buffer, s Stream) error {
	if _, ok := b.(*hostBuffer); !ok {
		return invalidf("host", "RecordStream", "a buffer of %s", deviceName(b))
	}
	return nil
}

func (hostDevice) CopyFromHost(dst Buffer, src *comm.HostBuffer) error {
	d, ok := dst.(*hostBuffer)
	if !ok {
		return invalidf("host", "CopyFromHost", "destination on %s", deviceName(dst))
	}
	return copyHost("CopyFromHost", d.h, src)
}

func (hostDevice) CopyToHost(dst *comm.HostBuffer, src Buffer) error {
	s, ok := src.(*hostBuffer)
	if !ok {
		return invalidf("host", "CopyToHost", "source on %s", deviceName(src))
	}
	return copyHost("CopyToHost", dst, s.h)
}

func (hostDevice) Copy(dst, src Buffer) error {
	d, ok1 := dst.(*hostBuffer)
	s, ok2 := src.(*hostBuffer)
	if !ok1 || !ok2 {
		return invalidf("host", "Copy", "buffers on %s and %s", deviceName(dst), deviceName(src))
	}
	return copyHost("Copy", d.h, s.h)
}

// copyHost copies src into dst after checking they match.
func copyHost(op string, dst, src *comm.HostBuffer) error {
	if err := CheckCopy("host", op, dst, src); err != nil {
		return err
	}
	copy(dst.Bytes(), src.Bytes())
	return nil
}

// CheckCopy returns an error wrapping ErrInvalid, naming device name and
// op, unless dst and src are non-nil buffers of one dtype and length.
// Devices call it before queueing a copy.
func CheckCopy(name, op string, dst, src comm.Buffer) error {
	switch {
	case comm.IsNil(dst) || comm.IsNil(src):
		return invalidf(name, op, "nil buffer")
	case dst.DType() != src.DType():
		return invalidf(name, op, "%v destination, %v source", dst.DType(), src.DType())
	case dst.Len() != src.Len():
		return invalidf(name, op, "destination of %d elements, source of %d", dst.Len(), src.Len())
	}
	return nil
}

// deviceName is b's device, for errors.
func deviceName(b comm.Buffer) string {
	if comm.IsNil(b) {
		return "nil"
	}
	return b.Device()
}

func (hostStream) WaitEvent(Event) error { return nil }
func (hostStream) Synchronize() error    { return nil }
func (hostStream) Query() (bool, error)  { return true, nil }

// hostEvent is a host event: Record stamps the time, since the work
// before it is done.
type hostEvent struct {
	mu       sync.Mutex
	at       time.Time
	recorded bool
}

func (e *hostEvent) Record(s Stream) error {
	if _, ok := s.(hostStream); !ok {
		return invalidf("host", "Event.Record", "a stream of another device")
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.at, e.recorded = time.Now(), true
	return nil
}

func (e *hostEvent) Synchronize() error   { return nil }
func (e *hostEvent) Query() (bool, error) { return true, nil }
func (e *hostEvent) Close() error         { return nil }

// Since is the host time between start's Record and e's.
func (e *hostEvent) Since(start Event) (time.Duration, error) {
	s, ok := start.(*hostEvent)
	if !ok {
		return 0, invalidf("host", "Event.Since", "start is an event of another device")
	}
	s.mu.Lock()
	sAt, sOK := s.at, s.recorded
	s.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if !sOK || !e.recorded {
		return 0, invalidf("host", "Event.Since", "an event that was never recorded")
	}
	return e.at.Sub(sAt), nil
}

// hostBuffer is a buffer of the host device.
type hostBuffer struct{ h *comm.HostBuffer }

func (b *hostBuffer) DType() comm.DType { return b.h.DType() }
func (b *hostBuffer) Len() int          { return b.h.Len() }
func (b *hostBuffer) Device() string    { return "host" }
func (b *hostBuffer) Owner() Device     { return Host() }

// HostView is the buffer's memory (comm.HostBacked), so that host
// collectives take it as it is.
func (b *hostBuffer) HostView() *comm.HostBuffer { return b.h }

// Slice returns elements [lo, hi) over the same memory.
func (b *hostBuffer) Slice(lo, hi int) comm.Buffer { return &hostBuffer{h: b.h.SliceHost(lo, hi)} }

// Ptr is the address of the first byte, 0 when empty.
func (b *hostBuffer) Ptr() uintptr {
	if by := b.h.Bytes(); len(by) > 0 {
		return uintptr(unsafe.Pointer(&by[0]))
	}
	return 0
}

// Free does nothing: the garbage collector owns host memory.
func (b *hostBuffer) Free() error { return nil }
