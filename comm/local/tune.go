package local

import (
	"fmt"
	"math"
	"math/bits"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Online tuning. The cost model ranks the algorithms of a call; where
// several come out close, the model cannot be trusted to order them (it
// may have been measured while the machine was busy, and it does not see
// everything the hardware does), so the first calls of each size class
// run the close candidates in turn, timed, and the rest of the run keeps
// the fastest, as NCCL's tuner plugins and MPI autotuners do.
//
// The ranks must agree on the algorithm of every call: a schedule is one
// plan for all members, and two members running different ones would read
// half-written buffers or wait forever. So every decision here is made
// from shared state, identically on every member:
//
//   - the candidates of a size class are fixed by its first call, from the
//     call's shape and the model, which every member shares;
//   - trial k of a class runs candidate k mod len(candidates) on every
//     member (each member counts its own calls of the class; members make
//     the same calls in the same order);
//   - each member records its time for trial k in the group's state
//     before it departs from the call; the decision, taken at the first
//     call after the trials, reads every member's times, which are all
//     there because every member has arrived at that call. It is taken
//     once, under the group's lock, and every member reads the result.
//
// A trial's time is the span from the last member starting to move data
// (when all are in: members start apart by however late each noticed the
// last arrival, which is no part of the algorithm) to the last one
// departing, so that peers still reading a member's buffers count (the
// members share one monotonic clock), per element, so that calls of one
// class with different counts compare fairly; a candidate's score is its
// median trial. Each timed call follows an untimed one of the same
// candidate, which pays for first touches and for the cache state the
// previous candidate left. The first round times every candidate once, the
// second those within firstPruneFactor of the best, and each later one
// those within pruneFactor, so that a hopeless candidate costs two calls.
// The trials of each round are planned, like the decision, once every
// member has recorded the round before, by the first member to need the
// plan, and the others read it.

// Tuning says which calls online tuning may time (WithTuning, TuneEnv).
type Tuning uint8

const (
	// TuneExact, the default, tunes only calls whose result cannot depend
	// on the algorithm: copies (AllGather, Broadcast), integer reductions,
	// and float Sum, Avg and Prod over two ranks (one operation per
	// element, and IEEE addition and multiplication are commutative). So
	// tuning never changes a result bit (NaN payloads aside), and a program
	// run twice computes the same bits.
	TuneExact Tuning = iota
	// TuneAll also tunes float reductions over three or more ranks, and
	// float Min and Max (whose result for +0 against -0 depends on the
	// order). Algorithms add in different orders, so a reduction's last
	// bits can then differ between two runs of one program, and between
	// the first calls of a run and the later ones (never between ranks).
	TuneAll
	// TuneOff chooses every algorithm from the cost model alone.
	TuneOff
)

// String returns the mode's name as TuneEnv accepts it.
func (t Tuning) String() string {
	switch t {
	case TuneExact:
		return "exact"
	case TuneAll:
		return "all"
	case TuneOff:
		return "off"
	}
	return fmt.Sprintf("Tuning(%d)", uint8(t))
}

// TuneEnv sets the Tuning of every world given no WithTuning option:
// "exact" (or unset, or blank) is TuneExact, "all" TuneAll, "off" (or
// "0", "false", "none") TuneOff. Case and surrounding blanks do not
// matter; any other value makes NewWorld and Run fail with an error
// wrapping comm.ErrInvalid.
const TuneEnv = "LOOM_TUNE"

// WithTuning sets which calls online tuning of the automatic algorithm
// choice may time, for one world, whatever TuneEnv says. A call it may
// time, whose candidates the cost model finds close, is timed on the first
// calls of its (op, dtype, size class): each candidate up to 4 times, 6
// for calls under 256 KiB, each timed call after an untimed one, dropping
// after each
// round those more than three, then two, times slower than the best (at
// most MaxTuningCalls calls); the rest of the run keeps the fastest, or
// the model's choice unless another beats it by more than keepMargin.
// For bitwise reproducible float reductions over more than two ranks keep
// TuneExact (the default) or TuneOff, or force the algorithms with
// comm.AlgorithmEnv (LOOM_ALGO). An unknown mode makes NewWorld and Run
// fail with an error wrapping comm.ErrInvalid.
func WithTuning(mode Tuning) Option {
	return func(c *config) { c.tune, c.tuneSet = mode, true }
}

// tuning returns the mode of worlds made with c: as WithTuning says, else
// as TuneEnv says.
func (c *config) tuning() (Tuning, error) {
	if c.tuneSet {
		if c.tune > TuneOff {
			return 0, fmt.Errorf("local: WithTuning(%v): %w: want TuneExact, TuneAll or TuneOff", c.tune, comm.ErrInvalid)
		}
		return c.tune, nil
	}
	return parseTune(os.Getenv(TuneEnv))
}

// parseTune parses a TuneEnv value.
func parseTune(v string) (Tuning, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "exact":
		return TuneExact, nil
	case "all":
		return TuneAll, nil
	case "off", "0", "false", "none":
		return TuneOff, nil
	}
	return 0, fmt.Errorf("local: %s=%q: %w: want exact (tune only where the result cannot change: the default), all (tune float reductions too; their last bits may differ between runs) or off", TuneEnv, v, comm.ErrInvalid)
}

