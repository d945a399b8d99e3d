package local

import (
	"fmt"
	"math/bits"

	"github.com/b7ea7098/loom/comm"
)

// Algorithms returns the algorithms the local backend can force for op, in
// the order they are listed in comm.Algorithms. Every one applies to every
// group size: non-powers of two fold the extra ranks in first, and
// Hierarchical with a prime size is a single group.
func Algorithms(op comm.Op) []comm.Algorithm {
	switch op {
	case comm.OpAllReduce:
		return []comm.Algorithm{comm.Direct, comm.Ring, comm.RecursiveDoubling, comm.HalvingDoubling, comm.Tree, comm.DoubleTree, comm.Hierarchical}
	case comm.OpReduceScatter:
		return []comm.Algorithm{comm.Direct, comm.Ring, comm.HalvingDoubling}
	case comm.OpAllGather:
		return []comm.Algorithm{comm.Direct, comm.Ring, comm.RecursiveDoubling}
	case comm.OpBroadcast, comm.OpReduce:
		return []comm.Algorithm{comm.Direct, comm.Ring, comm.Tree}
	case comm.OpGather, comm.OpScatter, comm.OpAllToAll, comm.OpAllToAllV, comm.OpBarrier:
		return []comm.Algorithm{comm.Direct}
	}
	return nil
}

func supports(op comm.Op, a comm.Algorithm) bool {
	for _, x := range Algorithms(op) {
		if x == a {
			return true
		}
	}
	return false
}

// plan is what a generator needs to know: the op, group size, per-rank
// count, root, and which ranks called in place.
type plan struct {
	op      comm.Op
	algo    comm.Algorithm
	p, n    int
	root    int
	piece   int // pipeline piece, elements
	avg     bool
	stream  bool // the working set exceeds the cache
	inPlace []bool
}

// generate compiles a plan into a schedule.
func generate(pl plan) (*schedule, error) {
	b := newBuilder(pl.p)
	for r := 0; r < pl.p; r++ {
		if !pl.inPlace[r] {
			continue
		}
		switch pl.op {
		case comm.OpAllReduce, comm.OpBroadcast:
			b.setAlias(r, bufSend, bufRecv, 0)
		case comm.OpAllGather:
			b.setAlias(r, bufSend, bufRecv, r*pl.n)
		case comm.OpReduceScatter:
			b.setAlias(r, bufRecv, bufSend, r*pl.n)
		}
	}
	all := identity(pl.p)
	switch pl.op {
	case comm.OpAllReduce:
		g := regionGen{b: b, ranks: all, off: 0, n: pl.n, in: bufSend}
		switch pl.algo {
		case comm.Direct:
			g.allReduceDirect()
		case comm.Ring:
			g.allReduceRing()
		case comm.RecursiveDoubling:
			g.allReduceRecursiveDoubling()
		case comm.HalvingDoubling:
			g.allReduceHalvingDoubling()
		case comm.Tree:
			g.allReduceTree(pl.piece)
		case comm.DoubleTree:
			g.allReduceDoubleTree(pl.piece)
		case comm.Hierarchical:
			g.allReduceHierarchical(groupSize(pl.p))
		default:
			return nil, unsupported(pl)
		}
		if pl.avg {
			addScale(b, func(r int) ref { return ref{r, bufRecv, 0, pl.n} })
		}
	case comm.OpReduceScatter:
		switch pl.algo {
		case comm.Direct:
			reduceScatterDirect(b, pl.p, pl.n)
		case comm.Ring:
			reduceScatterRing(b, pl.p, pl.n)
		case comm.HalvingDoubling:
			reduceScatterHalving(b, pl.p, pl.n)
		default:
			return nil, unsupported(pl)
		}
		if pl.avg {
			addScale(b, func(r int) ref { return ref{r, bufRecv, 0, pl.n} })
		}
	case comm.OpAllGather:
		switch pl.algo {
		case comm.Direct:
			allGatherDirect(b, pl.p, pl.n)
		case comm.Ring:
			allGatherRing(b, pl.p, pl.n)
		case comm.RecursiveDoubling:
			allGatherRecursiveDoubling(b, pl.p, pl.n)
		default:
			return nil, unsupported(pl)
		}
	case comm.OpBroadcast:
		// Only the root's send is read; out of place it is copied first.
		b.copyTo(ref{pl.root, bufRecv, 0, pl.n}, ref{pl.root, bufSend, 0, pl.n})
		order := rotate(pl.p, pl.root)
		switch pl.algo {
		case comm.Direct:
			for _, r := range order[1:] {
				b.copyTo(ref{r, bufRecv, 0, pl.n}, ref{pl.root, bufRecv, 0, pl.n})
			}
		case comm.Ring:
			broadcastTree(b, order, chainParents(len(order)), 0, pl.n, pl.piece)
		case comm.Tree:
			broadcastTree(b, order, heapParents(len(order)), 0, pl.n, pl.piece)
		default:
			return nil, unsupported(pl)
		}
	case comm.OpReduce:
		order := rotate(pl.p, pl.root)
		switch pl.algo {
		case comm.Direct:
			srcs := make([]ref, pl.p)
			for r := range srcs {
				srcs[r] = ref{r, bufSend, 0, pl.n}
			}
			b.reduceTo(ref{pl.root, bufRecv, 0, pl.n}, srcs...)
		case comm.Ring:
			reduceTree(b, order, chainParents(len(order)), 0, pl.n, pl.piece, bufRecv)
		case comm.Tree:
			reduceTree(b, order, heapParents(len(order)), 0, pl.n, pl.piece, bufRecv)
		default:
			return nil, unsupported(pl)
		}
		if pl.avg {
			b.emit(stepScale, ref{pl.root, bufRecv, 0, pl.n})
		}
	default:
		return nil, unsupported(pl)
	}
	s, err := b.build()
	if err != nil {
		return nil, err
	}
	s.algo, s.stream = pl.algo, pl.stream
	return s, nil
}

