package placement

import "slices"

// NewLocal wraps this rank's block, given as a []float32 or []float64 (the
// spec's dtype) in row-major order over spec.LocalShape(), as a DTensor
// without copying it and without communicating. An empty block is an empty
// slice (nil is accepted too); a scalar is one element. The DTensor takes
// ownership of data: the caller must not modify it afterwards. A Routed
// spec needs its row counts (WithRoutedRows): that is how the moe package
// builds Routed tensors. FromLocal copies the block and can check that the
// ranks agree. Errors wrap ErrInvalid (ErrUnsupported for Routed
// placements without row counts).
func NewLocal(spec *Spec, data any) (*DTensor, error) {
	const op = "NewLocal"
	if spec == nil {
		return nil, invalidf(op, "nil spec")
	}
	if spec.l.hasRouted() && spec.l.rows == nil {
		return nil, unsupportedf(op, "a Routed spec without row counts has no local shape (WithRoutedRows; the moe package's dispatch builds Routed tensors)")
	}
	want := spec.LocalShape()
	if data == nil && prod(want) == 0 {
		data = zeroData(spec.l.dtype, 0)
	}
	if err := checkData(op, data, spec.l.dtype, want, "local"); err != nil {
		return nil, err
	}
	if prod(want) == 0 {
		data = zeroData(spec.l.dtype, 0) // a typed nil slice becomes empty
	}
	return &DTensor{spec: spec, shape: slices.Clone(want), data: data}, nil
}
