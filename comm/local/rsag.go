package local

import (
	"math/bits"
)

// Reduce-scatter and all-gather generators.

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
	recursiveHalving(b, pow, cs, func(v int, s span) ref { return ref{v, bufScratch, s.lo, s.n} })
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
