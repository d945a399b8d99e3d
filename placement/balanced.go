package placement

// Positions returns the global index along tensor dim of each position of
// dim in the block held by mesh rank meshRank, in the block's order: the
// position ids of a sequence shard, the rows a data loader must deliver.
// Errors wrap ErrInvalid (a dim out of range, a mesh rank not in the mesh)
// or ErrUnsupported (a Routed spec without row counts).
func (s *Spec) Positions(dim, meshRank int) ([]int, error) {
	if dim < 0 || dim >= len(s.l.shape) {
		return nil, invalidf("Positions", "dim %d out of range for a %d-d tensor", dim, len(s.l.shape))
	}
	off, size, err := s.Box(meshRank)
	if err != nil {
		return nil, err
	}
	out := make([]int, size[dim])
	for i := range out {
		out[i] = off[dim] + i
	}
	return out, nil
}