func unsupported(pl plan) error {
	return fmt.Errorf("%w: algorithm %v does not apply to %v (local backend supports %v)",
		comm.ErrUnsupported, pl.algo, pl.op, Algorithms(pl.op))
}

// addScale appends, for every rank, a step dividing its output by p: the
// end of Avg. The builder makes it wait for every peer still reading the
// unscaled output.
func addScale(b *builder, out func(r int) ref) {
	for r := 0; r < b.p; r++ {
		if o := out(r); o.n > 0 {
			b.emit(stepScale, o)
		}
	}
}

func identity(p int) []int {
	out := make([]int, p)
	for i := range out {
		out[i] = i
	}
	return out
}

// rotate lists ranks starting at root: root, root+1, ..., root-1.
func rotate(p, root int) []int {
	out := make([]int, p)
	for i := range out {
		out[i] = (root + i) % p
	}
	return out
}

// heapParents is a binary tree in heap order: parent(i) = (i-1)/2.
func heapParents(k int) []int {
	par := make([]int, k)
	for i := range par {
		par[i] = (i - 1) / 2
	}
	par[0] = -1
	return par
}

// chainParents is a chain: parent(i) = i-1.
func chainParents(k int) []int {
	par := make([]int, k)
	for i := range par {
		par[i] = i - 1
	}
	return par
}

// groupSize picks the group size of Hierarchical: the divisor of p nearest
// to sqrt(p) from below, so both levels are short; p itself when p is prime.
func groupSize(p int) int {
	best := p
	for g := 2; g*g <= p; g++ {
		if p%g == 0 {
			best = g
		}
	}
	if best == p {
		return p
	}
	// Prefer the larger factor inside groups: g*g <= p, so use p/g.
	return p / best
}

// regionGen emits an all-reduce of elements [off, off+n) over a subset of
// ranks, reading the first input from buffer in and leaving the result in
// recv, so that algorithms compose (Hierarchical nests rings).
type regionGen struct {
	b     *builder
	ranks []int
	off   int
	n     int
	in    bufID
}

func (g regionGen) at(v int, buf bufID, s span) ref {
	return ref{g.ranks[v], buf, g.off + s.lo, s.n}
}

