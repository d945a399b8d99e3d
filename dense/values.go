package dense

import (
	"fmt"
	"slices"

	"gorgonia.org/tensor"
)

// elem is an element type shared by gorgonia and loom's representations.
type elem interface {
	float32 | float64 | int64 | int32 | int16 | int8 | uint8 | uint16 | uint32 | uint64 | bool
}

// shapeOf returns d's shape, [] for a gorgonia scalar.
func shapeOf(d *tensor.Dense) []int {
	if d.IsScalar() {
		return []int{}
	}
	return slices.Clone([]int(d.Shape()))
}

// values returns a fresh row-major copy of d's elements, which are Ts, in
// logical order: views, transposes and column-major data are walked index
// by index.
func values[T elem](d *tensor.Dense, shape []int) ([]T, error) {
	n := 1
	for _, s := range shape {
		n *= s
	}
	vals := make([]T, 0, n)
	switch data := d.Data().(type) {
	case T: // scalar
		vals = append(vals, data)
	case []T:
		if !d.IsMaterializable() && !d.RequiresIterator() && d.DataOrder().IsRowMajor() && len(data) == n {
			return append(vals, data...), nil
		}
		idx := make([]int, len(shape))
		for range n {
			v, err := d.At(idx...)
			if err != nil {
				return nil, err
			}
			x, ok := v.(T)
			if !ok {
				return nil, fmt.Errorf("element %v has type %T", idx, v)
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
		return nil, fmt.Errorf("unexpected data of type %T", data)
	}
	if len(vals) != n {
		return nil, fmt.Errorf("tensor has %d elements, shape %v needs %d", len(vals), shape, n)
	}
	return vals, nil
}

// newDense wraps vals (row-major over shape; one value for shape []) as a
// tensor that owns them.
func newDense[T elem](shape []int, vals []T) *tensor.Dense {
	if len(shape) == 0 {
		return tensor.New(tensor.FromScalar(vals[0]))
	}
	return tensor.New(tensor.WithShape(slices.Clone(shape)...), tensor.WithBacking(vals))
}

// check rejects a nil tensor, one with a zero dim (gorgonia's Data panics
// on it) and a masked one, and returns d's shape.
func check(op string, d *tensor.Dense, what string) ([]int, error) {
	if d == nil {
		return nil, invalidf(op, "nil *tensor.Dense")
	}
	shape := shapeOf(d)
	if slices.Contains(shape, 0) {
		return nil, invalidf(op, "%s has the empty shape %v, which gorgonia.org/tensor cannot hold", what, shape)
	}
	if d.IsMasked() {
		return nil, invalidf(op, "%s is masked; masked tensors are not supported", what)
	}
	return shape, nil
}
