package pp

import (
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/internal/numcheck"
)

// key names one action of a schedule independently of where it runs.
type key struct {
	stage int
	kind  Kind
	mb    int
}

func keyOf(a Action) key { return key{a.Stage, a.Kind, a.MicroBatch} }

func (k key) String() string { return Action{Stage: k.stage, Kind: k.kind, MicroBatch: k.mb}.String() }

// loc is where an action is: rank and position in the rank's list.
type loc struct{ rank, pos int }

// dep is one input of an action: the action at loc must have ended, and
// comm says whether a transfer between ranks lies in between (Costs.Comm
// is added).
type dep struct {
	at   loc
	comm bool
	// gather says that the input is a stage's Unshard, whose all-gather
	// takes Costs.Unshard after it.
	gather bool
}

// graph is a checked schedule with each action's inputs.
type graph struct {
	s    *Schedule
	at   map[key]loc
	deps [][][]dep // deps[r][i]: inputs of rank r's i-th action
}

// where formats an action's place for errors.
func where(r, p int, a Action) string {
	return fmt.Sprintf("rank %d position %d: %v", r, p, a)
}

// Validate checks s before anything runs: counts and placement; every
// action names a stage the rank holds and a micro-batch in range, and
// appears once; each (stage, micro-batch) has one F and either one B or
// one I and one W, a backward after its forward and W after I; in a
// lowered schedule every send has its receive (same micro-batch, stage
// pair and direction), each forward or backward whose neighbour stage is
// on another rank has its receive before it and its send after it, and
// Unshard, Reshard and ReduceGrad come before or after all the stage's
// compute. Last, a simulation of the lists with blocking receives and
// asynchronous sends must finish. An error is ErrInvalid naming the rank,
// the position in its list and the action; a deadlock is ErrDeadlock and
// names the action each stuck rank waits at and what it waits for.
func (s *Schedule) Validate() error {
	g, err := s.check()
	if err != nil {
		return err
	}
	_, err = g.run(UnitCosts())
	return err
}

// checkCounts checks the fields other than the action lists.
func (s *Schedule) checkCounts() error {
	if s == nil {
		return fmt.Errorf("%w: nil schedule", ErrInvalid)
	}
	if err := numcheck.Count(ErrInvalid, "schedule: ranks", s.Ranks); err != nil {
		return err
	}
	if err := numcheck.Count(ErrInvalid, "schedule: stages per rank", s.StagesPerRank); err != nil {
		return err
	}
	if err := numcheck.Count(ErrInvalid, "schedule: micro-batches", s.MicroBatches); err != nil {
		return err
	}
	if s.Placement != Loop && s.Placement != VShape {
		return fmt.Errorf("%w: schedule: placement %v: want loop or v", ErrInvalid, s.Placement)
	}
	if len(s.Actions) != s.Ranks {
		return fmt.Errorf("%w: schedule: %d action lists for %d ranks", ErrInvalid, len(s.Actions), s.Ranks)
	}
	return nil
}

