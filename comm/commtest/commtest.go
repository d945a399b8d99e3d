// Package commtest is a conformance suite for comm.Communicator backends.
//
// A backend's test calls Run with a Launcher that starts p ranks of a fresh
// communicator. Run checks every collective, for every rank count, size,
// dtype, reduce op, root and algorithm of a Config, against a serial
// reference that shares no code with any backend:
//
//	func TestConformance(t *testing.T) {
//		commtest.Run(t, launch, commtest.Config{
//			Algorithms: mybackend.Algorithms,
//			Short:      testing.Short(),
//		})
//	}
//
// Each rank generates its input with Fill from the case's seed and its rank,
// and checks only its own output, regenerating its peers' inputs to compute
// the expected result; so the suite also runs where ranks are separate
// processes, each calling Run with a Launcher that runs its own rank(s).
//
// Cases that differ only in the algorithm they force share their seed, so
// each process generates their inputs and computes their reference once,
// not once per algorithm: at the large size that work, not the collective,
// is most of the suite's time.
package commtest

import (
	"context"
	"fmt"
	"hash/fnv"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Launcher runs fn on p ranks of a fresh communicator and returns their
// joined errors. It returns once every rank's fn has returned.
type Launcher func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error

// Config selects the cases Run checks; the zero value takes every default.
type Config struct {
	// Ranks are the rank counts to test (default 1, 2, 3, 4, 5, 7, 8).
	Ranks []int
	// Large is the large per-rank element count (default 1000003, a prime,
	// or 10007 when Short).
	Large int
	// Algorithms lists the algorithms to force for op; comm.Auto is always
	// tested as well. Nil tests Auto only.
	Algorithms func(op comm.Op) []comm.Algorithm
	// Short reduces the matrix for -short and -race runs: only roots 0 and
	// p-1; every algorithm only for float32 with sum; other dtypes and
	// reduce ops with one algorithm each (rotating through Auto and
	// Algorithms), and dtypes other than float32 with reduce ops other
	// than sum only at size p+1.
	Short bool
}

const (
	defaultLarge = 1000003
	shortLarge   = 10007
	// caseTimeout bounds one case, so a broken backend fails instead of
	// hanging the test binary.
	caseTimeout = 60 * time.Second
	// launcherGrace is how long Run waits for a launcher that ignores its
	// expired context before reporting the case as hung.
	launcherGrace = 10 * time.Second
	// maxFailures is the number of failed cases after which the remaining
	// ones are skipped, to keep the output of a broken backend readable.
	maxFailures = 25
	// baseSeed is mixed with each case's name to seed its inputs.
	baseSeed = 0x10a4c0ffee
)

var defaultRanks = []int{1, 2, 3, 4, 5, 7, 8}

// rankFunc is what one rank of a case runs.
type rankFunc = func(ctx context.Context, c comm.Communicator) error

// kase is one leaf test: one launch of p ranks.
type kase struct {
	path  []string // subtest names below Run's test
	p, n  int
	dt    comm.DType
	rop   comm.ReduceOp
	algo  comm.Algorithm
	roots []int
	algos []comm.Algorithm // for cases that sweep algorithms inside one launch
	seed  uint64
	// data names the case's inputs: consecutive cases with the same data
	// share one memo, which runCase sets before it calls body.
	data string
	memo *memo
	// body builds the rank function of the case, and optionally a check
	// that runs after the launch returns, given how many ranks ran in this
	// process.
	body func(k *kase) (rankFunc, func(local int) error)
}

// harness holds the resolved configuration and the counters of one Run.
type harness struct {
	launch     Launcher
	ranks      []int
	largeRanks []int
	large      int
	short      bool
	algos      func(op comm.Op) []comm.Algorithm
	failures   atomic.Int32
	cases      atomic.Int32
	// memo is the memo of the data group running now; cases run one at a
	// time, so one group's inputs are alive at once.
	memo *memo
}

// memo holds what the cases of one data group share: their inputs and
// references, built on first use.
type memo struct {
	data string
	mu   sync.Mutex
	vals map[string]any
}

// shared returns the value named name in k's memo, building it with f on
// first use. f runs under the memo's lock; bodies call shared while they
// build a case, before any rank runs, and store lazy values for what ranks
// compute.
func shared[T any](k *kase, name string, f func() T) T {
	m := k.memo
	m.mu.Lock()
	defer m.mu.Unlock()
	if v, ok := m.vals[name]; ok {
		return v.(T)
	}
	v := f()
	m.vals[name] = v
	return v
}

// Run checks the backend behind launch against the serial reference, as
// subtests of t named op/p=P/n=N/dtype[/reduceop]/algorithm (for example
// "allreduce/p=3/n=4/float32/sum/ring"), plus sendrecv, barrier, split and
// async groups. Cases run one after another; each has its own
// communicator and a 60 s deadline. The algorithms of one
// op/p/n/dtype[/reduceop] see the same inputs.
func Run(t *testing.T, launch Launcher, cfg Config) {
	h := &harness{launch: launch, ranks: cfg.Ranks, large: cfg.Large, short: cfg.Short, algos: cfg.Algorithms}
	if len(h.ranks) == 0 {
		h.ranks = defaultRanks
	}
	if h.large <= 0 {
		h.large = defaultLarge
		if h.short {
			h.large = shortLarge
		}
	}
	h.largeRanks = pickLargeRanks(h.ranks)

	var cases []*kase
	for _, s := range sizedOps {
		cases = append(cases, h.sizedCases(s)...)
	}
	cases = append(cases, h.fixedCases()...)
	start := time.Now()
	h.runTree(t, cases, 0)
	t.Logf("commtest: %d cases in %v", h.cases.Load(), time.Since(start).Round(time.Millisecond))
}

// pickLargeRanks chooses the rank counts that also run the large size: the
// smallest above one, the smallest that is not a power of two, and the
// largest (2, 3 and 8 by default).
func pickLargeRanks(ranks []int) []int {
	var out []int
	add := func(p int) {
		if p > 1 && !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	sorted := slices.Sorted(slices.Values(ranks))
	for _, p := range sorted {
		if p > 1 {
			add(p)
			break
		}
	}
	for _, p := range sorted {
		if p > 2 && p&(p-1) != 0 {
			add(p)
			break
		}
	}
	if len(sorted) > 0 {
		add(sorted[len(sorted)-1])
	}
	return out
}

// algorithms returns Auto followed by the configured algorithms for op.
func (h *harness) algorithms(op comm.Op) []comm.Algorithm {
	out := []comm.Algorithm{comm.Auto}
	if h.algos != nil {
		for _, a := range h.algos(op) {
			if !slices.Contains(out, a) {
				out = append(out, a)
			}
		}
	}
	return out
}

// sizes returns the per-rank counts tested at p: 0, 1, p-1 and p+1, and
// the large count where p is one of largeRanks.
func (h *harness) sizes(p int) []int {
	var out []int
	for _, n := range []int{0, 1, p - 1, p + 1} {
		if !slices.Contains(out, n) {
			out = append(out, n)
		}
	}
	if slices.Contains(h.largeRanks, p) && !slices.Contains(out, h.large) {
		out = append(out, h.large)
	}
	return out
}

// roots returns every root at small sizes, and roots 0 and p-1 at the large
// size or in short mode.
func (h *harness) roots(p, n int) []int {
	if h.short || n == h.large {
		if p == 1 {
			return []int{0}
		}
		return []int{0, p - 1}
	}
	out := make([]int, p)
	for i := range out {
		out[i] = i
	}
	return out
}

// sizedOp describes one collective checked over sizes, dtypes, reduce ops
// and algorithms.
type sizedOp struct {
	op   comm.Op
	name string
	// minRanks is the smallest p the op applies to.
	minRanks int
	body     func(k *kase) (rankFunc, func(local int) error)
}

// sizedOps is the table of collectives Run checks over the full matrix.
var sizedOps = []sizedOp{
	{comm.OpAllReduce, "allreduce", 1, allReduceCase},
	{comm.OpBroadcast, "broadcast", 1, broadcastCase},
	{comm.OpReduce, "reduce", 1, reduceCase},
	{comm.OpAllGather, "allgather", 1, allGatherCase},
	{comm.OpReduceScatter, "reducescatter", 1, reduceScatterCase},
	{comm.OpGather, "gather", 1, gatherCase},
	{comm.OpScatter, "scatter", 1, scatterCase},
	{comm.OpAllToAll, "alltoall", 1, allToAllCase},
	{comm.OpAllToAllV, "alltoallv", 1, allToAllVCase},
	{comm.OpSend, "sendrecv", 2, sendRecvCase},
}

// The large size runs only for a subset, because at 10^6 elements per rank
// the generation and checking of the data dominate: every op and every
// algorithm in float32 (with Sum for the reducing ops, in- and
// out-of-place, roots 0 and p-1), plus every dtype of AllReduce with Sum,
// at the rank counts of pickLargeRanks. That is where sizes matter: chunking,
// pipelining and segment boundaries (the large size is prime, so it never
// divides evenly) depend on the algorithm and the element size, not on the
// reduce op, which the small sizes cover exhaustively.
func (h *harness) largeSubset(s sizedOp, dt comm.DType, rop comm.ReduceOp) bool {
	if rop != 0 && rop != comm.Sum {
		return false
	}
	return dt == comm.Float32 || s.op == comm.OpAllReduce
}

// shortSubset thins the matrix in short mode. Float32 with sum (or no
// reduce op) runs with Auto and every algorithm. Every other combination
// runs with one algorithm (Auto among them), rotating through the list so
// that every algorithm still meets several dtypes and reduce ops; and
// dtypes other than float32 meet reduce ops other than sum only at the
// size p+1, which divides by nothing.
func (h *harness) shortSubset(algos []comm.Algorithm, p, n int, dt comm.DType, rop comm.ReduceOp) []comm.Algorithm {
	switch {
	case dt == comm.Float32 && (rop == 0 || rop == comm.Sum):
		return algos
	case dt != comm.Float32 && rop != 0 && rop != comm.Sum && n != p+1:
		return nil
	}
	return algos[(int(dt)*7+int(rop)*3+n)%len(algos):][:1]
}

// sizedCases enumerates the cases of one collective.
func (h *harness) sizedCases(s sizedOp) []*kase {
	rops := []comm.ReduceOp{0}
	if s.op.Reduces() {
		rops = comm.AllReduceOps()
	}
	algos := h.algorithms(s.op)
	var out []*kase
	for _, p := range h.ranks {
		if p < s.minRanks {
			continue
		}
		for _, n := range h.sizes(p) {
			for _, dt := range comm.AllDTypes() {
				for _, rop := range rops {
					if n == h.large && !h.largeSubset(s, dt, rop) {
						continue
					}
					as := algos
					if h.short {
						as = h.shortSubset(algos, p, n, dt, rop)
					}
					for _, algo := range as {
						path := []string{s.name, fmt.Sprintf("p=%d", p), fmt.Sprintf("n=%d", n), dt.String()}
						if rop != 0 {
							path = append(path, rop.String())
						}
						// The seed leaves out the algorithm: every
						// algorithm meets the same data, generated once.
						data := path
						path = append(path[:len(path):len(path)], algo.String())
						out = append(out, &kase{
							path: path, p: p, n: n, dt: dt, rop: rop, algo: algo,
							roots: h.roots(p, n), seed: seedOf(data), data: strings.Join(data, "/"), body: s.body,
						})
					}
				}
			}
		}
	}
	return out
}

// fixedCases are the cases that are not swept over sizes: barrier (every
// algorithm in one launch), split and the async pipeline, one per rank
// count.
func (h *harness) fixedCases() []*kase {
	var out []*kase
	for _, g := range []struct {
		name string
		op   comm.Op
		body func(k *kase) (rankFunc, func(local int) error)
	}{
		{"barrier", comm.OpBarrier, barrierCase},
		{"split", comm.OpSplit, splitCase},
		{"async", 0, asyncCase},
	} {
		for _, p := range h.ranks {
			path := []string{g.name, fmt.Sprintf("p=%d", p)}
			out = append(out, &kase{path: path, p: p, seed: seedOf(path), data: strings.Join(path, "/"), algos: h.algorithms(g.op), body: g.body})
		}
	}
	return out
}

// seedOf derives a case's seed from its name, so that every process of a
// multi-process run agrees on it.
func seedOf(path []string) uint64 {
	f := fnv.New64a()
	f.Write([]byte(strings.Join(path, "/")))
	return f.Sum64() ^ baseSeed
}

// runTree runs cases as nested subtests, one level per path element.
// cases with a common prefix are contiguous, as sizedCases emits them.
func (h *harness) runTree(t *testing.T, cases []*kase, depth int) {
	for i := 0; i < len(cases); {
		j := i + 1
		for j < len(cases) && cases[j].path[depth] == cases[i].path[depth] {
			j++
		}
		group := cases[i:j]
		t.Run(group[0].path[depth], func(t *testing.T) {
			if len(group) == 1 && len(group[0].path) == depth+1 {
				h.runCase(t, group[0])
				return
			}
			h.runTree(t, group, depth+1)
		})
		i = j
	}
}

// runCase launches one case and reports its errors.
func (h *harness) runCase(t *testing.T, k *kase) {
	if n := h.failures.Load(); n >= maxFailures {
		t.Skipf("skipped after %d failed cases", n)
	}
	h.cases.Add(1)
	if h.memo == nil || h.memo.data != k.data {
		h.memo = &memo{data: k.data, vals: map[string]any{}}
	}
	k.memo = h.memo
	defer func() { k.memo = nil }() // Run keeps k until it returns; the data must go
	fn, after := k.body(k)
	var local atomic.Int32
	wrapped := func(ctx context.Context, c comm.Communicator) (err error) {
		local.Add(1)
		defer func() {
			if v := recover(); v != nil {
				err = fmt.Errorf("rank %d panicked: %v\n%s", c.Rank(), v, debug.Stack())
				c.Abort(err)
			}
		}()
		if c.Size() != k.p {
			return fmt.Errorf("rank %d: communicator has %d ranks, want %d", c.Rank(), c.Size(), k.p)
		}
		return fn(ctx, c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), caseTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- h.launch(ctx, k.p, wrapped) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(caseTimeout + launcherGrace):
		// The ranks leak, but the test fails instead of hanging.
		err = fmt.Errorf("hung: the launcher did not return %v after the case's %v deadline", launcherGrace, caseTimeout)
	}
	if err == nil && after != nil {
		err = after(int(local.Load()))
	}
	if err != nil {
		// A broken backend may have written into the shared inputs: the
		// next case starts from fresh ones.
		h.memo = nil
		h.failures.Add(1)
		t.Error(err)
	}
}