// initRecv copies this region of in to recv on every rank (a no-op in place).
func (g regionGen) initRecv() {
	all := span{0, g.n}
	for v := range g.ranks {
		g.b.copyTo(g.at(v, bufRecv, all), g.at(v, g.in, all))
	}
}

func (g regionGen) allReduceDirect() {
	k := len(g.ranks)
	cs := chunks(g.n, k)
	for v := range g.ranks {
		srcs := make([]ref, k)
		for q := range srcs {
			srcs[q] = g.at(q, g.in, cs[v])
		}
		g.b.reduceTo(g.at(v, bufRecv, cs[v]), srcs...)
	}
	for v := range g.ranks {
		for q := range g.ranks {
			if q != v {
				g.b.copyTo(g.at(v, bufRecv, cs[q]), g.at(q, bufRecv, cs[q]))
			}
		}
	}
}

// ringReduceScatter leaves the reduced chunk (v+1) mod k on member v.
func (g regionGen) ringReduceScatter() []span {
	k := len(g.ranks)
	cs := chunks(g.n, k)
	if k == 1 {
		g.initRecv()
		return cs
	}
	for s := 0; s < k-1; s++ {
		for v := range g.ranks {
			c := cs[mod(v-s-1, k)]
			prev := mod(v-1, k)
			in := g.at(prev, bufRecv, c)
			if s == 0 {
				in = g.at(prev, g.in, c)
			}
			g.b.reduceTo(g.at(v, bufRecv, c), g.at(v, g.in, c), in)
		}
	}
	return cs
}

// ringAllGather spreads chunk (v+1) mod k of member v to every member.
func (g regionGen) ringAllGather(cs []span) {
	k := len(g.ranks)
	for s := 0; s < k-1; s++ {
		for v := range g.ranks {
			c := cs[mod(v-s, k)]
			g.b.copyTo(g.at(v, bufRecv, c), g.at(mod(v-1, k), bufRecv, c))
		}
	}
}

func (g regionGen) allReduceRing() {
	g.ringAllGather(g.ringReduceScatter())
}

// fold combines the inputs of the extra members (beyond the largest power
// of two) into their partners' recv; every power-of-two member ends with
// its working vector in recv. It returns the power of two.
func (g regionGen) fold() int {
	k := len(g.ranks)
	pow := 1 << (bits.Len(uint(k)) - 1)
	all := span{0, g.n}
	for v := 0; v < pow; v++ {
		if e := v + pow; e < k {
			g.b.reduceTo(g.at(v, bufRecv, all), g.at(v, g.in, all), g.at(e, g.in, all))
		} else {
			g.b.copyTo(g.at(v, bufRecv, all), g.at(v, g.in, all))
		}
	}
	return pow
}

// unfold copies the result from each partner to its extra member.
func (g regionGen) unfold(pow int) {
	all := span{0, g.n}
	for e := pow; e < len(g.ranks); e++ {
		g.b.copyTo(g.at(e, bufRecv, all), g.at(e-pow, bufRecv, all))
	}
}

func (g regionGen) allReduceRecursiveDoubling() {
	pow := g.fold()
	all := span{0, g.n}
	// Exchanges read the partner's previous value, so alternate between
	// recv and scratch; the builder orders the overwrites.
	cur, next := bufRecv, bufScratch
	for mask := 1; mask < pow; mask <<= 1 {
		for v := 0; v < pow; v++ {
			x := v ^ mask
			g.b.reduceTo(g.at(v, next, all), g.scratchOr(v, cur, all), g.scratchOr(x, cur, all))
		}
		cur, next = next, cur
	}
	if cur == bufScratch {
		for v := 0; v < pow; v++ {
			g.b.copyTo(g.at(v, bufRecv, all), g.scratchOr(v, bufScratch, all))
		}
	}
	g.unfold(pow)
}

// scratchOr addresses scratch from 0 rather than at the region offset.
func (g regionGen) scratchOr(v int, buf bufID, s span) ref {
	if buf == bufScratch {
		return ref{g.ranks[v], bufScratch, s.lo, s.n}
	}
	return g.at(v, buf, s)
}