// check runs the static checks and returns the dependency graph.
func (s *Schedule) check() (*graph, error) {
	if err := s.checkCounts(); err != nil {
		return nil, err
	}
	n := s.Stages()
	total := 0
	for _, acts := range s.Actions {
		total += len(acts)
	}
	g := &graph{s: s, at: make(map[key]loc, total)}
	for r, acts := range s.Actions {
		for p, a := range acts {
			if err := s.checkAction(r, p, a); err != nil {
				return nil, err
			}
			k := keyOf(a)
			if prev, dup := g.at[k]; dup {
				return nil, fmt.Errorf("%w: %s: repeats the action of rank %d position %d", ErrInvalid, where(r, p, a), prev.rank, prev.pos)
			}
			g.at[k] = loc{r, p}
		}
	}
	// Every (stage, micro-batch) has its forward and one backward, in
	// order on the stage's rank.
	for st := range n {
		r := s.RankOf(st)
		for mb := range s.MicroBatches {
			f, ok := g.at[key{st, F, mb}]
			if !ok {
				return nil, fmt.Errorf("%w: rank %d: stage %d micro-batch %d has no forward %v", ErrInvalid, r, st, mb, key{st, F, mb})
			}
			b, hasB := g.at[key{st, B, mb}]
			i, hasI := g.at[key{st, I, mb}]
			w, hasW := g.at[key{st, W, mb}]
			fa := s.Actions[r][f.pos]
			switch {
			case hasB && (hasI || hasW):
				other := i
				if !hasI {
					other = w
				}
				return nil, fmt.Errorf("%w: %s: the backward of stage %d micro-batch %d is also split (%v at position %d): B or I and W, not both",
					ErrInvalid, where(r, b.pos, s.Actions[r][b.pos]), st, mb, s.Actions[r][other.pos], other.pos)
			case hasI && !hasW:
				return nil, fmt.Errorf("%w: %s: no %v follows this backward for inputs", ErrInvalid, where(r, i.pos, s.Actions[r][i.pos]), key{st, W, mb})
			case hasW && !hasI:
				return nil, fmt.Errorf("%w: %s: no %v precedes this backward for weights", ErrInvalid, where(r, w.pos, s.Actions[r][w.pos]), key{st, I, mb})
			case !hasB && !hasI:
				return nil, fmt.Errorf("%w: %s: stage %d micro-batch %d has no backward (%v, or %v and %v)",
					ErrInvalid, where(r, f.pos, fa), st, mb, key{st, B, mb}, key{st, I, mb}, key{st, W, mb})
			}
			grad := b
			if hasI {
				grad = i
				if w.pos < i.pos {
					return nil, fmt.Errorf("%w: %s: before its backward for inputs %v (position %d)", ErrInvalid, where(r, w.pos, s.Actions[r][w.pos]), key{st, I, mb}, i.pos)
				}
			}
			if grad.pos < f.pos {
				return nil, fmt.Errorf("%w: %s: backward before its forward %v (position %d)", ErrInvalid, where(r, grad.pos, s.Actions[r][grad.pos]), fa, f.pos)
			}
		}
	}
	if s.Lowered() {
		if err := g.checkComm(); err != nil {
			return nil, err
		}
	}
	g.buildDeps()
	return g, nil
}

// checkAction checks one action's fields against the schedule.
func (s *Schedule) checkAction(r, p int, a Action) error {
	n := s.Stages()
	switch {
	case a.Kind < F || a.Kind > ReduceGrad:
		return fmt.Errorf("%w: rank %d position %d: unknown kind %d", ErrInvalid, r, p, a.Kind)
	case a.Stage < 0 || a.Stage >= n:
		return fmt.Errorf("%w: %s: stage %d out of range [0, %d)", ErrInvalid, where(r, p, a), a.Stage, n)
	case s.RankOf(a.Stage) != r:
		return fmt.Errorf("%w: %s: stage %d is on rank %d (%v placement)", ErrInvalid, where(r, p, a), a.Stage, s.RankOf(a.Stage), s.Placement)
	case a.Kind.PerStage() && a.MicroBatch != NoMicroBatch:
		return fmt.Errorf("%w: %s: micro-batch %d on a per-stage action (want NoMicroBatch)", ErrInvalid, where(r, p, a), a.MicroBatch)
	case !a.Kind.PerStage() && (a.MicroBatch < 0 || a.MicroBatch >= s.MicroBatches):
		return fmt.Errorf("%w: %s: micro-batch %d out of range [0, %d)", ErrInvalid, where(r, p, a), a.MicroBatch, s.MicroBatches)
	}
	if !a.Kind.Comm() {
		return nil
	}
	want := peerOf(a.Stage, a.Kind)
	switch {
	case a.Peer != want:
		return fmt.Errorf("%w: %s: peer stage %d, want %d (activations go to the next stage, gradients to the previous)", ErrInvalid, where(r, p, a), a.Peer, want)
	case want < 0 || want >= n:
		return fmt.Errorf("%w: %s: stage %d has no neighbour stage %d", ErrInvalid, where(r, p, a), a.Stage, want)
	case s.RankOf(want) == r:
		return fmt.Errorf("%w: %s: stage %d is on the same rank (stages on one rank pass by memory, without a send)", ErrInvalid, where(r, p, a), want)
	}
	return nil
}

