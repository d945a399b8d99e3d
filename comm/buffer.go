package comm

import (
	"fmt"
	"reflect"
	"unsafe"

	"github.com/b7ea7098/loom/internal/checked"
)

// Buffer is a typed span of memory that a collective reads or writes. Host
// memory is a *HostBuffer; a device backend supplies its own implementation,
// so callers hand either to the same functions.
type Buffer interface {
	// DType is the element type.
	DType() DType
	// Len is the length in elements.
	Len() int
	// Slice returns elements [lo, hi) as a Buffer over the same memory.
	// It panics if the bounds are out of range, like a Go slice expression.
	Slice(lo, hi int) Buffer
	// Device names where the memory lives: "host", or "cuda:N".
	Device() string
}

// Element is the set of Go element types that map onto a DType.
type Element interface {
	~float32 | ~float64 | ~int32 | ~int64 | ~uint8 | BFloat16Bits | Float16Bits
}

// HostBuffer is a Buffer in ordinary Go memory.
type HostBuffer struct {
	dtype DType
	bytes []byte
}

// Host wraps a Go slice as a HostBuffer without copying. The slice must not be
// resized while a collective uses it.
func Host[T Element](s []T) *HostBuffer {
	var zero T
	dt := dtypeOf(any(zero))
	if len(s) == 0 {
		return &HostBuffer{dtype: dt, bytes: []byte{}}
	}
	n := len(s) * int(unsafe.Sizeof(zero))
	return &HostBuffer{dtype: dt, bytes: unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), n)}
}

func dtypeOf(v any) DType {
	switch v.(type) {
	case BFloat16Bits:
		return BFloat16
	case Float16Bits:
		return Float16
	}
	switch reflect.TypeOf(v).Kind() {
	case reflect.Float32:
		return Float32
	case reflect.Float64:
		return Float64
	case reflect.Int32:
		return Int32
	case reflect.Int64:
		return Int64
	}
	return Uint8
}

// NewHostBuffer allocates a zeroed HostBuffer of n elements of type dt.
// Errors (an invalid dtype, a negative length, or n elements whose byte
// count overflows int) wrap ErrInvalid and are returned before anything
// is allocated.
func NewHostBuffer(dt DType, n int) (*HostBuffer, error) {
	if !dt.Valid() {
		return nil, fmt.Errorf("comm: NewHostBuffer: %w: invalid dtype %v", ErrInvalid, dt)
	}
	if n < 0 {
		return nil, fmt.Errorf("comm: NewHostBuffer: %w: negative buffer length %d", ErrInvalid, n)
	}
	bytes, ok := checked.Mul(n, dt.Size())
	if !ok {
		return nil, fmt.Errorf("comm: NewHostBuffer: %w: %d %v elements: the byte count overflows int", ErrInvalid, n, dt)
	}
	return HostBytes(dt, alignedBytes(bytes))
}

// alignedBytes allocates n bytes aligned for any element type.
func alignedBytes(n int) []byte {
	if n == 0 {
		return []byte{}
	}
	words := make([]uint64, n/8+min(n%8, 1)) // ceil(n/8) without forming n+7
	return unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), n)
}

// HostBytes wraps raw bytes as a HostBuffer of type dt. The length must be a
// multiple of the element size and the memory aligned to it; errors wrap
// ErrInvalid.
func HostBytes(dt DType, b []byte) (*HostBuffer, error) {
	if !dt.Valid() {
		return nil, fmt.Errorf("comm: HostBytes: %w: invalid dtype %v", ErrInvalid, dt)
	}
	if len(b)%dt.Size() != 0 {
		return nil, fmt.Errorf("comm: HostBytes: %w: %d bytes is not a whole number of %v elements", ErrInvalid, len(b), dt)
	}
	if len(b) > 0 && uintptr(unsafe.Pointer(&b[0]))%uintptr(dt.Size()) != 0 {
		return nil, fmt.Errorf("comm: HostBytes: %w: memory is not aligned for %v", ErrInvalid, dt)
	}
	return &HostBuffer{dtype: dt, bytes: b}, nil
}

// DType implements Buffer.
func (b *HostBuffer) DType() DType {
	if b == nil {
		return 0
	}
	return b.dtype
}

// Len implements Buffer.
// A nil *HostBuffer has length 0, so that a typed nil passed as a Buffer is
// reported by validation instead of crashing it.
func (b *HostBuffer) Len() int {
	if b == nil || !b.dtype.Valid() {
		return 0
	}
	return len(b.bytes) / b.dtype.Size()
}

// Device implements Buffer; it is always "host".
func (b *HostBuffer) Device() string { return "host" }

