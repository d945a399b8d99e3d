package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/b7ea7098/loom/internal/half"
)

// Tensor is one named tensor: its element type, its shape and its raw
// little-endian, row-major bytes. A nil or empty Shape is a scalar (one
// element); a shape with a zero dimension holds no elements and no bytes.
type Tensor struct {
	// Name is the tensor's key in the file header.
	Name string
	// DType is the element type.
	DType DType
	// Shape lists the dimensions, outermost first.
	Shape []int
	// Data holds the elements, little-endian and row-major.
	Data []byte
}

// numel returns the number of elements of shape, or an error for a negative
// dimension or an element count that overflows.
func numel(shape []int) (int, error) {
	n := uint64(1)
	zero := false
	for _, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("negative dimension %d in shape %v", d, shape)
		}
		if d == 0 {
			zero = true
		}
	}
	if zero {
		return 0, nil
	}
	for _, d := range shape {
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt {
			return 0, fmt.Errorf("shape %v has too many elements", shape)
		}
		n = lo
	}
	return int(n), nil
}

// byteSize returns the number of data bytes a tensor of this dtype and shape
// needs.
func byteSize(dt DType, shape []int) (int, error) {
	size := dt.Size()
	if size == 0 {
		return 0, fmt.Errorf("unknown dtype %q", string(dt))
	}
	n, err := numel(shape)
	if err != nil {
		return 0, err
	}
	if n > math.MaxInt/size {
		return 0, fmt.Errorf("shape %v of %s is too large", shape, dt)
	}
	return n * size, nil
}

// elements checks that t's data matches its dtype and shape and returns its
// element count.
func (t Tensor) elements() (int, error) {
	want, err := byteSize(t.DType, t.Shape)
	if err != nil {
		return 0, invalidErr(t.Name, err.Error())
	}
	if len(t.Data) != want {
		return 0, invalidErr(t.Name, fmt.Sprintf("%s %v needs %d data bytes, have %d", t.DType, t.Shape, want, len(t.Data)))
	}
	return want / t.DType.Size(), nil
}

// Validate reports whether t can be written: its name is non-empty valid
// UTF-8 and not "__metadata__", its dtype is supported, no dimension is
// negative and Data holds exactly the bytes that dtype and shape need.
func (t Tensor) Validate() error {
	if msg := checkName(t.Name); msg != "" {
		return invalidErr(t.Name, msg)
	}
	_, err := t.elements()
	return err
}

// Float32s decodes the data as float32 values. F32 is copied; F16 and BF16
// are widened exactly; F64 is rounded to nearest. Other dtypes are an error.
func (t Tensor) Float32s() ([]float32, error) {
	n, err := t.elements()
	if err != nil {
		return nil, err
	}
	out := make([]float32, n)
	d := t.Data
	switch t.DType {
	case F32:
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(d[4*i:]))
		}
	case F16:
		for i := range out {
			out[i] = half.Float16ToFloat32(binary.LittleEndian.Uint16(d[2*i:]))
		}
	case BF16:
		for i := range out {
			out[i] = half.BFloat16ToFloat32(binary.LittleEndian.Uint16(d[2*i:]))
		}
	case F64:
		for i := range out {
			out[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(d[8*i:])))
		}
	default:
		return nil, invalidErr(t.Name, fmt.Sprintf("cannot decode %s as float32", t.DType))
	}
	return out, nil
}

// Float64s decodes the data as float64 values. F64 is copied; F32, F16 and
// BF16 are widened exactly. Other dtypes are an error.
func (t Tensor) Float64s() ([]float64, error) {
	if t.DType == F64 {
		n, err := t.elements()
		if err != nil {
			return nil, err
		}
		out := make([]float64, n)
		for i := range out {
			out[i] = math.Float64frombits(binary.LittleEndian.Uint64(t.Data[8*i:]))
		}
		return out, nil
	}
	switch t.DType {
	case F32, F16, BF16:
	default:
		return nil, invalidErr(t.Name, fmt.Sprintf("cannot decode %s as float64", t.DType))
	}
	f, err := t.Float32s()
	if err != nil {
		return nil, err
	}
	out := make([]float64, len(f))
	for i, v := range f {
		out[i] = float64(v)
	}
	return out, nil
}

