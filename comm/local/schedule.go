package local

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// A schedule is a collective compiled for shared memory: per rank, a list of
// steps, each of which reads peers' buffers directly and writes only its own
// (one copy per element, no staging). Algorithms are generators that emit
// steps in a sequential "as if" order; the builder derives from that order
// the waits that make a parallel run compute the same thing:
//
//   - read after write: a step that reads region X of rank q's buffer waits
//     until q has done the last step that wrote X before it;
//   - write after read: a step that overwrites region X of its own buffer
//     waits until every peer step that read the old contents of X is done.
//
// So an algorithm states only the data flow, and every hazard (in-place
// aliasing included) is handled in one place.

type bufID uint8

const (
	bufSend bufID = iota
	bufRecv
	bufScratch
)

func (b bufID) String() string { return [...]string{"send", "recv", "scratch"}[b] }

// ref is a region of one rank's buffer, in elements.
type ref struct {
	rank int
	buf  bufID
	off  int
	n    int
}

func (r ref) String() string { return fmt.Sprintf("r%d.%v[%d:%d]", r.rank, r.buf, r.off, r.off+r.n) }

type stepKind uint8

const (
	stepCopy   stepKind = iota // dst = src
	stepReduce                 // dst = srcs[0] op srcs[1] op ...
	stepScale                  // dst /= group size (the end of Avg)
)

// dep says: wait until rank's progress reaches mark within this collective.
type dep struct {
	rank int
	mark int
}

type step struct {
	kind   stepKind
	dsts   []ref // every destination receives the same result
	srcs   []ref
	deps   []dep
	signal bool // a peer waits on this step: publish progress after it
	// contended counts the destinations another rank also reads or writes
	// in the collective: in a loop of calls their lines lie in that rank's
	// cache when this step overwrites them (see schedule.cost).
	contended int
}

// schedule is the compiled form of one collective for every rank.
type schedule struct {
	algo    comm.Algorithm
	stream  bool // the working set exceeds the cache: stream large results
	steps   [][]step
	scratch []int // scratch elements each rank needs
}

// access records who touched a region of some rank's buffer, for hazard
// analysis.
type access struct {
	buf     bufID
	lo, hi  int
	rank    int // the rank whose step it was (not the buffer's owner)
	stepIdx int
}

// alias maps a rank's buffer onto another of its buffers at an offset, for
// in-place calls (AllGather: send is recv's block r).
type alias struct {
	to  bufID
	off int
	set bool
}

type builder struct {
	p       int
	steps   [][]step
	writes  [][]access // by owner of the buffer written
	reads   [][]access // by owner of the buffer read
	aliases [][3]alias
	scratch []int
}

func newBuilder(p int) *builder {
	return &builder{
		p:       p,
		steps:   make([][]step, p),
		writes:  make([][]access, p),
		reads:   make([][]access, p),
		aliases: make([][3]alias, p),
		scratch: make([]int, p),
	}
}

// setAlias makes rank r's buffer from an alias of its buffer to at offset off.
func (b *builder) setAlias(r int, from, to bufID, off int) {
	b.aliases[r][from] = alias{to: to, off: off, set: true}
}

func (b *builder) canon(x ref) ref {
	if a := b.aliases[x.rank][x.buf]; a.set {
		x.buf, x.off = a.to, x.off+a.off
	}
	if x.buf == bufScratch && x.off+x.n > b.scratch[x.rank] {
		b.scratch[x.rank] = x.off + x.n
	}
	return x
}

func overlaps(a access, buf bufID, lo, hi int) bool {
	return a.buf == buf && a.lo < hi && lo < a.hi
}

// emit appends a step to dst.rank's list: the owner writes its own buffer.
func (b *builder) emit(kind stepKind, dst ref, srcs ...ref) {
	b.emitBy(dst.rank, kind, []ref{dst}, srcs)
}

