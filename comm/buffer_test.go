package comm_test

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

type myFloat float64 // a named type: Host accepts ~float64

func TestHostElementTypes(t *testing.T) {
	tests := []struct {
		name  string
		buf   *comm.HostBuffer
		dt    comm.DType
		n     int
		first byte // the first byte of the first element, little-endian
	}{
		{"float32", comm.Host([]float32{1, 2, 3}), comm.Float32, 3, 0x00},
		{"float64", comm.Host([]float64{1, 2}), comm.Float64, 2, 0x00},
		{"myFloat", comm.Host([]myFloat{1, 2, 3, 4}), comm.Float64, 4, 0x00},
		{"int32", comm.Host([]int32{0x11223344, 5}), comm.Int32, 2, 0x44},
		{"int64", comm.Host([]int64{7}), comm.Int64, 1, 0x07},
		{"uint8", comm.Host([]uint8{9, 8, 7, 6, 5}), comm.Uint8, 5, 0x09},
		{"bfloat16", comm.Host([]comm.BFloat16Bits{0x3f80, 0x4000}), comm.BFloat16, 2, 0x80},
		{"float16", comm.Host([]comm.Float16Bits{0x3c00, 0x4000, 0}), comm.Float16, 3, 0x00},
		{"empty float32", comm.Host([]float32{}), comm.Float32, 0, 0},
		{"nil int64", comm.Host([]int64(nil)), comm.Int64, 0, 0},
		{"empty float16", comm.Host([]comm.Float16Bits{}), comm.Float16, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := tc.buf
			if b.DType() != tc.dt || b.Len() != tc.n || b.Device() != "host" {
				t.Fatalf("DType=%v Len=%d Device=%q, want %v %d host", b.DType(), b.Len(), b.Device(), tc.dt, tc.n)
			}
			if len(b.Bytes()) != tc.n*tc.dt.Size() {
				t.Fatalf("len(Bytes) = %d, want %d", len(b.Bytes()), tc.n*tc.dt.Size())
			}
			if b.Bytes() == nil {
				t.Error("Bytes() is nil")
			}
			if tc.n > 0 && b.Bytes()[0] != tc.first {
				t.Errorf("first byte %#x, want %#x", b.Bytes()[0], tc.first)
			}
		})
	}
}

func TestHostAliasesTheSlice(t *testing.T) {
	s := []float32{1, 2, 3}
	b := comm.Host(s)
	b.Float32s()[1] = 42
	if s[1] != 42 {
		t.Errorf("write through Float32s not seen in the slice: %v", s)
	}
	s[2] = -1
	if b.Float32s()[2] != -1 {
		t.Errorf("write to the slice not seen through the buffer")
	}
	h := []comm.BFloat16Bits{0, 0}
	comm.Host(h).BFloat16s()[0] = comm.ToBFloat16(3)
	if h[0].Float32() != 3 {
		t.Errorf("bfloat16 write not aliased: %v", h)
	}
}

func TestNewHostBuffer(t *testing.T) {
	for _, dt := range comm.AllDTypes() {
		for _, n := range []int{0, 1, 7} {
			b, err := comm.NewHostBuffer(dt, n)
			if err != nil {
				t.Fatalf("NewHostBuffer(%v, %d): %v", dt, n, err)
			}
			if b.DType() != dt || b.Len() != n || len(b.Bytes()) != n*dt.Size() {
				t.Errorf("NewHostBuffer(%v, %d): DType=%v Len=%d bytes=%d", dt, n, b.DType(), b.Len(), len(b.Bytes()))
			}
			for i, x := range b.Bytes() {
				if x != 0 {
					t.Fatalf("byte %d is %d, not zeroed", i, x)
				}
			}
			// Aligned for 8-byte access whatever the type.
			if n > 0 {
				if off := addr(b.Bytes()) % 8; off != 0 {
					t.Errorf("NewHostBuffer(%v, %d) is %d bytes off 8-byte alignment", dt, n, off)
				}
			}
		}
	}
	errs := []struct {
		dt   comm.DType
		n    int
		want string
	}{
		{0, 4, "invalid dtype dtype(0)"},
		{42, 4, "invalid dtype dtype(42)"},
		{comm.Float32, -1, "negative buffer length -1"},
		// n·size used to wrap: 2^62 float32 to 0 bytes (an empty buffer of
		// length 0), MaxInt64 float64 to -8 (a panic in make).
		{comm.Float32, 1 << 62, "4611686018427387904 float32 elements: the byte count overflows int"},
		{comm.Float64, math.MaxInt64, "9223372036854775807 float64 elements: the byte count overflows int"},
	}
	for _, tc := range errs {
		b, err := comm.NewHostBuffer(tc.dt, tc.n)
		if err == nil || b != nil || !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewHostBuffer(%v, %d) = %v, %v; want ErrInvalid %q", tc.dt, tc.n, b, err, tc.want)
		}
	}
}