// Int64s decodes the data of an integer or BOOL tensor as int64 values. A
// U64 value above math.MaxInt64 is an error.
func (t Tensor) Int64s() ([]int64, error) {
	n, err := t.elements()
	if err != nil {
		return nil, err
	}
	out := make([]int64, n)
	d := t.Data
	le := binary.LittleEndian
	switch t.DType {
	case I64:
		for i := range out {
			out[i] = int64(le.Uint64(d[8*i:]))
		}
	case U64:
		for i := range out {
			v := le.Uint64(d[8*i:])
			if v > math.MaxInt64 {
				return nil, invalidErr(t.Name, fmt.Sprintf("element %d (%d) overflows int64", i, v))
			}
			out[i] = int64(v)
		}
	case I32:
		for i := range out {
			out[i] = int64(int32(le.Uint32(d[4*i:])))
		}
	case U32:
		for i := range out {
			out[i] = int64(le.Uint32(d[4*i:]))
		}
	case I16:
		for i := range out {
			out[i] = int64(int16(le.Uint16(d[2*i:])))
		}
	case U16:
		for i := range out {
			out[i] = int64(le.Uint16(d[2*i:]))
		}
	case I8:
		for i := range out {
			out[i] = int64(int8(d[i]))
		}
	case U8, BOOL:
		for i := range out {
			out[i] = int64(d[i])
		}
	default:
		return nil, invalidErr(t.Name, fmt.Sprintf("cannot decode %s as int64", t.DType))
	}
	return out, nil
}

// FromFloat32s returns an F32 tensor holding a copy of v. The shape is
// cloned; a mismatch between len(v) and the shape is reported by Validate
// and Write.
func FromFloat32s(name string, shape []int, v []float32) Tensor {
	d := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(d[4*i:], math.Float32bits(x))
	}
	return Tensor{Name: name, DType: F32, Shape: slices.Clone(shape), Data: d}
}

// FromFloat64s returns an F64 tensor holding a copy of v.
func FromFloat64s(name string, shape []int, v []float64) Tensor {
	d := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(d[8*i:], math.Float64bits(x))
	}
	return Tensor{Name: name, DType: F64, Shape: slices.Clone(shape), Data: d}
}

// FromInt64s returns an I64 tensor holding a copy of v.
func FromInt64s(name string, shape []int, v []int64) Tensor {
	d := make([]byte, 8*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint64(d[8*i:], uint64(x))
	}
	return Tensor{Name: name, DType: I64, Shape: slices.Clone(shape), Data: d}
}

// Convert returns a copy of a floating-point tensor (F32, F64, F16, BF16) in
// another of those dtypes. Narrowing rounds to nearest, ties to even; a
// conversion from F64 to F16 or BF16 rounds through float32, as PyTorch does.
func (t Tensor) Convert(to DType) (Tensor, error) {
	out := Tensor{Name: t.Name, DType: to, Shape: slices.Clone(t.Shape)}
	switch to {
	case F32, F64, F16, BF16:
	default:
		return Tensor{}, invalidErr(t.Name, fmt.Sprintf("cannot convert to %s", to))
	}
	if t.DType == to {
		if _, err := t.elements(); err != nil {
			return Tensor{}, err
		}
		out.Data = slices.Clone(t.Data)
		if out.Data == nil {
			out.Data = []byte{}
		}
		return out, nil
	}
	if to == F64 {
		v, err := t.Float64s()
		if err != nil {
			return Tensor{}, err
		}
		out.Data = FromFloat64s("", nil, v).Data
		return out, nil
	}
	v, err := t.Float32s()
	if err != nil {
		return Tensor{}, err
	}
	switch to {
	case F32:
		out.Data = FromFloat32s("", nil, v).Data
	case F16:
		out.Data = make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(out.Data[2*i:], half.ToFloat16(x))
		}
	case BF16:
		out.Data = make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(out.Data[2*i:], half.ToBFloat16(x))
		}
	}
	return out, nil
}