// checkComm checks a lowered schedule's communication and per-stage
// actions.
func (g *graph) checkComm() error {
	s := g.s
	n := s.Stages()
	// Every send has its receive and every receive its send.
	pairs := [][2]Kind{{SendF, RecvF}, {RecvF, SendF}, {SendB, RecvB}, {RecvB, SendB}}
	for r, acts := range s.Actions {
		for p, a := range acts {
			for _, pr := range pairs {
				if a.Kind != pr[0] {
					continue
				}
				other := key{a.Peer, pr[1], a.MicroBatch}
				if _, ok := g.at[other]; !ok {
					return fmt.Errorf("%w: %s: no matching %v on rank %d", ErrInvalid, where(r, p, a), other, s.RankOf(a.Peer))
				}
			}
		}
	}
	// Crossing a rank boundary needs the receive before and the send
	// after the compute action.
	need := func(st, mb int, compute key, k Kind, before bool) error {
		c := g.at[compute]
		ca := s.Actions[c.rank][c.pos]
		x, ok := g.at[key{st, k, mb}]
		want := key{st, k, mb}
		switch {
		case !ok:
			return fmt.Errorf("%w: %s: stage %d is on rank %d and no %v carries the data", ErrInvalid, where(c.rank, c.pos, ca), peerOf(st, k), s.RankOf(peerOf(st, k)), want)
		case before && x.pos > c.pos:
			return fmt.Errorf("%w: %s: its receive %v comes after it (position %d)", ErrInvalid, where(c.rank, c.pos, ca), want, x.pos)
		case !before && x.pos < c.pos:
			return fmt.Errorf("%w: %s: sends before the data exists (%v at position %d)", ErrInvalid, where(x.rank, x.pos, s.Actions[x.rank][x.pos]), ca, c.pos)
		}
		return nil
	}
	for st := range n {
		r := s.RankOf(st)
		prevCross := st > 0 && s.RankOf(st-1) != r
		nextCross := st < n-1 && s.RankOf(st+1) != r
		for mb := range s.MicroBatches {
			fk := key{st, F, mb}
			gk := key{st, B, mb}
			if _, ok := g.at[gk]; !ok {
				gk = key{st, I, mb}
			}
			var err error
			if prevCross {
				if err = need(st, mb, fk, RecvF, true); err == nil {
					err = need(st, mb, gk, SendB, false)
				}
			}
			if err == nil && nextCross {
				if err = need(st, mb, fk, SendF, false); err == nil {
					err = need(st, mb, gk, RecvB, true)
				}
			}
			if err != nil {
				return err
			}
		}
		if err := g.checkPerStage(st, r); err != nil {
			return err
		}
	}
	return nil
}

// checkPerStage checks that Unshard comes before all of stage st's
// compute, Reshard after all of it, and ReduceGrad after its backwards.
func (g *graph) checkPerStage(st, r int) error {
	s := g.s
	un, hasUn := g.at[key{st, Unshard, NoMicroBatch}]
	re, hasRe := g.at[key{st, Reshard, NoMicroBatch}]
	red, hasRed := g.at[key{st, ReduceGrad, NoMicroBatch}]
	if hasUn != hasRe {
		x := un
		if hasRe {
			x = re
		}
		return fmt.Errorf("%w: %s: UNSHARD and RESHARD of a stage come in pairs", ErrInvalid, where(r, x.pos, s.Actions[r][x.pos]))
	}
	for p, a := range s.Actions[r] {
		if a.Stage != st || !a.Kind.Compute() {
			continue
		}
		switch {
		case hasUn && p < un.pos:
			return fmt.Errorf("%w: %s: runs before its stage's %v (position %d)", ErrInvalid, where(r, p, a), s.Actions[r][un.pos], un.pos)
		case hasRe && p > re.pos:
			return fmt.Errorf("%w: %s: runs after its stage's %v (position %d)", ErrInvalid, where(r, p, a), s.Actions[r][re.pos], re.pos)
		case hasRed && p > red.pos && (a.Kind == B || a.Kind == W):
			return fmt.Errorf("%w: %s: runs after its stage's %v (position %d): the gradients are reduced once, after the last backward", ErrInvalid, where(r, p, a), s.Actions[r][red.pos], red.pos)
		}
	}
	return nil
}

