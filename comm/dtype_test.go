package comm_test

import (
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/half"
)

// TestSixteenBitDelegates checks that comm's 16-bit conversions are
// internal/half's (tested there exhaustively against a float64 reference), on
// every bit pattern and on the float32 values on either side of each.
func TestSixteenBitDelegates(t *testing.T) {
	for i := range 1 << 16 {
		h := uint16(i)
		f16, bf16 := comm.Float16Bits(h).Float32(), comm.BFloat16Bits(h).Float32()
		if w := half.Float16ToFloat32(h); math.Float32bits(f16) != math.Float32bits(w) {
			t.Fatalf("Float16Bits(%#04x).Float32() = %#08x, half says %#08x", h, math.Float32bits(f16), math.Float32bits(w))
		}
		if w := half.BFloat16ToFloat32(h); math.Float32bits(bf16) != math.Float32bits(w) {
			t.Fatalf("BFloat16Bits(%#04x).Float32() = %#08x, half says %#08x", h, math.Float32bits(bf16), math.Float32bits(w))
		}
		for _, x := range []float32{f16, bf16, math.Nextafter32(f16, 0), math.Nextafter32(bf16, float32(math.Inf(1)))} {
			if got, want := uint16(comm.ToFloat16(x)), half.ToFloat16(x); got != want {
				t.Fatalf("ToFloat16(%#08x) = %#04x, half says %#04x", math.Float32bits(x), got, want)
			}
			if got, want := uint16(comm.ToBFloat16(x)), half.ToBFloat16(x); got != want {
				t.Fatalf("ToBFloat16(%#08x) = %#04x, half says %#04x", math.Float32bits(x), got, want)
			}
		}
	}
	// One value by hand, so that a wrapper that swapped the formats fails
	// even if half itself were wrong in the same way.
	if got := uint16(comm.ToFloat16(1)); got != 0x3c00 {
		t.Errorf("ToFloat16(1) = %#04x, want 0x3c00", got)
	}
	if got := uint16(comm.ToBFloat16(1)); got != 0x3f80 {
		t.Errorf("ToBFloat16(1) = %#04x, want 0x3f80", got)
	}
}

func TestDTypeTable(t *testing.T) {
	tests := []struct {
		dt      comm.DType
		size    int
		name    string
		isFloat bool
		aliases []string
	}{
		{comm.Float32, 4, "float32", true, []string{"f32", "float", "FLOAT32"}},
		{comm.Float64, 8, "float64", true, []string{"f64", "double", "Float64"}},
		{comm.BFloat16, 2, "bfloat16", true, []string{"bf16", "BF16"}},
		{comm.Float16, 2, "float16", true, []string{"f16", "half"}},
		{comm.Int32, 4, "int32", false, []string{"i32", "int"}},
		{comm.Int64, 8, "int64", false, []string{"i64"}},
		{comm.Uint8, 1, "uint8", false, []string{"u8", "byte"}},
	}
	if len(tests) != len(comm.AllDTypes()) {
		t.Fatalf("DTypes has %d entries, table %d", len(comm.AllDTypes()), len(tests))
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if comm.AllDTypes()[i] != tc.dt {
				t.Errorf("DTypes[%d] = %v, want %v", i, comm.AllDTypes()[i], tc.dt)
			}
			if got := tc.dt.Size(); got != tc.size {
				t.Errorf("Size = %d, want %d", got, tc.size)
			}
			if !tc.dt.Valid() {
				t.Error("not Valid")
			}
			if got := tc.dt.IsFloat(); got != tc.isFloat {
				t.Errorf("IsFloat = %v, want %v", got, tc.isFloat)
			}
			if got := tc.dt.String(); got != tc.name {
				t.Errorf("String = %q, want %q", got, tc.name)
			}
			for _, s := range append([]string{tc.name}, tc.aliases...) {
				got, err := comm.ParseDType(s)
				if err != nil || got != tc.dt {
					t.Errorf("ParseDType(%q) = %v, %v; want %v", s, got, err, tc.dt)
				}
			}
		})
	}
	for _, d := range []comm.DType{0, 8, 255} {
		if d.Valid() || d.Size() != 0 || d.IsFloat() {
			t.Errorf("DType(%d): Valid=%v Size=%d IsFloat=%v", d, d.Valid(), d.Size(), d.IsFloat())
		}
		if want := "dtype(" + strconv.Itoa(int(d)) + ")"; d.String() != want {
			t.Errorf("DType(%d).String() = %q, want %q", d, d.String(), want)
		}
	}
	for _, s := range []string{"", "float8", "int16", "complex64", "dtype(1)"} {
		d, err := comm.ParseDType(s)
		if err == nil {
			t.Errorf("ParseDType(%q) = %v, want an error", s, d)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, "unknown dtype") || !strings.Contains(msg, `"`+s+`"`) || !strings.Contains(msg, "bfloat16") {
			t.Errorf("ParseDType(%q) error %q does not name the input and the choices", s, msg)
		}
	}
}
