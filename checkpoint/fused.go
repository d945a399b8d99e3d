package checkpoint

import (
	"slices"
	"sort"
)

// Fused tensors. Tensor parallelism stores a fused projection (attention's
// q|k|v, a Linear with Chunks C) as [C, R, …] so that each rank holds
// matching slices of every chunk, while one rank, DDP and FSDP keep the
// fused [C·R, …] form; both hold the same elements in the same row-major
// order. A checkpoint saved in one form loads into the other: each
// chunk and each destination block is cut into pieces that are boxes of
// the finer [C, R, …] form, contiguous in their own memory, and the runs
// between them are computed there.

// fusedSplit returns the finer shape [C, R, …] when one of a and b is
// [C·R, …] and the other [C, R, …] (C ≥ 1, R ≥ 1), else nil.
func fusedSplit(a, b []int) []int {
	if len(a) == len(b)+1 {
		a, b = b, a
	}
	if len(b) != len(a)+1 || len(a) == 0 || b[0]*b[1] != a[0] || !slices.Equal(a[1:], b[2:]) {
		return nil
	}
	return b
}

// fusedPiece is a box of the finer form and where it starts, in elements, in
// the memory of the block it was cut from.
type fusedPiece struct {
	off, size []int
	at        int
}

// pieces cuts a block (offset off, size size) into boxes of the finer form
// fine: a block of the fused form [C·R, …] (fused set) becomes one box per
// chunk c it meets, each a slab of whole rows of the block (so contiguous
// in its memory); a block of the finer form is itself.
func pieces(fine []int, fused bool, off, size []int) []fusedPiece {
	if !fused {
		return []fusedPiece{{off, size, 0}}
	}
	R := fine[1]
	row := prod(size[1:])
	var out []fusedPiece
	a, b := off[0], off[0]+size[0]
	for c := a / R; c*R < b; c++ {
		lo, hi := max(a, c*R), min(b, (c+1)*R)
		if lo >= hi {
			continue
		}
		po := append([]int{c, lo - c*R}, off[1:]...)
		ps := append([]int{1, hi - lo}, size[1:]...)
		out = append(out, fusedPiece{po, ps, (lo - a) * row})
	}
	return out
}

// fusedRuns is runs for a chunk and a destination block of which one or
// both are in the fused form of fine, in source order.
func fusedRuns(fine []int, chunkFused, dstFused bool, co, cs, do, ds []int, es int) []run {
	var out []run
	for _, cp := range pieces(fine, chunkFused, co, cs) {
		for _, dp := range pieces(fine, dstFused, do, ds) {
			for _, r := range runs(cp.off, cp.size, dp.off, dp.size, es) {
				out = append(out, run{r.src + cp.at*es, r.dst + dp.at*es, r.n})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].src < out[j].src })
	return out
}
