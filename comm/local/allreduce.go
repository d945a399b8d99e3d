package local

import (
	"math/bits"
)

// All-reduce generators over a region and a subset of ranks, so that they
// compose (Hierarchical nests rings).

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

// allReduceDirect: member v reduces chunk v straight from every member's
// input and writes the result into every member's output, so each input
// byte is read once and each output byte written once, by one rank.
func (g regionGen) allReduceDirect() {
	k := len(g.ranks)
	cs := chunks(g.n, k)
	for v := range g.ranks {
		srcs := make([]ref, k)
		dsts := make([]ref, k)
		for q := range srcs {
			srcs[q] = g.at(q, g.in, cs[v])
			dsts[q] = g.at(q, bufRecv, cs[v])
		}
		g.b.reduceToAll(g.ranks[v], dsts, srcs...)
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
	recursiveHalving(g.b, pow, cs, func(v int, s span) ref { return g.at(v, bufRecv, s) })
	return cs
}

// recursiveHalving emits Rabenseifner's reduce-scatter rounds over pow
// members (a power of two) whose working vectors at(v, ·) are split into
// the chunks cs: each round halves the range of chunks a member reduces,
// and member v ends holding the reduced chunk v. A member writes only the
// half it keeps, which its partner does not read, so the rounds work in
// place.
func recursiveHalving(b *builder, pow int, cs []span, at func(v int, s span) ref) {
	lo := make([]int, pow) // chunk range [lo, hi) each member still reduces
	hi := make([]int, pow)
	for v := range lo {
		hi[v] = pow
	}
	for mask := pow >> 1; mask > 0; mask >>= 1 {
		for v := 0; v < pow; v++ {
			mid := (lo[v] + hi[v]) / 2
			klo, khi := lo[v], mid
			if v&mask != 0 {
				klo, khi = mid, hi[v]
			}
			s := span{cs[klo].lo, cs[khi-1].lo + cs[khi-1].n - cs[klo].lo}
			b.reduceTo(at(v, s), at(v, s), at(v^mask, s))
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
