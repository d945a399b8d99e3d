package comm_test

import (
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
)

// format describes a binary floating-point format for the reference rounding.
type format struct {
	prec int     // significand bits, including the implicit one
	emin int     // exponent of the smallest normal number
	max  float64 // largest finite value
}

var (
	bf16Format = format{prec: 8, emin: -126, max: math.Ldexp(255.0/128, 127)}
	f16Format  = format{prec: 11, emin: -14, max: 65504}
)

// refRound rounds the finite float32 x to the nearest value of f, ties to
// even, with gradual underflow and overflow to infinity, using float64
// arithmetic only (no bit manipulation of the formats under test).
func refRound(x float32, f format) float64 {
	v := float64(x)
	if v == 0 {
		return v
	}
	a := math.Abs(v)
	_, e := math.Frexp(a) // a = frac·2^e, frac in [0.5, 1): a's binade is e-1
	q := e - 1 - (f.prec - 1)
	if lo := f.emin - (f.prec - 1); q < lo {
		q = lo // subnormal range: fixed quantum
	}
	r := math.Ldexp(math.RoundToEven(math.Ldexp(a, -q)), q)
	if r > f.max {
		r = math.Inf(1)
	}
	return math.Copysign(r, v)
}

// refF16 decodes a binary16 bit pattern with float64 arithmetic.
func refF16(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e := int(h>>10) & 0x1f
	m := float64(h & 0x3ff)
	switch e {
	case 0x1f:
		if m != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	case 0:
		return sign * math.Ldexp(m, -24)
	}
	return sign * math.Ldexp(1+m/1024, e-15)
}

// refBF16 decodes a bfloat16 bit pattern with float64 arithmetic.
func refBF16(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e := int(h>>7) & 0xff
	m := float64(h & 0x7f)
	switch e {
	case 0xff:
		if m != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	case 0:
		return sign * math.Ldexp(m, -133)
	}
	return sign * math.Ldexp(1+m/128, e-127)
}

// sameFloat compares including the sign of zero; NaN equals NaN.
func sameFloat(a, b float64) bool {
	if math.IsNaN(a) || math.IsNaN(b) {
		return math.IsNaN(a) && math.IsNaN(b)
	}
	return a == b && math.Signbit(a) == math.Signbit(b)
}

func TestFloat16Exhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := comm.Float16Bits(i)
		w := h.Float32()
		if want := refF16(uint16(i)); !sameFloat(float64(w), want) {
			t.Fatalf("Float16Bits(%#04x).Float32() = %g, want %g", i, w, want)
		}
		back := comm.ToFloat16(w)
		isNaN := i&0x7c00 == 0x7c00 && i&0x3ff != 0
		if isNaN {
			if bi := uint16(back); bi&0x7c00 != 0x7c00 || bi&0x3ff == 0 {
				t.Fatalf("NaN %#04x narrowed to %#04x, not a NaN", i, bi)
			}
			if uint16(back)&0x8000 != uint16(i)&0x8000 {
				t.Fatalf("NaN %#04x lost its sign: %#04x", i, uint16(back))
			}
			continue
		}
		if back != h {
			t.Fatalf("round trip of %#04x gave %#04x", i, uint16(back))
		}
	}
}

func TestBFloat16Exhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := comm.BFloat16Bits(i)
		w := h.Float32()
		if want := refBF16(uint16(i)); !sameFloat(float64(w), want) {
			t.Fatalf("BFloat16Bits(%#04x).Float32() = %g, want %g", i, w, want)
		}
		back := comm.ToBFloat16(w)
		isNaN := i&0x7f80 == 0x7f80 && i&0x7f != 0
		if isNaN {
			if bi := uint16(back); bi&0x7f80 != 0x7f80 || bi&0x7f == 0 {
				t.Fatalf("NaN %#04x narrowed to %#04x, not a NaN", i, bi)
			}
			continue
		}
		if back != h {
			t.Fatalf("round trip of %#04x gave %#04x", i, uint16(back))
		}
	}
}

// roundingInputs returns random float32 values spread over every exponent,
// plus exact ties of both 16-bit formats and their float32 neighbours.
func roundingInputs() []float32 {
	r := rand.New(rand.NewPCG(1, 2))
	var xs []float32
	add := func(b uint32) {
		x := math.Float32frombits(b)
		if !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) {
			xs = append(xs, x)
		}
	}
	for range 200000 { // uniform bit patterns: every exponent, subnormals too
		add(r.Uint32())
	}
	for range 200000 { // concentrated on float16's range, exponents 96..145
		e := 96 + r.Uint32N(50)
		add(r.Uint32()&0x807fffff | e<<23)
	}
	for range 50000 { // ties: float16 drops 13 mantissa bits, bfloat16 16
		e := 96 + r.Uint32N(50)
		b := r.Uint32()&0x807fe000 | e<<23 | 0x1000
		add(b)
		add(b - 1)
		add(b + 1)
		b = r.Uint32()&0xffff0000 | 0x8000
		add(b)
		add(b - 1)
		add(b + 1)
	}
	for _, v := range []float32{
		0, float32(math.Copysign(0, -1)), 1, -1, 0.1, 65504, 65519, 65519.996, 65520, 65536, 1e10, -65520,
		math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32, 1e-40,
		0x1p-24, 0x1p-25, 0x1.000002p-25, 0x1.8p-24, 0x1.4p-24, 0x1.cp-24, 0x1p-14, 0x1.ffcp-15, 0x1.ffep-15, 0x1p-26,
		1 + 0x1p-11, 1 + 0x1p-11 + 0x1p-23, 1 + 0x3p-11, 1 + 0x1p-8, 1 + 0x3p-8,
	} {
		xs = append(xs, v)
	}
	return xs
}