// exact reports whether every algorithm gives op over p ranks the same
// result bits, so that TuneExact may time it.
func exact(op comm.Op, red comm.ReduceOp, dt comm.DType, p int) bool {
	switch {
	case !op.Reduces(), !dt.IsFloat():
		return true
	case p == 2:
		return red == comm.Sum || red == comm.Avg || red == comm.Prod
	}
	return false
}

const (
	// tuneMargin: candidates whose modelled cost is within this fraction
	// of the best are timed.
	tuneMargin = 0.5
	// maxCandidates bounds the candidates timed per size class.
	maxCandidates = 4
	// tunedRounds is how many times a candidate that stays close runs;
	// calls of fewer than smallCallBytes per rank take a few microseconds,
	// where one preemption is many times the call, so they run
	// smallRounds times: more samples for the same cost.
	tunedRounds    = 4
	smallRounds    = 6
	smallCallBytes = 256 << 10
	// pruneFactor: after the second round, candidates slower than this
	// many times the best score so far are not timed again; after the
	// first, with one sample each, those slower than firstPruneFactor.
	pruneFactor      = 2
	firstPruneFactor = 3
	// minTunedCost: calls the model prices below this many seconds are
	// not tuned. Their time is their synchronisations, which the model
	// counts, and one such call varies by more than the algorithms differ.
	minTunedCost = 10e-6
	// keepMargin: the model's choice is kept unless another candidate's
	// score beats it by more than this fraction, so that timing noise
	// alone does not overturn the model.
	keepMargin = 0.2
)

// MaxTuningCalls bounds the calls of one size class that tuning spends
// (timed and untimed): after these, every call of the class
// runs the chosen algorithm. Benchmarks that want the steady state warm up
// for this many calls.
const MaxTuningCalls = 2 * maxCandidates * max(tunedRounds, smallRounds)

// tuneKey is a size class of calls that share one decision. Roots and
// in-place patterns share it: they change the schedule, not which
// algorithm is fastest.
type tuneKey struct {
	op     comm.Op
	dtype  comm.DType
	class  int // bits.Len of the per-rank count: one class per power of two
	avg    bool
	stream bool
}

// tuning is the shared state of one size class.
type tuning struct {
	cands   []comm.Algorithm // the model's choice first
	plan    []int            // the candidate of each trial planned so far
	timed   []bool           // whether each trial counts (the others warm up)
	trials  []timedCall      // by trial, as the members record them
	round   int              // rounds planned
	rounds  int              // rounds to run
	decided bool
	best    comm.Algorithm
}

// timedCall is what the members record of one trial.
type timedCall struct {
	n          int         // elements per member
	start, end []time.Time // by member; zero until recorded
}

// trial is one member's part in a timed call.
type trial struct {
	t *tuning
	k int
}

// autoAlgorithm returns the algorithm of a call left to the backend and,
// while its size class is being tuned, the trial this call is.
func (c *Comm) autoAlgorithm(pl plan, inPlace []byte, dt comm.DType, red comm.ReduceOp) (comm.Algorithm, *trial) {
	g := c.g
	switch {
	case g.w.tune == TuneOff, g.w.tune == TuneExact && !exact(pl.op, red, dt, g.size), g.size == 1, len(Algorithms(pl.op)) < 2:
		return g.choose(pl, inPlace, dt), nil
	}
	key := tuneKey{op: pl.op, dtype: dt, class: bits.Len(uint(pl.n)), avg: pl.avg, stream: pl.stream}
	g.schedMu.Lock()
	t := g.tunes[key]
	g.schedMu.Unlock()
	if t == nil {
		// Every member computes the same list; the first to store it wins.
		cands := g.candidates(pl, inPlace, dt)
		g.schedMu.Lock()
		if t = g.tunes[key]; t == nil {
			t = &tuning{cands: cands, round: 1, rounds: tunedRounds}
			if pl.n*dt.Size() < smallCallBytes {
				t.rounds = smallRounds
			}
			t.add(identity(len(cands)))
			if len(cands) == 1 {
				t.decided, t.best = true, cands[0]
			}
			g.tunes[key] = t
		}
		g.schedMu.Unlock()
	}
	k := c.tuneCalls[key]
	g.schedMu.Lock()
	defer g.schedMu.Unlock()
	if !t.decided && k == len(t.plan) {
		// Every member has recorded every trial planned so far (each has
		// arrived at this call): plan the next round, or decide.
		t.next(g.w.trialTime)
	}
	if !t.decided && k < len(t.plan) {
		c.tuneCalls[key] = k + 1
		return t.cands[t.plan[k]], &trial{t: t, k: k}
	}
	return t.best, nil
}

