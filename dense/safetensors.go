package dense

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/b7ea7098/loom/safetensors"
	"gorgonia.org/tensor"
)

// ToSafetensor copies a gorgonia tensor into a safetensors.Tensor named
// name. Float32 and float64 tensors become F32 and F64; int64, int32,
// int16, int8, uint8, uint16, uint32, uint64 and bool become the matching
// integer types and BOOL. A gorgonia scalar becomes shape []. Errors wrap
// ErrInvalid: a nil, empty or masked tensor, or another dtype.
func ToSafetensor(name string, d *tensor.Dense) (safetensors.Tensor, error) {
	const op = "ToSafetensor"
	shape, err := check(op, d, fmt.Sprintf("tensor %q", name))
	if err != nil {
		return safetensors.Tensor{}, err
	}
	switch d.Dtype() {
	case tensor.Float32:
		return toSafetensor[float32](name, safetensors.F32, shape, d)
	case tensor.Float64:
		return toSafetensor[float64](name, safetensors.F64, shape, d)
	case tensor.Int64:
		return toSafetensor[int64](name, safetensors.I64, shape, d)
	case tensor.Int32:
		return toSafetensor[int32](name, safetensors.I32, shape, d)
	case tensor.Int16:
		return toSafetensor[int16](name, safetensors.I16, shape, d)
	case tensor.Int8:
		return toSafetensor[int8](name, safetensors.I8, shape, d)
	case tensor.Uint8:
		return toSafetensor[uint8](name, safetensors.U8, shape, d)
	case tensor.Uint16:
		return toSafetensor[uint16](name, safetensors.U16, shape, d)
	case tensor.Uint32:
		return toSafetensor[uint32](name, safetensors.U32, shape, d)
	case tensor.Uint64:
		return toSafetensor[uint64](name, safetensors.U64, shape, d)
	case tensor.Bool:
		return toSafetensor[bool](name, safetensors.BOOL, shape, d)
	}
	return safetensors.Tensor{}, invalidf(op, "tensor %q: unsupported gorgonia dtype %v", name, d.Dtype())
}

func toSafetensor[T elem](name string, dt safetensors.DType, shape []int, d *tensor.Dense) (safetensors.Tensor, error) {
	vals, err := values[T](d, shape)
	if err != nil {
		return safetensors.Tensor{}, invalidf("ToSafetensor", "tensor %q: %v", name, err)
	}
	b, err := binary.Append(nil, binary.LittleEndian, vals)
	if err != nil { // unreachable: every elem type has a fixed size
		return safetensors.Tensor{}, invalidf("ToSafetensor", "tensor %q: %v", name, err)
	}
	return safetensors.Tensor{Name: name, DType: dt, Shape: shape, Data: b}, nil
}

// FromSafetensor decodes t into a new row-major *tensor.Dense that owns its
// data: F32 and F64 become float32 and float64, integer types and BOOL
// their Go equivalents, and shape [] a gorgonia scalar. Errors wrap
// ErrInvalid: a shape with a zero dim (gorgonia cannot hold it: decode
// such a tensor with t.Float32s or t.Float64s), data whose length does not
// match the dtype and shape, and F16, BF16 (convert them first with
// t.Convert(safetensors.F32)) and other dtypes gorgonia lacks.
func FromSafetensor(t safetensors.Tensor) (*tensor.Dense, error) {
	const op = "FromSafetensor"
	n, err := numel(t.Shape)
	if err != nil {
		return nil, invalidf(op, "tensor %q: %v", t.Name, err)
	}
	if n == 0 {
		return nil, invalidf(op, "tensor %q has the empty shape %v, which gorgonia.org/tensor cannot hold", t.Name, t.Shape)
	}
	if size := t.DType.Size(); size > 0 && (n > math.MaxInt/size || len(t.Data) != n*size) {
		return nil, invalidf(op, "tensor %q: %s %v needs %d data bytes, have %d", t.Name, t.DType, t.Shape, n*size, len(t.Data))
	}
	switch t.DType {
	case safetensors.F32:
		return fromSafetensor[float32](t, n)
	case safetensors.F64:
		return fromSafetensor[float64](t, n)
	case safetensors.I64:
		return fromSafetensor[int64](t, n)
	case safetensors.I32:
		return fromSafetensor[int32](t, n)
	case safetensors.I16:
		return fromSafetensor[int16](t, n)
	case safetensors.I8:
		return fromSafetensor[int8](t, n)
	case safetensors.U8:
		return fromSafetensor[uint8](t, n)
	case safetensors.U16:
		return fromSafetensor[uint16](t, n)
	case safetensors.U32:
		return fromSafetensor[uint32](t, n)
	case safetensors.U64:
		return fromSafetensor[uint64](t, n)
	case safetensors.BOOL:
		return fromSafetensor[bool](t, n)
	case safetensors.F16, safetensors.BF16:
		return nil, invalidf(op, "tensor %q: gorgonia has no %s type; use t.Convert(safetensors.F32) first", t.Name, t.DType)
	}
	return nil, invalidf(op, "tensor %q: gorgonia has no %s type", t.Name, t.DType)
}

func fromSafetensor[T elem](t safetensors.Tensor, n int) (*tensor.Dense, error) {
	vals := make([]T, n)
	if _, err := binary.Decode(t.Data, binary.LittleEndian, vals); err != nil {
		return nil, invalidf("FromSafetensor", "tensor %q: %v", t.Name, err)
	}
	return newDense(t.Shape, vals), nil
}

// numel returns the number of elements of shape, or an error for a
// negative dim or a count that overflows an int.
func numel(shape []int) (int, error) {
	for _, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("negative dimension %d in shape %v", d, shape)
		}
	}
	if slices.Contains(shape, 0) {
		return 0, nil
	}
	n := uint64(1)
	for _, d := range shape {
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt {
			return 0, fmt.Errorf("shape %v has too many elements", shape)
		}
		n = lo
	}
	return int(n), nil
}