func TestToFloat16Rounding(t *testing.T) {
	fails := 0
	for _, x := range roundingInputs() {
		got := float64(comm.ToFloat16(x).Float32())
		if want := refRound(x, f16Format); !sameFloat(got, want) {
			t.Errorf("ToFloat16(%g [%#08x]) = %g, want %g", x, math.Float32bits(x), got, want)
			if fails++; fails > 10 {
				t.FailNow()
			}
		}
	}
}

func TestToBFloat16Rounding(t *testing.T) {
	fails := 0
	for _, x := range roundingInputs() {
		got := float64(comm.ToBFloat16(x).Float32())
		if want := refRound(x, bf16Format); !sameFloat(got, want) {
			t.Errorf("ToBFloat16(%g [%#08x]) = %g, want %g", x, math.Float32bits(x), got, want)
			if fails++; fails > 10 {
				t.FailNow()
			}
		}
	}
}

func TestSixteenBitSpecialValues(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	tests := []struct {
		name string
		in   float32
		f16  uint16
		bf16 uint16
	}{
		{"zero", 0, 0x0000, 0x0000},
		{"negative zero", float32(math.Copysign(0, -1)), 0x8000, 0x8000},
		{"one", 1, 0x3c00, 0x3f80},
		{"minus two", -2, 0xc000, 0xc000},
		{"float16 max", 65504, 0x7bff, 0x4780},
		{"just below float16 overflow", 65519.996, 0x7bff, 0x4780},
		{"float16 overflow at 65520", 65520, 0x7c00, 0x4780},
		{"negative overflow", -65520, 0xfc00, 0xc780},
		{"+Inf", inf, 0x7c00, 0x7f80},
		{"-Inf", -inf, 0xfc00, 0xff80},
		{"float32 max", math.MaxFloat32, 0x7c00, 0x7f80},
		{"smallest float16 subnormal", 0x1p-24, 0x0001, 0x3380},
		{"half the smallest subnormal ties to zero", 0x1p-25, 0x0000, 0x3300},
		{"just above half the smallest subnormal", 0x1.000002p-25, 0x0001, 0x3300},
		{"1.5 subnormal ulps ties up to even", 0x1.8p-24, 0x0002, 0x33c0},
		{"2.5 subnormal ulps ties down to even", 0x1.4p-23, 0x0002, 0x3420},
		{"largest subnormal rounds up to min normal", 0x1.ffep-15, 0x0400, 0x3880},
		{"tie between 1 and next, to even", 1 + 0x1p-11, 0x3c00, 0x3f80},
		{"tie above odd, up to even", 1 + 0x3p-11, 0x3c02, 0x3f80},
		{"bfloat16 tie to even down", 1 + 0x1p-8, 0x3c04, 0x3f80},
		{"bfloat16 tie to even up", 1 + 0x3p-8, 0x3c0c, 0x3f82},
		{"float32 subnormal underflows float16", 1e-40, 0x0000, 0x0001},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := uint16(comm.ToFloat16(tc.in)); got != tc.f16 {
				t.Errorf("ToFloat16(%g) = %#04x, want %#04x", tc.in, got, tc.f16)
			}
			if got := uint16(comm.ToBFloat16(tc.in)); got != tc.bf16 {
				t.Errorf("ToBFloat16(%g) = %#04x, want %#04x", tc.in, got, tc.bf16)
			}
		})
	}
	for _, x := range []float32{nan, -nan, math.Float32frombits(0x7f800001), math.Float32frombits(0xff800001), math.Float32frombits(0x7fffffff)} {
		if h := comm.ToFloat16(x); !math.IsNaN(float64(h.Float32())) {
			t.Errorf("ToFloat16(NaN %#08x) = %#04x, not NaN", math.Float32bits(x), uint16(h))
		}
		if h := comm.ToBFloat16(x); !math.IsNaN(float64(h.Float32())) {
			t.Errorf("ToBFloat16(NaN %#08x) = %#04x, not NaN", math.Float32bits(x), uint16(h))
		}
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
	if len(tests) != len(comm.DTypes) {
		t.Fatalf("DTypes has %d entries, table %d", len(comm.DTypes), len(tests))
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if comm.DTypes[i] != tc.dt {
				t.Errorf("DTypes[%d] = %v, want %v", i, comm.DTypes[i], tc.dt)
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
