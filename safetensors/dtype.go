package safetensors

// DType is a safetensors element type, spelled as in the file header
// ("F32", "BF16", "I64", ...).
type DType string

// The element types this package reads and writes. Sub-byte types (F4, F6_*)
// are not supported and are rejected as unknown.
const (
	BOOL   DType = "BOOL"    // boolean, one byte (0 or 1)
	U8     DType = "U8"      // unsigned 8-bit integer
	I8     DType = "I8"      // signed 8-bit integer
	F8E5M2 DType = "F8_E5M2" // 8-bit float, 5 exponent and 2 mantissa bits
	F8E4M3 DType = "F8_E4M3" // 8-bit float, 4 exponent and 3 mantissa bits
	F8E8M0 DType = "F8_E8M0" // 8-bit power-of-two scale (exponent only)
	I16    DType = "I16"     // signed 16-bit integer
	U16    DType = "U16"     // unsigned 16-bit integer
	F16    DType = "F16"     // IEEE 754 binary16
	BF16   DType = "BF16"    // bfloat16: the upper half of a float32
	I32    DType = "I32"     // signed 32-bit integer
	U32    DType = "U32"     // unsigned 32-bit integer
	F32    DType = "F32"     // IEEE 754 binary32
	C64    DType = "C64"     // complex64: two float32, real part first
	F64    DType = "F64"     // IEEE 754 binary64
	I64    DType = "I64"     // signed 64-bit integer
	U64    DType = "U64"     // unsigned 64-bit integer
)

// DTypes returns every supported element type, smallest first.
func DTypes() []DType {
	return []DType{BOOL, U8, I8, F8E5M2, F8E4M3, F8E8M0, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64}
}

// Size returns the size of one element in bytes, or 0 for an unknown type.
func (d DType) Size() int {
	switch d {
	case BOOL, U8, I8, F8E5M2, F8E4M3, F8E8M0:
		return 1
	case I16, U16, F16, BF16:
		return 2
	case I32, U32, F32:
		return 4
	case C64, F64, I64, U64:
		return 8
	}
	return 0
}

// Valid reports whether d is a supported element type.
func (d DType) Valid() bool { return d.Size() > 0 }

// String returns the header spelling of d.
func (d DType) String() string { return string(d) }
