package local

import (
	"fmt"

	"github.com/b7ea7098/loom/comm"
)

// Algorithms returns the algorithms the local backend can force for op, in
// the order of comm.AllAlgorithms. Every one applies to every group size:
// non-powers of two fold the extra ranks in first, and Hierarchical with a
// prime size is a single group.
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

func mod(a, k int) int { return ((a % k) + k) % k }
