package pp

import "fmt"

// Interleaved1F1B returns the interleaved 1F1B schedule (Narayanan et al.
// 2021, Megatron-LM's interleaved schedule): each rank holds
// stagesPerRank stages placed in a loop (rank r holds r, r+Ranks, …), and
// runs the micro-batches in groups of G: forwards of a group on its first
// stage, then on its second, …, and backwards in the reverse order of
// stages. Rank r warms up with (V−1)·G + 2·(Ranks−1−r) forwards, then
// alternates one forward and one full backward. The bubble shrinks by
// the factor V against OneFOneB: (Ranks−1)/(V·M + Ranks−1) with F=1, B=2.
//
// The rule on micro-batches is PyTorch's, which relaxes Megatron's
// "M a multiple of Ranks" (G = Ranks): the M micro-batches run in
// R = ⌊M/Ranks⌋ rounds of G = M/R each, so M must be at least Ranks and a
// multiple of R (Ranks=4: 4 to 8, 10, 12, 15, 16, …; the error names
// the nearest). stagesPerRank must be at least 2 (with one stage per rank
// it is OneFOneB).
func Interleaved1F1B(ranks, microBatches, stagesPerRank int) (*Schedule, error) {
	const name = "interleaved"
	s, err := newSchedule(name, ranks, microBatches, stagesPerRank, Loop)
	if err != nil {
		return nil, err
	}
	if stagesPerRank < 2 {
		return nil, fmt.Errorf("%w: %s: %d stages per rank: needs at least 2 (with one, use 1f1b)", ErrInvalid, name, stagesPerRank)
	}
	if microBatches < ranks {
		return nil, tooFew(name, microBatches, ranks, "a group of one per rank")
	}
	if !interleavedFits(ranks, microBatches) {
		lo, hi := microBatches-1, microBatches+1
		for !interleavedFits(ranks, lo) {
			lo--
		}
		for !interleavedFits(ranks, hi) {
			hi++
		}
		return nil, fmt.Errorf("%w: %s: %d micro-batches on %d ranks: must be a multiple of the %d rounds of at least %d (%d or %d would do)",
			ErrInvalid, name, microBatches, ranks, microBatches/ranks, ranks, lo, hi)
	}
	g := microBatches / (microBatches / ranks) // micro-batches per round
	v := stagesPerRank
	total := microBatches * v // compute actions of each kind per rank
	for r := range ranks {
		// The k-th forward (backward) of rank r: a group of g
		// micro-batches goes through the rank's stages in order (in
		// reverse for backwards) before the next group starts.
		at := func(k int, backward bool) Action {
			chunk := (k / g) % v
			kind := F
			if backward {
				chunk, kind = v-1-chunk, B
			}
			return Action{Stage: chunk*ranks + r, Kind: kind, MicroBatch: (k/(g*v))*g + k%g}
		}
		warm := min((v-1)*g+2*(ranks-1-r), total)
		acts := make([]Action, 0, 2*total)
		for k := range warm {
			acts = append(acts, at(k, false))
		}
		for k := range total - warm {
			acts = append(acts, at(warm+k, false), at(k, true))
		}
		for k := total - warm; k < total; k++ {
			acts = append(acts, at(k, true))
		}
		s.Actions[r] = acts
	}
	return s, nil
}

// interleavedFits reports whether m ≥ ranks micro-batches split into
// ⌊m/ranks⌋ equal rounds.
func interleavedFits(ranks, m int) bool { return m >= ranks && m%(m/ranks) == 0 }

// ZBH1 returns the zero-bubble schedule ZB-H1 (Qi et al. 2024, "Zero
// Bubble Pipeline Parallelism"): 1F1B's order of forwards, each backward
// split into I (for the input, which the previous stage waits for) and W
// (for the weights, which nobody waits for). Rank r runs its first r
// backwards as I only and from then on follows each I by the W of the
// oldest micro-batch whose W is pending; the r delayed W's run at the
// end, where 1F1B's cool-down leaves the rank idle. A stage holds at
// most Ranks micro-batches' activations (1F1B's peak); with F=I=W=1 the
// idle time is a third of 1F1B's, a bubble of (Ranks−1)/(3M + Ranks−1).
// It needs microBatches ≥ ranks.
func ZBH1(ranks, microBatches int) (*Schedule, error) {
	const name = "zb1"
	s, err := newSchedule(name, ranks, microBatches, 1, Loop)
	if err != nil {
		return nil, err
	}
	if microBatches < ranks {
		return nil, tooFew(name, microBatches, ranks, "one per rank")
	}
	m := microBatches
	for r := range ranks {
		warm := ranks - 1 - r
		acts := make([]Action, 0, 3*m)
		nextW := 0
		backward := func(k int) {
			acts = append(acts, Action{Stage: r, Kind: I, MicroBatch: k})
			if k >= r {
				acts = append(acts, Action{Stage: r, Kind: W, MicroBatch: nextW})
				nextW++
			}
		}
		for mb := range warm {
			acts = append(acts, Action{Stage: r, Kind: F, MicroBatch: mb})
		}
		for k := range m - warm {
			acts = append(acts, Action{Stage: r, Kind: F, MicroBatch: warm + k})
			backward(k)
		}
		for k := m - warm; k < m; k++ {
			backward(k)
		}
		for ; nextW < m; nextW++ {
			acts = append(acts, Action{Stage: r, Kind: W, MicroBatch: nextW})
		}
		s.Actions[r] = acts
	}
	return s, nil
}