// Slice implements Buffer.
func (b *HostBuffer) Slice(lo, hi int) Buffer { return b.SliceHost(lo, hi) }

// SliceHost is Slice with a concrete result type.
func (b *HostBuffer) SliceHost(lo, hi int) *HostBuffer {
	s := b.dtype.Size()
	return &HostBuffer{dtype: b.dtype, bytes: b.bytes[lo*s : hi*s : hi*s]}
}

// Bytes returns the raw memory. Backends read and write through it.
func (b *HostBuffer) Bytes() []byte {
	if b == nil {
		return nil
	}
	return b.bytes
}

// Float32s views the buffer as []float32; it panics if the dtype differs.
func (b *HostBuffer) Float32s() []float32 { return view[float32](b, Float32) }

// Float64s views the buffer as []float64; it panics if the dtype differs.
func (b *HostBuffer) Float64s() []float64 { return view[float64](b, Float64) }

// Int32s views the buffer as []int32; it panics if the dtype differs.
func (b *HostBuffer) Int32s() []int32 { return view[int32](b, Int32) }

// Int64s views the buffer as []int64; it panics if the dtype differs.
func (b *HostBuffer) Int64s() []int64 { return view[int64](b, Int64) }

// Uint8s views the buffer as []uint8; it panics if the dtype differs.
func (b *HostBuffer) Uint8s() []uint8 { return view[uint8](b, Uint8) }

// BFloat16s views the buffer as bfloat16 bit patterns.
func (b *HostBuffer) BFloat16s() []BFloat16Bits { return view[BFloat16Bits](b, BFloat16) }

// Float16s views the buffer as binary16 bit patterns.
func (b *HostBuffer) Float16s() []Float16Bits { return view[Float16Bits](b, Float16) }

func view[T any](b *HostBuffer, want DType) []T {
	if b.dtype != want {
		panic(fmt.Sprintf("comm: %v buffer viewed as %v", b.dtype, want))
	}
	if len(b.bytes) == 0 {
		return []T{}
	}
	return unsafe.Slice((*T)(unsafe.Pointer(&b.bytes[0])), b.Len())
}

// IsNil reports whether b is nil or a nil pointer of a Buffer type.
func IsNil(b Buffer) bool {
	if b == nil {
		return true
	}
	v := reflect.ValueOf(b)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// Overlap describes how two host buffers share memory.
type Overlap int

// The ways two buffers can share memory.
const (
	Disjoint Overlap = iota // no common byte
	Same                    // identical start and length
	Partial                 // anything else
)

// HostOverlap reports how a and b share memory; empty buffers never overlap.
func HostOverlap(a, b *HostBuffer) Overlap {
	if len(a.bytes) == 0 || len(b.bytes) == 0 {
		return Disjoint
	}
	a0 := uintptr(unsafe.Pointer(&a.bytes[0]))
	b0 := uintptr(unsafe.Pointer(&b.bytes[0]))
	a1, b1 := a0+uintptr(len(a.bytes)), b0+uintptr(len(b.bytes))
	switch {
	case a1 <= b0 || b1 <= a0:
		return Disjoint
	case a0 == b0 && a1 == b1:
		return Same
	}
	return Partial
}

// ByteOffset returns the offset in bytes of inner's start within outer, and
// whether inner lies wholly inside outer.
func ByteOffset(outer, inner *HostBuffer) (int, bool) {
	if len(inner.bytes) == 0 {
		return 0, false
	}
	if len(outer.bytes) == 0 {
		return 0, false
	}
	o0 := uintptr(unsafe.Pointer(&outer.bytes[0]))
	i0 := uintptr(unsafe.Pointer(&inner.bytes[0]))
	if i0 < o0 || i0+uintptr(len(inner.bytes)) > o0+uintptr(len(outer.bytes)) {
		return 0, false
	}
	return int(i0 - o0), true
}

// HostBacked is a Buffer of a device whose memory the host can address
// directly, as the emulated device's (device/emu) and the host device's
// buffers are. HostView returns that memory as a *HostBuffer of the same
// dtype and length, so host backends (comm/local) run collectives on it
// in place. The caller orders the device's work around the collective
// (device.BeforeCollective): the view is plain memory, read and written
// while the collective runs.
type HostBacked interface {
	// HostView is the buffer's memory; it stays valid while the buffer
	// is.
	HostView() *HostBuffer
}

// HostView is b's memory when the host can address it: b itself when it
// is a *HostBuffer, its view when it is HostBacked, and nil otherwise
// (a CUDA buffer, or nil). Host backends run collectives on what it
// returns.
func HostView(b Buffer) *HostBuffer {
	switch h := b.(type) {
	case *HostBuffer:
		return h
	case HostBacked:
		return h.HostView()
	}
	return nil
}