// halving runs recursive halving over pow members on recv: member v ends
// holding the reduced chunk v of chunks(n, pow).
func (g regionGen) halving(pow int) []span {
	cs := chunks(g.n, pow)
	lo := make([]int, pow) // chunk range [lo, hi) each member still reduces
	hi := make([]int, pow)
	for v := range lo {
		hi[v] = pow
	}
	for mask := pow >> 1; mask > 0; mask >>= 1 {
		for v := 0; v < pow; v++ {
			x := v ^ mask
			mid := (lo[v] + hi[v]) / 2
			klo, khi := lo[v], mid
			if v&mask != 0 {
				klo, khi = mid, hi[v]
			}
			s := span{cs[klo].lo, cs[khi-1].lo + cs[khi-1].n - cs[klo].lo}
			g.b.reduceTo(g.at(v, bufRecv, s), g.at(v, bufRecv, s), g.at(x, bufRecv, s))
		}
		for v := 0; v < pow; v++ {
			mid := (lo[v] + hi[v]) / 2
			if v&mask != 0 {
				lo[v] = mid
			} else {
				hi[v] = mid
			}
		}
	}
	return cs
}

// doubling runs the recursive-doubling all-gather matching halving.
func (g regionGen) doubling(pow int, cs []span) {
	for mask := 1; mask < pow; mask <<= 1 {
		for v := 0; v < pow; v++ {
			x := v ^ mask
			// x owns the chunks that share its bits above mask.
			base := x &^ (mask - 1)
			s := span{cs[base].lo, cs[base+mask-1].lo + cs[base+mask-1].n - cs[base].lo}
			g.b.copyTo(g.at(v, bufRecv, s), g.at(x, bufRecv, s))
		}
	}
}

func (g regionGen) allReduceHalvingDoubling() {
	pow := g.fold()
	g.doubling(pow, g.halving(pow))
	g.unfold(pow)
}

// allReduceTree reduces up a binary tree to member 0 and broadcasts back,
// pipelined in pieces.
func (g regionGen) allReduceTree(piece int) {
	order := make([]int, len(g.ranks))
	copy(order, g.ranks)
	par := heapParents(len(order))
	reduceTree(g.b, order, par, g.off, g.n, piece, bufRecv)
	broadcastTree(g.b, order, par, g.off, g.n, piece)
}

// allReduceDoubleTree splits the data in two halves carried by two trees,
// the second over the members in reverse order so that most ranks that are
// leaves in one tree are inner nodes in the other.
func (g regionGen) allReduceDoubleTree(piece int) {
	k := len(g.ranks)
	halves := chunks(g.n, 2)
	fwd := make([]int, k)
	rev := make([]int, k)
	for i := range fwd {
		fwd[i] = g.ranks[i]
		rev[i] = g.ranks[k-1-i]
	}
	par := heapParents(k)
	a := pipeline(halves[0].n, piece)
	b := pipeline(halves[1].n, piece)
	// Interleave the trees piece by piece so both make progress.
	for i := 0; i < max(len(a), len(b)); i++ {
		if i < len(a) {
			reduceTree(g.b, fwd, par, g.off+a[i].lo, a[i].n, 0, bufRecv)
		}
		if i < len(b) {
			reduceTree(g.b, rev, par, g.off+halves[1].lo+b[i].lo, b[i].n, 0, bufRecv)
		}
	}
	for i := 0; i < max(len(a), len(b)); i++ {
		if i < len(a) {
			broadcastTree(g.b, fwd, par, g.off+a[i].lo, a[i].n, 0)
		}
		if i < len(b) {
			broadcastTree(g.b, rev, par, g.off+halves[1].lo+b[i].lo, b[i].n, 0)
		}
	}
}

