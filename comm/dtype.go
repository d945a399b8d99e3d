package comm

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/internal/half"
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

// AllDTypes returns every supported element type, in declaration order, in a
// new slice the caller may keep or modify.
func AllDTypes() []DType { return []DType{Float32, Float64, BFloat16, Float16, Int32, Int64, Uint8} }

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

// ToBFloat16 rounds f to the nearest bfloat16, ties to even. A NaN stays a
// NaN of the same sign, quietened.
func ToBFloat16(f float32) BFloat16Bits { return BFloat16Bits(half.ToBFloat16(f)) }

// Float32 widens a bfloat16 to float32 exactly.
func (h BFloat16Bits) Float32() float32 { return half.BFloat16ToFloat32(uint16(h)) }

// ToFloat16 rounds f to the nearest IEEE binary16, ties to even, with
// overflow to infinity (from 65520 up) and gradual underflow to subnormals.
// A NaN stays a NaN of the same sign, quietened.
func ToFloat16(f float32) Float16Bits { return Float16Bits(half.ToFloat16(f)) }

// Float32 widens a binary16 to float32 exactly.
func (h Float16Bits) Float32() float32 { return half.Float16ToFloat32(uint16(h)) }