// buildDeps fills g.deps: each action's inputs.
func (g *graph) buildDeps() {
	s := g.s
	n := s.Stages()
	lowered := s.Lowered()
	g.deps = make([][][]dep, s.Ranks)
	// gradOf is the action that makes the gradient of stage st's input.
	gradOf := func(st, mb int) loc {
		if l, ok := g.at[key{st, B, mb}]; ok {
			return l
		}
		return g.at[key{st, I, mb}]
	}
	for r, acts := range s.Actions {
		g.deps[r] = make([][]dep, len(acts))
		for p, a := range acts {
			var ds []dep
			local := func(l loc) { ds = append(ds, dep{at: l}) }
			// from adds the input made by the neighbour stage nb: through
			// memory on one rank, through recv (lowered) or an implicit
			// transfer (compute-only) across ranks.
			from := func(nb int, made loc, recv Kind) {
				switch {
				case s.RankOf(nb) == r:
					local(made)
				case lowered:
					local(g.at[key{a.Stage, recv, a.MicroBatch}])
				default:
					ds = append(ds, dep{at: made, comm: true})
				}
			}
			st, mb := a.Stage, a.MicroBatch
			switch a.Kind {
			case F:
				if st > 0 {
					from(st-1, g.at[key{st - 1, F, mb}], RecvF)
				}
			case B, I:
				local(g.at[key{st, F, mb}])
				if st < n-1 {
					from(st+1, gradOf(st+1, mb), RecvB)
				}
			case W:
				local(g.at[key{st, I, mb}])
			case SendF:
				local(g.at[key{st, F, mb}])
			case SendB:
				local(gradOf(st, mb))
			case RecvF:
				ds = append(ds, dep{at: g.at[key{st - 1, SendF, mb}], comm: true})
			case RecvB:
				ds = append(ds, dep{at: g.at[key{st + 1, SendB, mb}], comm: true})
			}
			if a.Kind.Compute() {
				if l, ok := g.at[key{st, Unshard, NoMicroBatch}]; ok {
					ds = append(ds, dep{at: l, gather: true})
				}
			}
			g.deps[r][p] = ds
		}
	}
}