// allReduceHierarchical: ring reduce-scatter inside groups of gs
// neighbouring ranks, ring all-reduce of each chunk across groups, ring
// all-gather inside groups.
func (g regionGen) allReduceHierarchical(gs int) {
	k := len(g.ranks)
	if gs >= k || gs <= 1 {
		g.allReduceRing()
		return
	}
	ng := k / gs
	var owned []span
	for grp := 0; grp < ng; grp++ {
		inner := g
		inner.ranks = g.ranks[grp*gs : (grp+1)*gs]
		owned = inner.ringReduceScatter()
	}
	// Member j of every group owns chunk (j+1) mod gs: all-reduce it
	// across groups, in place in recv.
	for j := 0; j < gs; j++ {
		c := owned[mod(j+1, gs)]
		across := regionGen{b: g.b, off: g.off + c.lo, n: c.n, in: bufRecv}
		for grp := 0; grp < ng; grp++ {
			across.ranks = append(across.ranks, g.ranks[grp*gs+j])
		}
		across.allReduceRing()
	}
	for grp := 0; grp < ng; grp++ {
		inner := g
		inner.ranks = g.ranks[grp*gs : (grp+1)*gs]
		inner.ringAllGather(owned)
	}
}

// reduceTree reduces elements [off, off+n) of every member's send up the
// tree par (over order) into dst of order[0]; inner nodes keep partial
// results in scratch. Pieces pipeline the levels.
func reduceTree(b *builder, order, par []int, off, n, piece int, dst bufID) {
	k := len(order)
	children := make([][]int, k)
	for i := 1; i < k; i++ {
		children[par[i]] = append(children[par[i]], i)
	}
	// value returns where node i's reduced piece lives after it is done.
	value := func(i int, s span) ref {
		switch {
		case i == 0:
			return ref{order[0], dst, off + s.lo, s.n}
		case len(children[i]) == 0:
			return ref{order[i], bufSend, off + s.lo, s.n}
		}
		return ref{order[i], bufScratch, off + s.lo, s.n}
	}
	for _, s := range pipeline(n, piece) {
		for i := k - 1; i >= 0; i-- { // children before parents
			if len(children[i]) == 0 && i != 0 {
				continue
			}
			srcs := []ref{{order[i], bufSend, off + s.lo, s.n}}
			for _, c := range children[i] {
				srcs = append(srcs, value(c, s))
			}
			if len(srcs) == 1 {
				b.copyTo(value(i, s), srcs[0])
			} else {
				b.reduceTo(value(i, s), srcs...)
			}
		}
	}
}

// broadcastTree copies recv[off, off+n) of order[0] down the tree par.
func broadcastTree(b *builder, order, par []int, off, n, piece int) {
	for _, s := range pipeline(n, piece) {
		for i := 1; i < len(order); i++ { // parents before children
			b.copyTo(ref{order[i], bufRecv, off + s.lo, s.n}, ref{order[par[i]], bufRecv, off + s.lo, s.n})
		}
	}
}

func reduceScatterDirect(b *builder, p, n int) {
	for r := 0; r < p; r++ {
		srcs := make([]ref, p)
		for q := range srcs {
			srcs[q] = ref{q, bufSend, r * n, n}
		}
		b.reduceTo(ref{r, bufRecv, 0, n}, srcs...)
	}
}

// reduceScatterRing: rank r works on block (r-s-2) mod p at step s, so it
// finishes with its own block; partial blocks alternate between two halves
// of scratch.
func reduceScatterRing(b *builder, p, n int) {
	if p == 1 {
		b.copyTo(ref{0, bufRecv, 0, n}, ref{0, bufSend, 0, n})
		return
	}
	partial := func(r, s int) ref {
		if s == p-2 {
			return ref{r, bufRecv, 0, n}
		}
		return ref{r, bufScratch, (s % 2) * n, n}
	}
	for s := 0; s < p-1; s++ {
		for r := 0; r < p; r++ {
			blk := mod(r-s-2, p)
			prev := mod(r-1, p)
			in := ref{prev, bufSend, blk * n, n}
			if s > 0 {
				in = partial(prev, s-1)
			}
			b.reduceTo(partial(r, s), ref{r, bufSend, blk * n, n}, in)
		}
	}
}

