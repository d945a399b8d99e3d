package placement

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

// Causal load balancing: ShardBalanced(d) on a mesh axis of k ranks
// splits dim d into 2·k chunks and gives rank r chunks r and 2k−1−r, so
// under a causal mask every rank does the same attention work.
//
// The layout is a plain Shard in permuted coordinates: dim d is first put
// in the order chunk 0, chunk 2k−1, chunk 1, chunk 2k−2, … (the zigzag),
// then chunked by the torch.chunk rule, so rank r's block is exactly its
// Shard block in the permuted order. Every box, plan step and collective
// of the other placements therefore works unchanged between layouts with
// the same permutation; a redistribution between layouts whose
// permutations differ gathers the dims concerned, reorders them locally
// (StepPermute) and shards them again. Rank r's chunks are
// ceil(s/2) and floor(s/2) rows for its torch.chunk share s, so any
// length is exact (uneven chunks); Positions gives the global index of
// every local row.

// ShardBalanced is Shard(dim) with causal load balancing: dim is split
// into 2·k chunks over the axis's k ranks and rank r holds chunks r and
// 2k−1−r, in that order (see Positions). The axis must be the outermost
// of the axes sharding dim; inner axes split each rank's two-chunk block
// by the chunk rule. Box refuses such specs (a block is two runs of the
// dim); Positions, FromFull, Full and Redistribute follow the layout.
func ShardBalanced(dim int) Placement { return Placement{kind: KindShard, dim: dim, bal: true} }

// IsBalanced reports whether p is ShardBalanced.
func (p Placement) IsBalanced() bool { return p.kind == KindShard && p.bal }

// WithDim returns the Shard placement p moved to tensor dim d, balanced
// if p is: what a rule that renumbers dims (a transpose, a reduction)
// gives its result, so that no rule drops the balancing by building a
// plain Shard. On a placement other than Shard it returns p.
func (p Placement) WithDim(d int) Placement {
	if p.kind != KindShard {
		return p
	}
	p.dim = d
	return p
}

// zigzag returns, for dim length n over k ranks, the natural index of
// every permuted position (see ShardBalanced).
func zigzag(n, k int) []int {
	perm := make([]int, n)
	a, b := make([]int, k), make([]int, k)
	total := 0
	for r := range k {
		_, s := chunk(n, k, r)
		a[r], b[r] = (s+1)/2, s/2
		total += a[r]
	}
	startA, startB := 0, total
	for r := k - 1; r > 0; r-- {
		startB += b[r]
	}
	for r := range k {
		off, _ := chunk(n, k, r)
		for i := range a[r] {
			perm[off+i] = startA + i
		}
		for j := range b[r] {
			perm[off+a[r]+j] = startB + j
		}
		startA += a[r]
		if r+1 < k {
			startB -= b[r+1]
		}
	}
	return perm
}

// permKs returns, per tensor dim, the size of the balanced axis that
// permutes it (0 for none: no balanced axis, or one of size 1).
func (l *layout) permKs() []int {
	ks := make([]int, len(l.shape))
	for a, p := range l.places {
		if p.IsBalanced() && l.mshape[a] > 1 {
			ks[p.dim] = l.mshape[a]
		}
	}
	return ks
}

// hasPerm reports whether some dim is permuted.
func (l *layout) hasPerm() bool {
	return slices.ContainsFunc(l.permKs(), func(k int) bool { return k > 0 })
}

// checkBalanced checks that every balanced axis is the outermost of its
// dim's axes.
func (l *layout) checkBalanced() error {
	for a, p := range l.places {
		if p.IsBalanced() && l.order[p.dim][0] != a {
			return fmt.Errorf("ShardBalanced(%d) on mesh axis %q must be the outermost axis of dim %d; its order is %v", p.dim, l.names[a], p.dim, l.axisNames(l.order[p.dim]))
		}
	}
	return nil
}

// permuteFull returns full (row-major over l.shape) in l's permuted
// order, or full itself when l permutes nothing.
func permuteFull[T elem](l *layout, full []T) []T {
	for d, k := range l.permKs() {
		if k > 0 {
			full = gatherDim(full, l.shape, d, zigzag(l.shape[d], k))
		}
	}
	return full
}

// gatherDim returns x (row-major over shape) with dim d reordered:
// position i of the result holds x's position src[i].
func gatherDim[T elem](x []T, shape []int, d int, src []int) []T {
	outer, inner := prod(shape[:d]), prod(shape[d+1:])
	n := shape[d]
	out := make([]T, len(x))
	for o := range outer {
		for i, s := range src {
			copy(out[(o*n+i)*inner:(o*n+i+1)*inner], x[(o*n+s)*inner:(o*n+s+1)*inner])
		}
	}
	return out
}

