package half

import (
	"math"
	"math/rand/v2"
	"testing"
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
	// IEEE overflow: anything that rounds (with unbounded exponent) past the
	// largest finite value is infinity; r is exact in float64, so compare it.
	if r > f.max {
		r = math.Inf(1)
	}
	return math.Copysign(r, v)
}

// refDecode decodes a 16-bit pattern with expBits exponent bits using float64
// arithmetic only.
func refDecode(h uint16, expBits int) float64 {
	mantBits := 15 - expBits
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	bias := 1<<(expBits-1) - 1
	e := int(h>>mantBits) & (1<<expBits - 1)
	m := float64(h & (1<<mantBits - 1))
	switch e {
	case 1<<expBits - 1:
		if m != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	case 0:
		return sign * math.Ldexp(m, 1-bias-mantBits)
	}
	return sign * math.Ldexp(1+math.Ldexp(m, -mantBits), e-bias)
}

// sameFloat compares including the sign of zero; NaN equals NaN.
func sameFloat(a, b float64) bool {
	if math.IsNaN(a) || math.IsNaN(b) {
		return math.IsNaN(a) && math.IsNaN(b)
	}
	return a == b && math.Signbit(a) == math.Signbit(b)
}

// TestExhaustiveRoundTrip widens every one of the 65536 bit patterns of both
// formats, checks the float32 against an arithmetic decoding, and narrows it
// back: every non-NaN pattern returns unchanged, every NaN returns with only
// its quiet bit set (so a quiet NaN returns unchanged too).
func TestExhaustiveRoundTrip(t *testing.T) {
	formats := []struct {
		name    string
		expBits int
		quiet   uint16 // the quiet bit, the top mantissa bit
		widen   func(uint16) float32
		narrow  func(float32) uint16
	}{
		{"float16", 5, 0x0200, Float16ToFloat32, ToFloat16},
		{"bfloat16", 8, 0x0040, BFloat16ToFloat32, ToBFloat16},
	}
	for _, f := range formats {
		t.Run(f.name, func(t *testing.T) {
			for i := range 1 << 16 {
				h := uint16(i)
				w := f.widen(h)
				want := refDecode(h, f.expBits)
				if !sameFloat(float64(w), want) {
					t.Fatalf("widen(%#04x) = %g, want %g", h, w, want)
				}
				back := f.narrow(w)
				if math.IsNaN(want) {
					if back != h|f.quiet {
						t.Fatalf("NaN %#04x narrowed back to %#04x, want %#04x (quietened)", h, back, h|f.quiet)
					}
					continue
				}
				if back != h {
					t.Fatalf("round trip of %#04x gave %#04x", h, back)
				}
			}
		})
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
	xs = append(xs, []float32{
		0, float32(math.Copysign(0, -1)), 1, -1, 0.1, 65504, 65519, 65519.996, 65520, 65536, 1e10, -65520,
		math.MaxFloat32, -math.MaxFloat32, math.SmallestNonzeroFloat32, 1e-40,
		0x1p-24, 0x1p-25, 0x1.000002p-25, 0x1.8p-24, 0x1.4p-24, 0x1.cp-24, 0x1p-14, 0x1.ffcp-15, 0x1.ffep-15, 0x1p-26,
		1 + 0x1p-11, 1 + 0x1p-11 + 0x1p-23, 1 + 0x3p-11, 1 + 0x1p-8, 1 + 0x3p-8,
	}...)
	return xs
}

// TestRoundingAgainstReference checks narrowing of about a million float32
// values against float64 round-to-nearest-even.
func TestRoundingAgainstReference(t *testing.T) {
	formats := []struct {
		name    string
		f       format
		expBits int
		narrow  func(float32) uint16
	}{
		{"float16", f16Format, 5, ToFloat16},
		{"bfloat16", bf16Format, 8, ToBFloat16},
	}
	xs := roundingInputs()
	for _, f := range formats {
		t.Run(f.name, func(t *testing.T) {
			fails := 0
			for _, x := range xs {
				h := f.narrow(x)
				got := refDecode(h, f.expBits)
				if want := refRound(x, f.f); !sameFloat(got, want) {
					t.Errorf("narrow(%g [%#08x]) = %#04x (%g), want %g", x, math.Float32bits(x), h, got, want)
					if fails++; fails > 10 {
						t.FailNow()
					}
				}
			}
		})
	}
}

func TestSpecialValues(t *testing.T) {
	inf := float32(math.Inf(1))
	bits := math.Float32frombits
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
		{"float32 max rounds to bfloat16 infinity", math.MaxFloat32, 0x7c00, 0x7f80},
		{"bfloat16 max", bits(0x7f7f0000), 0x7c00, 0x7f7f},
		{"tie above bfloat16 max rounds to infinity", bits(0x7f7f8000), 0x7c00, 0x7f80},
		{"just below that tie stays finite", bits(0x7f7f7fff), 0x7c00, 0x7f7f},
		{"smallest float16 subnormal", 0x1p-24, 0x0001, 0x3380},
		{"half the smallest subnormal ties to zero", 0x1p-25, 0x0000, 0x3300},
		{"negative half the smallest subnormal: -0", -0x1p-25, 0x8000, 0xb300},
		{"just above half the smallest subnormal", 0x1.000002p-25, 0x0001, 0x3300},
		{"1.5 subnormal ulps ties up to even", 0x1.8p-24, 0x0002, 0x33c0},
		{"2.5 subnormal ulps ties down to even", 0x1.4p-23, 0x0002, 0x3420},
		{"largest float16 subnormal", 0x1.ff8p-15, 0x03ff, 0x3880},
		{"largest subnormal rounds up to min normal", 0x1.ffep-15, 0x0400, 0x3880},
		{"smallest float16 normal", 0x1p-14, 0x0400, 0x3880},
		{"tie between 1 and next, to even", 1 + 0x1p-11, 0x3c00, 0x3f80},
		{"tie above odd, up to even", 1 + 0x3p-11, 0x3c02, 0x3f80},
		{"bfloat16 tie to even down", 1 + 0x1p-8, 0x3c04, 0x3f80},
		{"bfloat16 tie to even up", 1 + 0x3p-8, 0x3c0c, 0x3f82},
		{"float32 subnormal underflows float16, kept by bfloat16", 1e-40, 0x0000, 0x0001},
		{"smallest float32 subnormal", bits(0x00000001), 0x0000, 0x0000},
		{"quiet NaN", bits(0x7fc00000), 0x7e00, 0x7fc0},
		{"negative quiet NaN", bits(0xffc00000), 0xfe00, 0xffc0},
		{"signalling NaN, low payload only: quietened", bits(0x7f800001), 0x7e00, 0x7fc0},
		{"NaN payload's leading bits kept", bits(0x7fa12345), 0x7f09, 0x7fe1},
		{"all-ones NaN", bits(0xffffffff), 0xffff, 0xffff},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := ToFloat16(tc.in); got != tc.f16 {
				t.Errorf("ToFloat16(%g [%#08x]) = %#04x, want %#04x", tc.in, math.Float32bits(tc.in), got, tc.f16)
			}
			if got := ToBFloat16(tc.in); got != tc.bf16 {
				t.Errorf("ToBFloat16(%g [%#08x]) = %#04x, want %#04x", tc.in, math.Float32bits(tc.in), got, tc.bf16)
			}
		})
	}
}

func TestRoundBFloat16s(t *testing.T) {
	src := []float32{1, 1 + 1.0/256, 1 + 3.0/256, -2.5e-3, float32(math.Inf(1)), 3.3895314e38}
	dst := make([]float32, len(src)+1)
	dst[len(src)] = 7
	RoundBFloat16s(dst, src)
	for i, v := range src {
		if want := BFloat16ToFloat32(ToBFloat16(v)); math.Float32bits(dst[i]) != math.Float32bits(want) {
			t.Errorf("RoundBFloat16s(%g) = %g, want %g", v, dst[i], want)
		}
	}
	// 1 + 2⁻⁸ is a tie between 1 and 1 + 2⁻⁷: even is 1.
	if dst[1] != 1 || dst[2] != 1+4.0/256 {
		t.Errorf("ties: %g, %g; want 1, %g", dst[1], dst[2], 1+4.0/256)
	}
	if dst[len(src)] != 7 {
		t.Errorf("the element past src changed to %g", dst[len(src)])
	}
	RoundBFloat16s(src, src) // in place
	if src[1] != 1 {
		t.Errorf("in place: %g, want 1", src[1])
	}
}
