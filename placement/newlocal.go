package placement

import (
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// NewLocal wraps this rank's block, given as a []float32 or []float64 in
// row-major order over spec.LocalShape(), as a DTensor without copying it
// and without communicating. Unlike FromLocal it needs no gorgonia tensor,
// so empty shards are plain empty slices. data's element type must match
// the spec's dtype and its length must be the product of the local shape
// (1 for a scalar). The DTensor takes ownership of data: the caller must
// not modify it afterwards. A Routed spec needs its row counts
// (WithRoutedRows): that is how the moe package builds Routed tensors.
// Errors wrap ErrInvalid (ErrUnsupported for Routed placements without row
// counts).
func NewLocal(spec *Spec, data any) (*DTensor, error) {
	const op = "NewLocal"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if spec.l.hasRouted() && spec.l.rows == nil {
		return nil, unsupportedf(op, "a Routed spec without row counts has no local shape (WithRoutedRows; the moe package's dispatch builds Routed tensors)")
	}
	want := spec.LocalShape()
	n := prod(want)
	var got int
	switch d := data.(type) {
	case []float32:
		if spec.l.dtype != comm.Float32 {
			return nil, invalidf(op, "data is []float32, the spec says %v", spec.l.dtype)
		}
		got = len(d)
	case []float64:
		if spec.l.dtype != comm.Float64 {
			return nil, invalidf(op, "data is []float64, the spec says %v", spec.l.dtype)
		}
		got = len(d)
	default:
		return nil, invalidf(op, "data is %T, want []float32 or []float64", data)
	}
	if got != n {
		return nil, invalidf(op, "data has %d elements, this rank's block %v of %s holds %d", got, want, spec, n)
	}
	return &DTensor{spec: spec, shape: slices.Clone(want), data: data}, nil
}