// next plans the next round of trials from the scores so far, or, after
// its rounds or when one candidate is left, decides.
func (t *tuning) next(trialTime func(comm.Algorithm, time.Duration) time.Duration) {
	scores := t.scores(trialTime)
	best := 0
	for i, s := range scores {
		if s < scores[best] {
			best = i
		}
	}
	var left []int
	for i, s := range scores {
		// One sample may be disturbed: prune only the hopeless at first.
		if s <= scores[best]*t.pruneAt() {
			left = append(left, i)
		}
	}
	if t.round < t.rounds && len(left) > 1 {
		t.add(left)
		t.round++
		return
	}
	if scores[0] <= scores[best]*(1+keepMargin) {
		best = 0
	}
	t.best, t.decided = t.cands[best], true
}

// scores returns each candidate's median trial in seconds per element
// (+Inf for a candidate never timed). The median, not the minimum: calls
// of a few microseconds vary by more than the algorithms differ, and the
// minimum of such samples favours whichever varies most.
func (t *tuning) scores(trialTime func(comm.Algorithm, time.Duration) time.Duration) []float64 {
	samples := make([][]float64, len(t.cands))
	for k, tc := range t.trials {
		if !t.timed[k] {
			continue // a warmup
		}
		var first, last time.Time
		for m := range tc.start {
			if tc.start[m].IsZero() || tc.end[m].IsZero() {
				continue // cannot happen: every member records before its next call
			}
			if tc.start[m].After(first) {
				first = tc.start[m]
			}
			if tc.end[m].After(last) {
				last = tc.end[m]
			}
		}
		if first.IsZero() {
			continue
		}
		i := t.plan[k]
		span := last.Sub(first)
		if trialTime != nil {
			span = trialTime(t.cands[i], span)
		}
		samples[i] = append(samples[i], max(span.Seconds(), 1e-9)/float64(max(tc.n, 1)))
	}
	out := make([]float64, len(t.cands))
	for i, xs := range samples {
		out[i] = math.Inf(1)
		if len(xs) > 0 {
			slices.Sort(xs)
			out[i] = (xs[(len(xs)-1)/2] + xs[len(xs)/2]) / 2
		}
	}
	return out
}

// record stores when this member started moving the data of its trial
// and when it departed.
func (g *group) record(tr *trial, rank int, start, end time.Time, n int) {
	g.schedMu.Lock()
	defer g.schedMu.Unlock()
	t := tr.t
	for len(t.trials) <= tr.k {
		t.trials = append(t.trials, timedCall{n: n, start: make([]time.Time, g.size), end: make([]time.Time, g.size)})
	}
	t.trials[tr.k].start[rank], t.trials[tr.k].end[rank] = start, end
}

// candidates lists the algorithms worth timing for pl (only the model's
// choice when the model prices it below minTunedCost): the model's choice
// first, then the others it prices within tuneMargin of its best (at most
// maxCandidates), and the built-in model's choice, so that a model skewed
// by a disturbed calibration cannot hide the algorithm a typical machine
// runs best.
func (g *group) candidates(pl plan, inPlace []byte, dt comm.DType) []comm.Algorithm {
	type priced struct {
		a    comm.Algorithm
		cost float64
	}
	first := g.chooseBy(g.w.model, pl, inPlace, dt)
	out := []comm.Algorithm{first}
	var ps []priced
	bestCost := math.Inf(1)
	for _, cand := range Algorithms(pl.op) {
		pl.algo = cand
		s, err := g.compiled(pl, inPlace)
		if err != nil {
			continue
		}
		c := s.cost(g.w.model, dt)
		bestCost = min(bestCost, c)
		if cand != first {
			ps = append(ps, priced{cand, c})
		}
	}
	if bestCost < minTunedCost {
		return out
	}
	slices.SortStableFunc(ps, func(x, y priced) int {
		switch {
		case x.cost < y.cost:
			return -1
		case x.cost > y.cost:
			return 1
		}
		return 0
	})
	for _, p := range ps {
		if len(out) < maxCandidates && p.cost <= bestCost*(1+tuneMargin) {
			out = append(out, p.a)
		}
	}
	if b := g.chooseBy(comm.BuiltinCostModel(), pl, inPlace, dt); !slices.Contains(out, b) {
		if len(out) == maxCandidates {
			out = out[:maxCandidates-1]
		}
		out = append(out, b)
	}
	return out
}

// pruneAt is the factor over the best score beyond which a candidate is
// not timed in the next round.
func (t *tuning) pruneAt() float64 {
	if t.round < 2 {
		return firstPruneFactor
	}
	return pruneFactor
}

// add plans a round: each candidate twice in a row, the first call untimed,
// so that the timed one does not pay for the state (whose cache holds
// which lines of the buffers) that the previous candidate left.
func (t *tuning) add(cands []int) {
	for _, i := range cands {
		t.plan = append(t.plan, i, i)
		t.timed = append(t.timed, false, true)
	}
}