// run simulates the lists with costs c: each rank runs its list in
// order, an action starts when the rank is free and its inputs exist.
func (g *graph) run(c Costs) (*Simulation, error) {
	s := g.s
	cost := func(a Action) float64 {
		f := 1.0
		if c.Stage != nil {
			f = c.Stage[a.Stage]
		}
		switch a.Kind {
		case F:
			return f * c.F
		case B:
			return f * c.B
		case I:
			return f * c.I
		case W:
			return f * c.W
		}
		return 0 // communication is asynchronous: its time is on the edge
	}
	sim := &Simulation{
		Start: make([][]float64, s.Ranks), End: make([][]float64, s.Ranks),
		Busy: make([]float64, s.Ranks),
	}
	next := make([]int, s.Ranks)
	clock := make([]float64, s.Ranks)
	for r, acts := range s.Actions {
		sim.Start[r] = make([]float64, len(acts))
		sim.End[r] = make([]float64, len(acts))
	}
	for progress := true; progress; {
		progress = false
		for r, acts := range s.Actions {
		rank:
			for next[r] < len(acts) {
				p := next[r]
				t := clock[r]
				for _, d := range g.deps[r][p] {
					if next[d.at.rank] <= d.at.pos {
						break rank
					}
					e := sim.End[d.at.rank][d.at.pos]
					if d.comm {
						e += c.Comm
					}
					if d.gather {
						e += c.Unshard
					}
					t = max(t, e)
				}
				d := cost(acts[p])
				sim.Start[r][p], sim.End[r][p] = t, t+d
				sim.Busy[r] += d
				clock[r] = t + d
				next[r]++
				progress = true
			}
		}
	}
	var stuck []string
	for r, acts := range s.Actions {
		if p := next[r]; p < len(acts) {
			for _, d := range g.deps[r][p] {
				if next[d.at.rank] <= d.at.pos {
					w := s.Actions[d.at.rank][d.at.pos]
					stuck = append(stuck, fmt.Sprintf("%s waits for %v (rank %d position %d)", where(r, p, acts[p]), w, d.at.rank, d.at.pos))
					break
				}
			}
		}
	}
	if len(stuck) > 0 {
		return nil, fmt.Errorf("%w: %s", ErrDeadlock, strings.Join(stuck, "; "))
	}
	for r := range s.Ranks {
		sim.Makespan = max(sim.Makespan, clock[r])
	}
	var busy float64
	for _, b := range sim.Busy {
		busy += b
	}
	if sim.Makespan > 0 {
		sim.Bubble = 1 - busy/(float64(s.Ranks)*sim.Makespan)
	}
	sim.PeakActivations, sim.RankPeakActivations = s.peakActivations()
	return sim, nil
}

// peakActivations returns, per stage and per rank, the largest number of
// micro-batches whose activations are held at once: from the F until the
// B, or until the W when the backward is split. A stage lives on one
// rank, so its rank's list order decides.
func (s *Schedule) peakActivations() (stage, rank []int) {
	held := make([]int, s.Stages())
	stage = make([]int, s.Stages())
	rank = make([]int, s.Ranks)
	for r, acts := range s.Actions {
		total := 0
		for _, a := range acts {
			switch a.Kind {
			case F:
				held[a.Stage]++
				total++
				stage[a.Stage] = max(stage[a.Stage], held[a.Stage])
				rank[r] = max(rank[r], total)
			case B, W:
				held[a.Stage]--
				total--
			}
		}
	}
	return stage, rank
}

// Infer returns the schedule of a user's own per-rank action lists: the
// ranks are len(actions), the stages and micro-batches those the actions
// name (the highest plus one), the placement loop or V, whichever puts
// every action's stage on its rank (loop where both do). The schedule is
// validated; an error names the rank, position and action at fault.
func Infer(name string, actions [][]Action) (*Schedule, error) {
	if len(actions) == 0 {
		return nil, fmt.Errorf("%w: schedule %q: no ranks", ErrInvalid, name)
	}
	maxStage, maxMB := -1, -1
	for r, acts := range actions {
		for p, a := range acts {
			if a.Stage < 0 {
				return nil, fmt.Errorf("%w: %s: negative stage", ErrInvalid, where(r, p, a))
			}
			maxStage = max(maxStage, a.Stage)
			maxMB = max(maxMB, a.MicroBatch)
		}
	}
	ranks := len(actions)
	if maxStage < 0 {
		return nil, fmt.Errorf("%w: schedule %q: no actions", ErrInvalid, name)
	}
	if (maxStage+1)%ranks != 0 {
		return nil, fmt.Errorf("%w: schedule %q: %d stages on %d ranks: every rank must hold the same number of stages", ErrInvalid, name, maxStage+1, ranks)
	}
	s := &Schedule{Name: name, Ranks: ranks, StagesPerRank: (maxStage + 1) / ranks, MicroBatches: maxMB + 1, Actions: actions}
	fits := func(p Placement) bool {
		for r, acts := range actions {
			for _, a := range acts {
				if rankOf(p, ranks, a.Stage) != r {
					return false
				}
			}
		}
		return true
	}
	if !fits(Loop) && fits(VShape) {
		s.Placement = VShape
	}
	if err := s.Validate(); err != nil {
		return nil, err
	}
	return s, nil
}