// ZBVMinMicroBatches returns 2·ranks−1, the forwards rank 0's first stage
// runs before its first backward: from this many micro-batches on, ZBV
// runs its full warm-up and its bubble formula holds. ZBV accepts fewer
// (see ZBV).
func ZBVMinMicroBatches(ranks int) int { return 2*ranks - 1 }

// ZBV returns the V-shaped zero-bubble schedule ZB-V (Qi et al. 2024,
// section 6): two stages per rank placed in a V (rank r holds r and
// 2·Ranks−1−r, so rank 0 holds the first and the last stage and the
// turn stays on the last rank), backwards split into I and W. Rank r
// warms up with 2(Ranks−r)−1 forwards of its first stage, then
// alternates forwards of its two stages, then runs forward, I and W of
// one micro-batch on each stage in turn; in the cool-down the I's go
// first and the W's fill the time the rank would wait. With F=I=W=1 per
// stage the bubble is (Ranks−1)/(6M + Ranks−1): the only idle time is
// the first forward's trip down the V, half ZB-H1's over the same layers
// per rank. Stage s holds at most min(2·Ranks−s, M) micro-batches'
// activations (each stage is half a rank's layers, so rank 0 holds what
// 1F1B's stage 0 holds).
//
// Any microBatches ≥ 1 is accepted: with fewer than
// ZBVMinMicroBatches(ranks), the builder plans that many and drops the
// actions of the micro-batches that do not exist (PyTorch's way), which
// the validator shows stays deadlock-free; the bubble is then larger
// than the formula (at M = Ranks it equals ZB-H1's).
func ZBV(ranks, microBatches int) (*Schedule, error) {
	const name = "zbv"
	s, err := newSchedule(name, ranks, microBatches, 2, VShape)
	if err != nil {
		return nil, err
	}
	// With fewer micro-batches than the warm-up takes, plan that many
	// and drop the actions of those that do not exist.
	m := max(microBatches, ZBVMinMicroBatches(ranks))
	for r := range ranks {
		down, up := r, 2*ranks-1-r // the rank's stage on each arm of the V
		var f0, f1, i0, i1 int
		acts := make([]Action, 0, 6*m)
		add := func(stage int, k Kind, mb int) {
			if mb < microBatches {
				acts = append(acts, Action{Stage: stage, Kind: k, MicroBatch: mb})
			}
		}
		// Warm-up: fill the down arm, then alternate the arms, then start
		// the up arm's backwards as soon as its forwards come back.
		for range 2*(ranks-r) - 1 {
			add(down, F, f0)
			f0++
		}
		for range r {
			add(up, F, f1)
			f1++
			add(down, F, f0)
			f0++
		}
		for range ranks - r {
			add(up, F, f1)
			add(up, I, i1)
			add(up, W, i1)
			f1++
			i1++
		}
		// Steady state: one forward, I and W per stage in turn.
		for f1 < f0 || f0 < m {
			if f0 < m {
				add(down, F, f0)
				f0++
			}
			add(down, I, i0)
			add(down, W, i0)
			i0++
			add(up, F, f1)
			add(up, I, i1)
			add(up, W, i1)
			f1++
			i1++
		}
		// Cool-down: I's first (the previous ranks wait for them), W's
		// where the rank would otherwise wait.
		w0, w1 := i0, i1
		for range r {
			add(down, I, i0)
			i0++
			add(up, I, i1)
			i1++
		}
		for range ranks - r {
			add(down, I, i0)
			i0++
			add(down, W, w0)
			w0++
		}
		for ; w1 < i1; w1++ {
			add(up, W, w1)
		}
		for ; w0 < i0; w0++ {
			add(down, W, w0)
		}
		s.Actions[r] = acts
	}
	return s, nil
}
