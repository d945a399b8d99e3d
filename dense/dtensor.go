package dense

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
	"gorgonia.org/tensor"
)

// ToDTensor distributes a gorgonia tensor that every rank holds in full,
// as placement.FromFull does with a slice: d must have spec's global shape
// (a gorgonia scalar for a 0-d spec) and its dtype, float32 or float64.
// Each rank copies its block; d is not retained. A spec with a zero global
// dim cannot be given a gorgonia tensor: use placement.FromFull with an
// empty slice. Errors wrap ErrInvalid, or are placement's.
func ToDTensor(spec *placement.Spec, d *tensor.Dense) (*placement.DTensor, error) {
	const op = "ToDTensor"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	shape, err := check(op, d, "the tensor")
	if err != nil {
		return nil, err
	}
	if want := spec.Shape(); !slices.Equal(shape, want) {
		return nil, invalidf(op, "the tensor has shape %v, the spec's global shape is %v", shape, want)
	}
	var full any
	switch {
	case d.Dtype() == tensor.Float32 && spec.DType() == comm.Float32:
		full, err = values[float32](d, shape)
	case d.Dtype() == tensor.Float64 && spec.DType() == comm.Float64:
		full, err = values[float64](d, shape)
	default:
		return nil, invalidf(op, "the tensor is %v, the spec says %v", d.Dtype(), spec.DType())
	}
	if err != nil {
		return nil, invalidf(op, "%v", err)
	}
	dt, err := placement.FromFull(spec, full)
	if err != nil {
		return nil, fmt.Errorf("dense: %s: %w", op, err)
	}
	return dt, nil
}

// FromDTensor materialises dt's global tensor on every rank, as
// DTensor.Full does, as a new row-major *tensor.Dense (a gorgonia scalar
// for a 0-d tensor). Every rank of the mesh must call it. A tensor with a
// zero global dim is an error wrapping ErrInvalid on every rank, before
// any communication, since gorgonia cannot hold it: use DTensor.Full.
func FromDTensor(ctx context.Context, dt *placement.DTensor) (*tensor.Dense, error) {
	const op = "FromDTensor"
	if dt == nil {
		return nil, invalidf(op, "nil DTensor")
	}
	shape := dt.Spec().Shape()
	if slices.Contains(shape, 0) {
		return nil, invalidf(op, "the global shape %v is empty, which gorgonia.org/tensor cannot hold; use DTensor.Full", shape)
	}
	full, err := dt.Full(ctx)
	if err != nil {
		return nil, fmt.Errorf("dense: %s: %w", op, err)
	}
	switch f := full.(type) {
	case []float32:
		return newDense(shape, f), nil
	case []float64:
		return newDense(shape, f), nil
	}
	return nil, invalidf(op, "DTensor data of type %T", full) // unreachable: specs are float32 or float64
}