// reduceScatterHalving folds extra ranks in, runs recursive halving over
// the whole p·n vector in scratch, then each rank copies its block from the
// member that reduced it.
func reduceScatterHalving(b *builder, p, n int) {
	pow := 1 << (bits.Len(uint(p)) - 1)
	total := p * n
	all := ref{0, bufSend, 0, total}
	for v := 0; v < pow; v++ {
		dst := ref{v, bufScratch, 0, total}
		src := all
		src.rank = v
		if e := v + pow; e < p {
			other := all
			other.rank = e
			b.reduceTo(dst, src, other)
		} else {
			b.copyTo(dst, src)
		}
	}
	cs := chunks(total, pow)
	lo := make([]int, pow)
	hi := make([]int, pow)
	for v := range hi {
		hi[v] = pow
	}
	for mask := pow >> 1; mask > 0; mask >>= 1 {
		for v := 0; v < pow; v++ {
			x := v ^ mask
			mid := (lo[v] + hi[v]) / 2
			klo, khi := lo[v], mid
			if v&mask != 0 {
				klo, khi = mid, hi[v]
			}
			s := span{cs[klo].lo, cs[khi-1].lo + cs[khi-1].n - cs[klo].lo}
			b.reduceTo(ref{v, bufScratch, s.lo, s.n}, ref{v, bufScratch, s.lo, s.n}, ref{x, bufScratch, s.lo, s.n})
		}
		for v := 0; v < pow; v++ {
			mid := (lo[v] + hi[v]) / 2
			if v&mask != 0 {
				lo[v] = mid
			} else {
				hi[v] = mid
			}
		}
	}
	// Member v owns elements cs[v]; block r may straddle owners.
	for r := 0; r < p; r++ {
		for v := 0; v < pow; v++ {
			lo := max(r*n, cs[v].lo)
			hi := min((r+1)*n, cs[v].lo+cs[v].n)
			if lo < hi {
				b.copyTo(ref{r, bufRecv, lo - r*n, hi - lo}, ref{v, bufScratch, lo, hi - lo})
			}
		}
	}
}

func allGatherDirect(b *builder, p, n int) {
	for r := 0; r < p; r++ {
		b.copyTo(ref{r, bufRecv, r * n, n}, ref{r, bufSend, 0, n})
	}
	for r := 0; r < p; r++ {
		for q := 0; q < p; q++ {
			if q != r {
				b.copyTo(ref{r, bufRecv, q * n, n}, ref{q, bufSend, 0, n})
			}
		}
	}
}

func allGatherRing(b *builder, p, n int) {
	for r := 0; r < p; r++ {
		b.copyTo(ref{r, bufRecv, r * n, n}, ref{r, bufSend, 0, n})
	}
	for s := 0; s < p-1; s++ {
		for r := 0; r < p; r++ {
			blk := mod(r-s-1, p)
			b.copyTo(ref{r, bufRecv, blk * n, n}, ref{mod(r-1, p), bufRecv, blk * n, n})
		}
	}
}

// allGatherRecursiveDoubling: extra ranks hand their block to a partner,
// the power-of-two members double the set of blocks they hold each round,
// and the extra ranks copy the finished result.
func allGatherRecursiveDoubling(b *builder, p, n int) {
	pow := 1 << (bits.Len(uint(p)) - 1)
	held := make([][]int, pow) // blocks each member holds
	for v := 0; v < pow; v++ {
		b.copyTo(ref{v, bufRecv, v * n, n}, ref{v, bufSend, 0, n})
		held[v] = []int{v}
		if e := v + pow; e < p {
			b.copyTo(ref{v, bufRecv, e * n, n}, ref{e, bufSend, 0, n})
			held[v] = append(held[v], e)
		}
	}
	for mask := 1; mask < pow; mask <<= 1 {
		next := make([][]int, pow)
		for v := 0; v < pow; v++ {
			x := v ^ mask
			for _, blk := range held[x] {
				b.copyTo(ref{v, bufRecv, blk * n, n}, ref{x, bufRecv, blk * n, n})
			}
			next[v] = append(append([]int(nil), held[v]...), held[x]...)
		}
		held = next
	}
	for e := pow; e < p; e++ {
		b.copyTo(ref{e, bufRecv, 0, p * n}, ref{e - pow, bufRecv, 0, p * n})
	}
}

func mod(a, k int) int { return ((a % k) + k) % k }
