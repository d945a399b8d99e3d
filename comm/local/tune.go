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
// A trial's time is the slowest member's, per element, so that calls of
// one class with different counts compare fairly; a candidate's score is
// its fastest trial, since other work on the machine only adds time.

// TuneEnv turns online tuning off for every world given no WithTuning
// option: "0", "false" or "off" chooses every algorithm from the cost
// model alone; unset, "", "1", "true" or "on" tunes. Case and surrounding
// blanks do not matter; any other value makes NewWorld and Run fail with
// an error wrapping comm.ErrInvalid.
const TuneEnv = "LOOM_TUNE"

// WithTuning turns online tuning of the automatic algorithm choice on or
// off for one world, whatever TuneEnv says. With it on (the default), the
// first calls of each (op, dtype, size class) whose candidates the cost
// model finds close run each of them tunedRounds times and keep the
// fastest. Float sums depend on the order in which an algorithm adds, so
// with tuning on a reduction's last bits can differ between two runs of
// the same program (never between the ranks of one run), and the first
// calls of a run may use different algorithms from the later ones. Turn it
// off, or force the algorithms with comm.AlgorithmEnv (LOOM_ALGO), for
// bitwise reproducible runs; copies (AllGather, Broadcast) and integer,
// Min and Max reductions give the same bits whatever the algorithm.
func WithTuning(on bool) Option {
	return func(c *config) { c.tune, c.tuneSet = on, true }
}

// tuning reports whether worlds made with c tune: as WithTuning says, else
// as TuneEnv says.
func (c *config) tuning() (bool, error) {
	if c.tuneSet {
		return c.tune, nil
	}
	return parseTune(os.Getenv(TuneEnv))
}

// parseTune parses a TuneEnv value.
func parseTune(v string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "1", "true", "on":
		return true, nil
	case "0", "false", "off":
		return false, nil
	}
	return false, fmt.Errorf("local: %s=%q: %w: want 0, false or off to choose algorithms from the cost model alone, or 1, true or on", TuneEnv, v, comm.ErrInvalid)
}

const (
	// tuneMargin: candidates whose modelled cost is within this fraction
	// of the best are timed.
	tuneMargin = 0.5
	// maxCandidates bounds the candidates timed per size class.
	maxCandidates = 4
	// tunedRounds is how many times each candidate runs.
	tunedRounds = 3
)

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
	cands   []comm.Algorithm
	secs    [][]float64 // [trial][member]: seconds per element, 0 until recorded
	decided bool
	best    comm.Algorithm
}

// trial is one member's part in a timed call.
type trial struct {
	t *tuning
	k int
}

// autoAlgorithm returns the algorithm of a call left to the backend and,
// while its size class is being tuned, the trial this call is.
func (c *Comm) autoAlgorithm(pl plan, inPlace []byte, dt comm.DType) (comm.Algorithm, *trial) {
	g := c.g
	if !g.w.tune || g.size == 1 || len(Algorithms(pl.op)) < 2 {
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
			t = &tuning{cands: cands, secs: make([][]float64, len(cands)*tunedRounds)}
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
	if !t.decided && k < len(t.secs) {
		c.tuneCalls[key] = k + 1
		return t.cands[k%len(t.cands)], &trial{t: t, k: k}
	}
	if !t.decided {
		t.best = t.decide()
		t.decided = true
	}
	return t.best, nil
}

// decide returns the candidate with the fastest trial, each trial timed as
// its slowest member. Called once every trial is recorded.
func (t *tuning) decide() comm.Algorithm {
	best, bestScore := t.cands[0], math.Inf(1)
	for i, cand := range t.cands {
		score := math.Inf(1)
		for k := i; k < len(t.secs); k += len(t.cands) {
			slowest := 0.0
			for _, s := range t.secs[k] {
				slowest = max(slowest, s)
			}
			if slowest > 0 {
				score = min(score, slowest)
			}
		}
		if score < bestScore {
			best, bestScore = cand, score
		}
	}
	return best
}

// record stores this member's time for its trial.
func (g *group) record(tr *trial, rank int, elapsed time.Duration, n int) {
	if g.w.trialTime != nil {
		elapsed = g.w.trialTime(tr.t.cands[tr.k%len(tr.t.cands)], elapsed)
	}
	secs := max(elapsed.Seconds(), 1e-9) / float64(max(n, 1))
	g.schedMu.Lock()
	defer g.schedMu.Unlock()
	if tr.t.secs[tr.k] == nil {
		tr.t.secs[tr.k] = make([]float64, g.size)
	}
	tr.t.secs[tr.k][rank] = secs
}

// candidates lists the algorithms worth timing for pl: those the model
// prices within tuneMargin of its best (the best first, at most
// maxCandidates), and the built-in model's choice, so that a model skewed
// by a disturbed calibration cannot hide the algorithm a typical machine
// runs best.
func (g *group) candidates(pl plan, inPlace []byte, dt comm.DType) []comm.Algorithm {
	type priced struct {
		a    comm.Algorithm
		cost float64
	}
	var ps []priced
	for _, cand := range Algorithms(pl.op) {
		pl.algo = cand
		s, err := g.compiled(pl, inPlace)
		if err != nil {
			continue
		}
		ps = append(ps, priced{cand, s.cost(g.w.model, dt)})
	}
	if len(ps) == 0 {
		return []comm.Algorithm{comm.Direct}
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
	var out []comm.Algorithm
	for _, p := range ps {
		if len(out) < maxCandidates && p.cost <= ps[0].cost*(1+tuneMargin) {
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
