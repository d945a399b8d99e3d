package safetensors

import (
	"encoding/binary"
	"fmt"
	"slices"

	"gorgonia.org/tensor"
)

// FromDense copies a *tensor.Dense into a Tensor named name. Float32 and
// float64 tensors become F32 and F64; int64, int32, int16, int8, uint8,
// uint16, uint32, uint64 and bool become the matching integer types and
// BOOL. A gorgonia scalar becomes shape []. Views, transposed tensors and
// column-major tensors are read in logical row-major order. Masked tensors
// and other dtypes are an error.
func FromDense(name string, d *tensor.Dense) (Tensor, error) {
	if d == nil {
		return Tensor{}, invalidErr(name, "nil *tensor.Dense")
	}
	if d.IsMasked() {
		return Tensor{}, invalidErr(name, "masked tensors are not supported")
	}
	shape := slices.Clone([]int(d.Shape()))
	if d.IsScalar() {
		shape = []int{}
	}
	switch d.Dtype() {
	case tensor.Float32:
		return fromDense[float32](name, F32, shape, d)
	case tensor.Float64:
		return fromDense[float64](name, F64, shape, d)
	case tensor.Int64:
		return fromDense[int64](name, I64, shape, d)
	case tensor.Int32:
		return fromDense[int32](name, I32, shape, d)
	case tensor.Int16:
		return fromDense[int16](name, I16, shape, d)
	case tensor.Int8:
		return fromDense[int8](name, I8, shape, d)
	case tensor.Uint8:
		return fromDense[uint8](name, U8, shape, d)
	case tensor.Uint16:
		return fromDense[uint16](name, U16, shape, d)
	case tensor.Uint32:
		return fromDense[uint32](name, U32, shape, d)
	case tensor.Uint64:
		return fromDense[uint64](name, U64, shape, d)
	case tensor.Bool:
		return fromDense[bool](name, BOOL, shape, d)
	}
	return Tensor{}, invalidErr(name, fmt.Sprintf("unsupported gorgonia dtype %v", d.Dtype()))
}

// elem is an element type shared by gorgonia and safetensors.
type elem interface {
	float32 | float64 | int64 | int32 | int16 | int8 | uint8 | uint16 | uint32 | uint64 | bool
}

func fromDense[T elem](name string, dt DType, shape []int, d *tensor.Dense) (Tensor, error) {
	n, err := numel(shape)
	if err != nil {
		return Tensor{}, invalidErr(name, err.Error())
	}
	vals := make([]T, 0, n)
	switch data := d.Data().(type) {
	case T: // scalar
		vals = append(vals, data)
	case []T:
		if !d.IsMaterializable() && !d.RequiresIterator() && d.DataOrder().IsRowMajor() && len(data) == n {
			vals = append(vals, data...)
			break
		}
		// Views, transposes and column-major data: walk the logical
		// indices in row-major order.
		idx := make([]int, len(shape))
		for k := 0; k < n; k++ {
			v, err := d.At(idx...)
			if err != nil {
				return Tensor{}, invalidErr(name, err.Error())
			}
			x, ok := v.(T)
			if !ok {
				return Tensor{}, invalidErr(name, fmt.Sprintf("element %v has type %T", idx, v))
			}
			vals = append(vals, x)
			for a := len(idx) - 1; a >= 0; a-- {
				idx[a]++
				if idx[a] < shape[a] {
					break
				}
				idx[a] = 0
			}
		}
	default:
		return Tensor{}, invalidErr(name, fmt.Sprintf("unexpected data of type %T", data))
	}
	if len(vals) != n {
		return Tensor{}, invalidErr(name, fmt.Sprintf("tensor has %d elements, shape %v needs %d", len(vals), shape, n))
	}
	return Tensor{Name: name, DType: dt, Shape: shape, Data: encode(vals)}, nil
}

// ToDense decodes t into a new row-major *tensor.Dense that owns its data:
// F32 and F64 become float32 and float64, integer types and BOOL their Go
// equivalents. A shape [] becomes a gorgonia scalar. gorgonia cannot
// represent tensors with a zero dimension, so those are an error, as are
// F16 and BF16 (convert them first with t.Convert(F32)).
func ToDense(t Tensor) (*tensor.Dense, error) {
	n, err := t.elements()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, invalidErr(t.Name, fmt.Sprintf("gorgonia cannot hold the empty shape %v", t.Shape))
	}
	switch t.DType {
	case F32:
		return toDense[float32](t, n)
	case F64:
		return toDense[float64](t, n)
	case I64:
		return toDense[int64](t, n)
	case I32:
		return toDense[int32](t, n)
	case I16:
		return toDense[int16](t, n)
	case I8:
		return toDense[int8](t, n)
	case U8:
		return toDense[uint8](t, n)
	case U16:
		return toDense[uint16](t, n)
	case U32:
		return toDense[uint32](t, n)
	case U64:
		return toDense[uint64](t, n)
	case BOOL:
		return toDense[bool](t, n)
	case F16, BF16:
		return nil, invalidErr(t.Name, fmt.Sprintf("gorgonia has no %s type; use t.Convert(F32) first", t.DType))
	}
	return nil, invalidErr(t.Name, fmt.Sprintf("gorgonia has no %s type", t.DType))
}

func toDense[T elem](t Tensor, n int) (*tensor.Dense, error) {
	vals, err := decode[T](t.Data, n)
	if err != nil {
		return nil, invalidErr(t.Name, err.Error())
	}
	if len(t.Shape) == 0 {
		return tensor.New(tensor.FromScalar(vals[0])), nil
	}
	return tensor.New(tensor.WithShape(slices.Clone(t.Shape)...), tensor.WithBacking(vals)), nil
}

// encode returns vals as little-endian bytes (bool as one byte, 0 or 1).
func encode[T elem](vals []T) []byte {
	b, err := binary.Append(nil, binary.LittleEndian, vals)
	if err != nil { // unreachable: every elem type has a fixed size
		return nil
	}
	return b
}

// decode reads n little-endian values from data, which holds at least n
// values.
func decode[T elem](data []byte, n int) ([]T, error) {
	vals := make([]T, n)
	if _, err := binary.Decode(data, binary.LittleEndian, vals); err != nil {
		return nil, err
	}
	return vals, nil
}