// emitBy appends a step to actor's list that reads srcs and writes the same
// result to every region of dsts, its own buffers or peers'. Empty regions
// emit nothing. Waits are derived from every earlier access to the regions
// touched, by any rank other than actor:
//
//   - reading a region waits for the steps that last wrote it;
//   - writing a region waits for the steps that read or wrote it before;
//   - touching a peer's buffer at all waits for the peer's arrival, which
//     posts the buffer.
func (b *builder) emitBy(actor int, kind stepKind, dsts, srcs []ref) {
	if len(dsts) == 0 || dsts[0].n == 0 {
		return
	}
	cd := make([]ref, len(dsts))
	for i, d := range dsts {
		cd[i] = b.canon(d)
	}
	cs := make([]ref, len(srcs))
	for i, s := range srcs {
		cs[i] = b.canon(s)
	}
	if kind == stepCopy && len(cd) == 1 && len(cs) == 1 && cs[0] == cd[0] {
		return // copying a region onto itself
	}
	idx := len(b.steps[actor])
	need := make(map[int]int) // rank -> mark
	want := func(q, mark int) {
		if q == actor {
			return
		}
		if m, ok := need[q]; !ok || mark > m {
			need[q] = mark
		}
	}
	after := func(list []access, x ref) {
		for _, a := range list {
			if a.rank != actor && overlaps(a, x.buf, x.off, x.off+x.n) {
				want(a.rank, a.stepIdx+1)
			}
		}
	}
	for _, s := range cs {
		want(s.rank, 0)
		after(b.writes[s.rank], s) // read after write
	}
	for _, d := range cd {
		want(d.rank, 0)
		after(b.reads[d.rank], d)  // write after read
		after(b.writes[d.rank], d) // write after write
	}
	for _, s := range cs {
		b.reads[s.rank] = append(b.reads[s.rank], access{buf: s.buf, lo: s.off, hi: s.off + s.n, rank: actor, stepIdx: idx})
	}
	for _, d := range cd {
		b.writes[d.rank] = append(b.writes[d.rank], access{buf: d.buf, lo: d.off, hi: d.off + d.n, rank: actor, stepIdx: idx})
	}
	st := step{kind: kind, dsts: cd, srcs: cs}
	for q, mark := range need {
		st.deps = append(st.deps, dep{rank: q, mark: mark})
		if mark > 0 {
			b.steps[q][mark-1].signal = true
		}
	}
	sortDeps(st.deps)
	b.steps[actor] = append(b.steps[actor], st)
}

func sortDeps(d []dep) {
	for i := 1; i < len(d); i++ {
		for j := i; j > 0 && d[j].rank < d[j-1].rank; j-- {
			d[j], d[j-1] = d[j-1], d[j]
		}
	}
}

// touchedByOther reports whether a step of a rank other than actor
// accessed region x.
func touchedByOther(list []access, x ref, actor int) bool {
	for _, a := range list {
		if a.rank != actor && overlaps(a, x.buf, x.off, x.off+x.n) {
			return true
		}
	}
	return false
}

func (b *builder) copyTo(dst, src ref)           { b.emit(stepCopy, dst, src) }
func (b *builder) reduceTo(dst ref, srcs ...ref) { b.emit(stepReduce, dst, srcs...) }

// reduceToAll has actor reduce srcs once and write the result to every dst.
func (b *builder) reduceToAll(actor int, dsts []ref, srcs ...ref) {
	b.emitBy(actor, stepReduce, dsts, srcs)
}

func (b *builder) build() (*schedule, error) {
	for r, s := range b.steps {
		if len(s) > maxSteps {
			return nil, fmt.Errorf("schedule for rank %d has %d steps, more than %d", r, len(s), maxSteps)
		}
	}
	for r := range b.steps {
		for i := range b.steps[r] {
			st := &b.steps[r][i]
			for _, d := range st.dsts {
				if touchedByOther(b.reads[d.rank], d, r) || touchedByOther(b.writes[d.rank], d, r) {
					st.contended++
				}
			}
		}
	}
	return &schedule{steps: b.steps, scratch: b.scratch}, nil
}

// String prints the schedule, one line per step, for tests and debugging.
func (s *schedule) String() string {
	var sb strings.Builder
	for r, steps := range s.steps {
		fmt.Fprintf(&sb, "rank %d (scratch %d):\n", r, s.scratch[r])
		for i, st := range steps {
			kind := [...]string{"copy", "reduce", "scale"}[st.kind]
			fmt.Fprintf(&sb, "  %d %s %v <- %v wait %v signal=%v\n", i, kind, st.dsts, st.srcs, st.deps, st.signal)
		}
	}
	return sb.String()
}

// span is a half-open element range [lo, lo+n).
type span struct{ lo, n int }

// chunks splits n elements into k balanced parts: the first n%k parts get
// one element more.
func chunks(n, k int) []span {
	out := make([]span, k)
	base, extra := n/k, n%k
	lo := 0
	for i := range out {
		sz := base
		if i < extra {
			sz++
		}
		out[i] = span{lo, sz}
		lo += sz
	}
	return out
}

// pipeline splits n elements into pieces of about target elements (at least
// one piece) for pipelined algorithms.
func pipeline(n, target int) []span {
	if target <= 0 {
		target = n
	}
	k := max(1, (n+target-1)/max(target, 1))
	return chunks(n, k)
}

// schedKey identifies a cached schedule within a group.
type schedKey struct {
	op      comm.Op
	algo    comm.Algorithm
	n       int
	root    int
	piece   int // pipeline piece in elements
	avg     bool
	stream  bool
	inPlace string // one byte per rank
}
