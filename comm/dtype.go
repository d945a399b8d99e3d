package comm

import (
	"fmt"
	"math"
	"strings"
)

// DType is the element type of a Buffer.
type DType uint8

// The element types every backend supports. 16-bit float reductions are
// computed in float32 and rounded once per reduction step.
const (
	Float32 DType = iota + 1
	Float64
	BFloat16
	Float16
	Int32
	Int64
	Uint8
)

// DTypes lists every supported element type, in declaration order.
var DTypes = []DType{Float32, Float64, BFloat16, Float16, Int32, Int64, Uint8}

// Size returns the size of one element in bytes, or 0 for an invalid DType.
func (d DType) Size() int {
	switch d {
	case Float32, Int32:
		return 4
	case Float64, Int64:
		return 8
	case BFloat16, Float16:
		return 2
	case Uint8:
		return 1
	}
	return 0
}

// Valid reports whether d is one of the supported element types.
func (d DType) Valid() bool { return d.Size() != 0 }

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool {
	return d == Float32 || d == Float64 || d == BFloat16 || d == Float16
}

// String returns the lower-case name used by flags and errors ("float32").
func (d DType) String() string {
	switch d {
	case Float32:
		return "float32"
	case Float64:
		return "float64"
	case BFloat16:
		return "bfloat16"
	case Float16:
		return "float16"
	case Int32:
		return "int32"
	case Int64:
		return "int64"
	case Uint8:
		return "uint8"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// ParseDType parses a DType name as printed by String; it also accepts the
// short forms f32, f64, bf16, f16, i32, i64 and u8.
func ParseDType(s string) (DType, error) {
	switch strings.ToLower(s) {
	case "float32", "f32", "float":
		return Float32, nil
	case "float64", "f64", "double":
		return Float64, nil
	case "bfloat16", "bf16":
		return BFloat16, nil
	case "float16", "f16", "half":
		return Float16, nil
	case "int32", "i32", "int":
		return Int32, nil
	case "int64", "i64":
		return Int64, nil
	case "uint8", "u8", "byte":
		return Uint8, nil
	}
	return 0, fmt.Errorf("comm: unknown dtype %q (want one of float32, float64, bfloat16, float16, int32, int64, uint8)", s)
}

// BFloat16Bits is one bfloat16 value: the upper 16 bits of a float32.
type BFloat16Bits uint16

// Float16Bits is one IEEE 754 binary16 value.
type Float16Bits uint16

// ToBFloat16 rounds f to the nearest bfloat16, ties to even. NaN stays NaN.
func ToBFloat16(f float32) BFloat16Bits {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet and non-zero
		return BFloat16Bits(b>>16 | 0x40)
	}
	rounding := uint32(0x7fff) + (b>>16)&1
	return BFloat16Bits((b + rounding) >> 16)
}

// Float32 widens a bfloat16 to float32 exactly.
func (h BFloat16Bits) Float32() float32 { return math.Float32frombits(uint32(h) << 16) }

// ToFloat16 rounds f to the nearest IEEE binary16, ties to even, with
// overflow to infinity and gradual underflow to subnormals.
func ToFloat16(f float32) Float16Bits {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	switch {
	case exp == 0xff: // Inf or NaN
		if mant != 0 {
			return Float16Bits(sign | 0x7e00)
		}
		return Float16Bits(sign | 0x7c00)
	case exp > 142: // |f| >= 65520 after rounding: overflow
		return Float16Bits(sign | 0x7c00)
	case exp >= 113: // normal half
		h := uint32(exp-112)<<10 | mant>>13
		rest := mant & 0x1fff
		if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
			h++ // may carry into the exponent, which is still correct
		}
		return Float16Bits(uint32(sign) | h)
	case exp >= 102: // subnormal half
		m := mant | 0x800000
		shift := uint32(126 - exp)
		h := m >> shift
		rest := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rest > half || (rest == half && h&1 == 1) {
			h++
		}
		return Float16Bits(uint32(sign) | h)
	}
	return Float16Bits(sign) // underflow to signed zero
}

// Float32 widens a binary16 to float32 exactly.
func (h Float16Bits) Float32() float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+112)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: normalise.
	e := uint32(113)
	for mant&0x400 == 0 {
		mant <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
}