func TestHostBytes(t *testing.T) {
	base, err := comm.NewHostBuffer(comm.Uint8, 64) // 8-byte aligned
	if err != nil {
		t.Fatal(err)
	}
	raw := base.Bytes()
	tests := []struct {
		name    string
		dt      comm.DType
		b       []byte
		wantLen int
		wantErr string
	}{
		{"float32 aligned", comm.Float32, raw[4:20], 4, ""},
		{"float64 aligned", comm.Float64, raw[8:24], 2, ""},
		{"int64 at 4 is misaligned", comm.Int64, raw[4:20], 0, "not aligned for int64"},
		{"float32 at 2 is misaligned", comm.Float32, raw[2:10], 0, "not aligned for float32"},
		{"float16 at odd offset", comm.Float16, raw[1:3], 0, "not aligned for float16"},
		{"uint8 any offset", comm.Uint8, raw[3:6], 3, ""},
		{"bfloat16 even offset", comm.BFloat16, raw[2:8], 3, ""},
		{"length not a multiple", comm.Float32, raw[0:6], 0, "6 bytes is not a whole number of float32 elements"},
		{"int64 length 12", comm.Int64, raw[0:12], 0, "12 bytes is not a whole number of int64 elements"},
		{"empty misaligned is fine", comm.Float64, raw[3:3], 0, ""},
		{"nil", comm.Int32, nil, 0, ""},
		{"invalid dtype", 0, raw[0:8], 0, "invalid dtype"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := comm.HostBytes(tc.dt, tc.b)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error = %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if b.Len() != tc.wantLen || b.DType() != tc.dt {
				t.Errorf("Len=%d DType=%v, want %d %v", b.Len(), b.DType(), tc.wantLen, tc.dt)
			}
		})
	}
	// HostBytes does not copy.
	b, _ := comm.HostBytes(comm.Uint8, raw[10:12])
	b.Uint8s()[1] = 99
	if raw[11] != 99 {
		t.Error("HostBytes copied the memory")
	}
}

func mustPanic(t *testing.T, what, wantMsg string, f func()) {
	t.Helper()
	defer func() {
		t.Helper()
		r := recover()
		if r == nil {
			t.Errorf("%s did not panic", what)
			return
		}
		if wantMsg != "" && !strings.Contains(fmt.Sprint(r), wantMsg) {
			t.Errorf("%s panicked with %q, want %q", what, r, wantMsg)
		}
	}()
	f()
}

func TestSlice(t *testing.T) {
	s := []int64{0, 1, 2, 3, 4, 5}
	b := comm.Host(s)
	tests := []struct {
		lo, hi int
		ok     bool
	}{
		{0, 6, true}, {2, 4, true}, {3, 3, true}, {6, 6, true}, {0, 0, true},
		{-1, 2, false}, {0, 7, false}, {4, 3, false}, {7, 7, false},
	}
	for _, tc := range tests {
		name := fmt.Sprintf("[%d:%d]", tc.lo, tc.hi)
		if !tc.ok {
			mustPanic(t, "Slice"+name, "", func() { b.Slice(tc.lo, tc.hi) })
			mustPanic(t, "SliceHost"+name, "", func() { b.SliceHost(tc.lo, tc.hi) })
			continue
		}
		sub := b.Slice(tc.lo, tc.hi)
		if sub.Len() != tc.hi-tc.lo || sub.DType() != comm.Int64 || sub.Device() != "host" {
			t.Errorf("Slice%s: Len=%d DType=%v", name, sub.Len(), sub.DType())
		}
		hs := b.SliceHost(tc.lo, tc.hi)
		for i, v := range hs.Int64s() {
			if v != int64(tc.lo+i) {
				t.Errorf("SliceHost%s[%d] = %d", name, i, v)
			}
		}
	}
	// A slice shares memory, and appending to its bytes cannot clobber the
	// parent beyond hi.
	sub := b.SliceHost(1, 3)
	sub.Int64s()[0] = 100
	if s[1] != 100 {
		t.Error("SliceHost does not alias its parent")
	}
	if cap(sub.Bytes()) != 16 {
		t.Errorf("cap(SliceHost(1,3).Bytes()) = %d, want 16", cap(sub.Bytes()))
	}
	_ = append(sub.Bytes(), 0xff)
	if s[3] != 3 {
		t.Errorf("append to a slice's bytes overwrote the parent: %v", s)
	}
	// Slices of slices index from the sub-buffer's start.
	if v := b.SliceHost(2, 6).SliceHost(1, 2).Int64s()[0]; v != 3 {
		t.Errorf("nested slice [2:6][1:2] = %d, want 3", v)
	}
}