// dimPerm is one dim's local reordering in a StepPermute: position i of
// the output takes position src[i] of the input along dim.
type dimPerm struct {
	dim int
	src []int
}

// planPermute plans src -> dst on one mesh where the two permute some
// dims differently: gather those dims (the other axes as they are),
// reorder them locally, then plan on to dst.
func planPermute(src, dst *layout, model *comm.CostModel) (*Plan, error) {
	ks, kd := src.permKs(), dst.permKs()
	mid := newState(src)
	var perms []dimPerm
	for d := range src.shape {
		if ks[d] == kd[d] {
			continue
		}
		for _, a := range src.order[d] {
			mid.places[a] = Replicate()
		}
		mid.order[d] = nil
		// Output position i (dst's order) holds natural index nat[i],
		// which src's order keeps at position inv[nat[i]].
		n := src.shape[d]
		nat, inv := identity(n), identity(n)
		if kd[d] > 0 {
			nat = zigzag(n, kd[d])
		}
		if ks[d] > 0 {
			for p, x := range zigzag(n, ks[d]) {
				inv[x] = p
			}
		}
		from := make([]int, n)
		for i, x := range nat {
			from[i] = inv[x]
		}
		perms = append(perms, dimPerm{dim: d, src: from})
	}
	pre, err := planAxes(newState(src), mid.clone(), src, model)
	if err != nil {
		return nil, err
	}
	st := Step{Kind: StepPermute, Axis: -1, AxisName: "local", AxisSize: 1, Dim: perms[0].dim, ToDim: -1,
		From: Replicate(), To: Replicate(), perm: perms}
	post, err := planAxes(mid.clone(), newState(dst), dst, model)
	if err != nil {
		return nil, err
	}
	pl := &Plan{src: src, dst: dst, cross: -1}
	pl.steps = append(append(append(pl.steps, pre...), st), post...)
	if err := pl.checkBytes(); err != nil {
		return nil, err
	}
	return pl, nil
}

func identity(n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = i
	}
	return s
}

// permuteExec runs a StepPermute on this rank's block.
func permuteExec[T elem](st *Step, x block[T]) block[T] {
	for _, p := range st.perm {
		x = block[T]{shape: x.shape, data: gatherDim(x.data, x.shape, p.dim, p.src)}
	}
	return x
}

// Positions returns the global index along tensor dim of each position of
// dim in the block held by mesh rank meshRank, in the block's order: the
// position ids of a sequence shard, the rows a data loader must deliver.
// For ShardBalanced it is the rank's two chunks (and, with inner axes,
// its piece of them). Errors wrap ErrInvalid (a dim out of range, a mesh
// rank not in the mesh) or ErrUnsupported (a Routed spec without row
// counts).
func (s *Spec) Positions(dim, meshRank int) ([]int, error) {
	const op = "Positions"
	if dim < 0 || dim >= len(s.l.shape) {
		return nil, invalidf(op, "dim %d out of range for a %d-d tensor", dim, len(s.l.shape))
	}
	if s.l.hasRouted() && s.l.rows == nil {
		return nil, unsupportedf(op, "a Routed spec without row counts has no layout (the moe package assigns rows: WithRoutedRows)")
	}
	coord, err := s.m.CoordOf(meshRank)
	if err != nil {
		return nil, invalidf(op, "%v", err)
	}
	off, size := s.l.box(coord)
	out := make([]int, size[dim])
	for i := range out {
		out[i] = off[dim] + i
	}
	if k := s.l.permKs()[dim]; k > 0 {
		perm := zigzag(s.l.shape[dim], k)
		for i, p := range out {
			out[i] = perm[p]
		}
	}
	return out, nil
}

// permuteExec is permuteExec on the device: one copy per position of each
// reordered dim and index of the dims before it.
func (r *devRun) permuteExec(st *Step, x devBlock) (devBlock, error) {
	for _, p := range st.perm {
		out, err := r.alloc(prod(x.shape))
		if err != nil {
			return x, err
		}
		outer, inner := prod(x.shape[:p.dim]), prod(x.shape[p.dim+1:])
		n := x.shape[p.dim]
		for o := range outer * min(inner, 1) { // nothing to move when a dim is 0
			for i, s := range p.src {
				if err := r.d.Copy(slice(out, (o*n+i)*inner, (o*n+i+1)*inner), slice(x.buf, (o*n+s)*inner, (o*n+s+1)*inner)); err != nil {
					return x, err
				}
			}
		}
		x = devBlock{shape: x.shape, buf: out}
	}
	return x, nil
}
