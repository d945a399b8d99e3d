package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Indices is an int64 tensor laid out over a mesh: token ids for
// Embedding, class targets for CrossEntropy. It carries a global shape,
// one placement per mesh axis (Replicate or Shard only: integers are never
// partial) and this rank's local block in row-major order over the local
// shape, exactly like a DTensor's. Indices are not differentiable and live
// outside tapes. An Indices is immutable and belongs to the rank whose
// mesh it holds.
type Indices struct {
	spec *placement.Spec // the layout; its dtype is a placeholder (Float64)
	data []int64
}

// NewIndices wraps this rank's block local (row-major over the local shape
// the layout gives this rank, the torch.chunk rule of placement.Spec) of
// an index tensor of global shape shape with the given placements (and
// shard orders, placement.WithOrder). It does not copy local: the caller
// must not modify it afterwards. Errors wrap ErrInvalid.
func NewIndices(m *mesh.Mesh, shape []int, places []placement.Placement, local []int64, opts ...placement.SpecOption) (*Indices, error) {
	const op = "NewIndices"
	spec, err := indexSpec(op, m, shape, places, opts)
	if err != nil {
		return nil, err
	}
	if n := prod(spec.LocalShape()); len(local) != n {
		return nil, invalidf(op, "local block has %d elements; the layout %v gives this rank %v (%d elements)", len(local), places, spec.LocalShape(), n)
	}
	return &Indices{spec: spec, data: local}, nil
}

// IndicesFromFull lays out the global index tensor full (row-major over
// shape, the same on every rank) by places, keeping this rank's block. It
// does not communicate.
func IndicesFromFull(m *mesh.Mesh, shape []int, places []placement.Placement, full []int64, opts ...placement.SpecOption) (*Indices, error) {
	const op = "IndicesFromFull"
	spec, err := indexSpec(op, m, shape, places, opts)
	if err != nil {
		return nil, err
	}
	if len(full) != prod(shape) {
		return nil, invalidf(op, "full has %d elements for global shape %v", len(full), shape)
	}
	// The global index along every dim of each local position (a
	// load-balanced dim's block is two runs, not a box).
	size := spec.LocalShape()
	pos := make([][]int, len(shape))
	for d := range pos {
		if pos[d], err = spec.Positions(d, m.Rank()); err != nil {
			return nil, err
		}
	}
	local := make([]int64, 0, prod(size))
	for i := range prod(size) {
		c := unravel(i, size)
		g := 0
		for d := range c {
			g = g*shape[d] + pos[d][c[d]]
		}
		local = append(local, full[g])
	}
	return &Indices{spec: spec, data: local}, nil
}

func indexSpec(op string, m *mesh.Mesh, shape []int, places []placement.Placement, opts []placement.SpecOption) (*placement.Spec, error) {
	for ax, p := range places {
		if !p.IsReplicate() && !p.IsShard() {
			return nil, invalidf(op, "placement %d is %v; indices are Replicate or Shard only", ax, p)
		}
	}
	spec, err := placement.NewSpec(m, shape, comm.Float64, places, opts...)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return spec, nil
}

// valid reports whether ix was built by NewIndices or IndicesFromFull; the
// accessors of a nil or zero Indices return zero values instead of
// panicking, and ops reject it.
func (ix *Indices) valid() bool { return ix != nil && ix.spec != nil }

// Shape returns the global shape (nil for an invalid Indices).
func (ix *Indices) Shape() []int {
	if !ix.valid() {
		return nil
	}
	return ix.spec.Shape()
}

// Placements returns one placement per mesh axis.
func (ix *Indices) Placements() []placement.Placement {
	if !ix.valid() {
		return nil
	}
	return ix.spec.Placements()
}

// Order returns the mesh axes (by name) that shard dim, outer to inner.
func (ix *Indices) Order(dim int) []string {
	if !ix.valid() {
		return nil
	}
	return ix.spec.Order(dim)
}

// LocalShape returns the shape of this rank's block.
func (ix *Indices) LocalShape() []int {
	if !ix.valid() {
		return nil
	}
	return ix.spec.LocalShape()
}

// Local returns a copy of this rank's block.
func (ix *Indices) Local() []int64 {
	if ix == nil {
		return nil
	}
	return slices.Clone(ix.data)
}

// String describes the layout, e.g. "indices [4 8] on (dp=2): [S(0)]".
func (ix *Indices) String() string {
	if !ix.valid() {
		return "indices (invalid)"
	}
	return fmt.Sprintf("indices %v on %v: %v", ix.spec.Shape(), ix.spec.Mesh(), ix.spec.Placements())
}
