// Package half converts between float32 and the two 16-bit floating-point
// formats loom moves and stores: IEEE 754 binary16 ("float16", "half") and
// bfloat16 (the upper 16 bits of a float32). Values travel as their bit
// patterns in a uint16.
//
// Narrowing rounds to the nearest representable value, ties to even, the
// rounding of IEEE 754, CUDA's __float2half_rn and PyTorch's .half() and
// .bfloat16(). Float16 overflows to infinity and underflows gradually through
// its subnormals; bfloat16 has float32's exponent range, so it keeps float32's
// subnormals and overflows only when rounding carries past the largest
// finite value. Widening is exact. A NaN stays a NaN of the same sign: its
// payload's leading bits are kept and its quiet bit is set, as x86 F16C's
// vcvtps2ph does, so a quiet NaN survives a round trip bit for bit.
//
// The package is a leaf (standard library only) so that comm and safetensors
// share one conversion without importing each other.
package half

import "math"

// ToFloat16 rounds f to the nearest binary16 value, ties to even, and returns
// its bit pattern. Magnitudes of 65520 and above become infinity; magnitudes
// at or below 2^-25 become a zero of f's sign.
func ToFloat16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	switch {
	case exp == 0xff && mant != 0: // NaN: quiet, leading payload bits kept
		return sign | 0x7e00 | uint16(mant>>13)
	case exp == 0xff: // infinity
		return sign | 0x7c00
	case exp > 142: // |f| >= 2^16: overflow even before rounding
		return sign | 0x7c00
	case exp >= 113: // normal binary16 (exponent -14..15)
		h := uint32(exp-112)<<10 | mant>>13
		rest := mant & 0x1fff
		if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
			// A carry out of the mantissa increments the exponent, which is
			// the correctly rounded result, up to and including infinity
			// (0x7c00) for 65520 <= |f| < 65536.
			h++
		}
		return sign | uint16(h)
	case exp >= 102: // binary16 subnormal: value = h * 2^-24
		m := mant | 0x800000 // the implicit leading one
		shift := uint32(126 - exp)
		h := m >> shift
		rest := m & (1<<shift - 1)
		halfway := uint32(1) << (shift - 1)
		if rest > halfway || (rest == halfway && h&1 == 1) {
			h++ // may carry into the smallest normal, 0x0400: still correct
		}
		return sign | uint16(h)
	}
	return sign // below 2^-25 (float32 subnormals included): signed zero
}

// Float16ToFloat32 widens the binary16 bit pattern h to float32 exactly.
func Float16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f: // infinity or NaN, payload kept
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: every binary16 subnormal is a normal float32; shift the
	// leading one into the implicit position.
	e := uint32(113)
	for mant&0x400 == 0 {
		mant <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
}

// ToBFloat16 rounds f to the nearest bfloat16 value, ties to even, and returns
// its bit pattern. Finite values within half a bfloat16 step of the largest
// finite value round to infinity, as IEEE rounding requires.
func ToBFloat16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		// NaN: truncation alone could clear every payload bit and make an
		// infinity, so set the quiet bit.
		return uint16(b>>16) | 0x40
	}
	// Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even;
	// a carry into the exponent is the correctly rounded result.
	rounding := uint32(0x7fff) + (b>>16)&1
	return uint16((b + rounding) >> 16)
}

// BFloat16ToFloat32 widens the bfloat16 bit pattern h to float32 exactly.
func BFloat16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// RoundBFloat16s sets dst[i] to src[i] rounded to the nearest bfloat16
// value (ToBFloat16, ties to even) and widened back to float32: the inputs
// of a bfloat16 GEMM as float32 values, whose products are exact in
// float32 (8 + 8 significant bits), so that a float32 GEMM over them is a
// bfloat16 GEMM with float32 accumulation. dst may be src; it must be at
// least as long (the rest is left alone).
func RoundBFloat16s(dst, src []float32) {
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = BFloat16ToFloat32(ToBFloat16(v))
	}
}