func TestTypedViews(t *testing.T) {
	views := map[comm.DType]func(*comm.HostBuffer) int{
		comm.Float32:  func(b *comm.HostBuffer) int { return len(b.Float32s()) },
		comm.Float64:  func(b *comm.HostBuffer) int { return len(b.Float64s()) },
		comm.Int32:    func(b *comm.HostBuffer) int { return len(b.Int32s()) },
		comm.Int64:    func(b *comm.HostBuffer) int { return len(b.Int64s()) },
		comm.Uint8:    func(b *comm.HostBuffer) int { return len(b.Uint8s()) },
		comm.BFloat16: func(b *comm.HostBuffer) int { return len(b.BFloat16s()) },
		comm.Float16:  func(b *comm.HostBuffer) int { return len(b.Float16s()) },
	}
	if len(views) != len(comm.AllDTypes()) {
		t.Fatal("a dtype has no view in the table")
	}
	for _, have := range comm.AllDTypes() {
		for _, n := range []int{0, 5} {
			b, err := comm.NewHostBuffer(have, n)
			if err != nil {
				t.Fatal(err)
			}
			for want, view := range views {
				if want == have {
					if got := view(b); got != n {
						t.Errorf("%v view of %d elements has length %d", want, n, got)
					}
					continue
				}
				mustPanic(t, fmt.Sprintf("%v view of a %v buffer", want, have),
					fmt.Sprintf("comm: %v buffer viewed as %v", have, want), func() { view(b) })
			}
		}
	}
	// Views of empty buffers are empty, not nil.
	b, _ := comm.NewHostBuffer(comm.Float64, 0)
	if b.Float64s() == nil {
		t.Error("empty view is nil")
	}
	// Views reinterpret the same bytes.
	f := comm.Host([]float32{1})
	if got := f.Bytes(); got[3] != 0x3f || got[2] != 0x80 {
		t.Errorf("float32 1 has bytes % x", got)
	}
}

func TestHostOverlap(t *testing.T) {
	x := comm.Host(make([]float32, 8))
	y := comm.Host(make([]float32, 8))
	same := comm.Host(x.Float32s()) // another HostBuffer over the same memory
	tests := []struct {
		name string
		a, b *comm.HostBuffer
		want comm.Overlap
	}{
		{"different arrays", x, y, comm.Disjoint},
		{"itself", x, x, comm.Same},
		{"another wrapper of the same memory", x, same, comm.Same},
		{"full slice", x, x.SliceHost(0, 8), comm.Same},
		{"adjacent blocks", x.SliceHost(0, 4), x.SliceHost(4, 8), comm.Disjoint},
		{"overlapping blocks", x.SliceHost(0, 5), x.SliceHost(4, 8), comm.Partial},
		{"inner block", x, x.SliceHost(2, 3), comm.Partial},
		{"same start, shorter", x, x.SliceHost(0, 7), comm.Partial},
		{"same end, later start", x, x.SliceHost(1, 8), comm.Partial},
		{"empty slice inside", x, x.SliceHost(3, 3), comm.Disjoint},
		{"both empty", x.SliceHost(3, 3), x.SliceHost(3, 3), comm.Disjoint},
		{"empty buffer", x, comm.Host([]float32{}), comm.Disjoint},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := comm.HostOverlap(tc.a, tc.b); got != tc.want {
				t.Errorf("HostOverlap(a, b) = %v, want %v", got, tc.want)
			}
			if got := comm.HostOverlap(tc.b, tc.a); got != tc.want {
				t.Errorf("HostOverlap(b, a) = %v, want %v", got, tc.want)
			}
		})
	}
	// Byte-level overlap across types: a uint8 buffer over one float32.
	u, _ := comm.HostBytes(comm.Uint8, x.Bytes()[3:5])
	if got := comm.HostOverlap(x.SliceHost(0, 1), u); got != comm.Partial {
		t.Errorf("one shared byte: %v, want Partial", got)
	}
	if got := comm.HostOverlap(x.SliceHost(1, 2), u); got != comm.Partial {
		t.Errorf("one shared byte at the other end: %v, want Partial", got)
	}
}

func TestByteOffset(t *testing.T) {
	x := comm.Host(make([]float64, 8))
	other := comm.Host(make([]float64, 8))
	tests := []struct {
		name         string
		outer, inner *comm.HostBuffer
		off          int
		ok           bool
	}{
		{"itself", x, x, 0, true},
		{"block at 2", x, x.SliceHost(2, 5), 16, true},
		{"last element", x, x.SliceHost(7, 8), 56, true},
		{"nested", x.SliceHost(2, 8), x.SliceHost(3, 4), 8, true},
		{"inner starts before outer", x.SliceHost(2, 8), x.SliceHost(1, 4), 0, false},
		{"inner ends past outer", x.SliceHost(0, 4), x.SliceHost(2, 5), 0, false},
		{"outer inside inner", x.SliceHost(2, 4), x, 0, false},
		{"another array", x, other, 0, false},
		{"empty inner", x, x.SliceHost(2, 2), 0, false},
		{"empty outer", x.SliceHost(2, 2), x.SliceHost(2, 3), 0, false},
	}
	for _, tc := range tests {
		off, ok := comm.ByteOffset(tc.outer, tc.inner)
		if off != tc.off || ok != tc.ok {
			t.Errorf("%s: ByteOffset = %d, %v; want %d, %v", tc.name, off, ok, tc.off, tc.ok)
		}
	}
}

func addr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
