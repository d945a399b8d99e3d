package moe

import (
	"cmp"
	"math"
	"slices"
	"strconv"

	"github.com/b7ea7098/loom/autograd"
)

// Routing is a router's decision for this rank's tokens.
type Routing struct {
	// NumExperts is E, the number of experts; K is the number of expert
	// slots per token.
	NumExperts, K int
	// Experts holds, for local token t and slot j (j < K, in descending
	// score), the global expert id at t*K+j; -1 marks a slot dropped by
	// the capacity limit. The score that orders the slots is the selection
	// score: the router score plus the expert bias (RouterConfig.ExpertBias);
	// equal scores put the lower expert index first. A token's K experts are
	// distinct.
	Experts []int32
	// Gates [n, K] float32 (n local tokens; global shape [N, K], laid out
	// like the token rows: Shard(0) on the token-sharding axes, Replicate
	// elsewhere): the gate weight of each slot, 0 for dropped slots.
	// Differentiable. Its dtype is the router's (float32, or float64 for
	// float64 inputs). Its gradient must arrive Replicate on the axes that
	// do not shard the tokens (as the gradient of a replicated value does
	// by default): the router inserts no all-reduce.
	Gates *autograd.Value
	// Aux and Z are the load-balancing loss α·aux and the z-loss β·zloss as
	// scalars (Partial(sum) on the token-sharding axes, so that their sum
	// over ranks is the global value), nil when their coefficient is 0. The
	// caller adds them to its loss. Their shape is [] and their gradient
	// must arrive Replicate (as Backward's seed does).
	Aux, Z *autograd.Value
	// Counts are the global tokens per expert (after dropping), identical
	// on every rank; Dropped the number of dropped slots over the global
	// batch.
	Counts  []int64
	Dropped int64

	// Capacity is this rank's per-expert capacity, ⌈CapacityFactor·n·K/E⌉
	// for its n local tokens (Megatron's rule: the limit is per rank, over
	// local tokens), or 0 when routing is dropless.
	Capacity int
	// Pad reports RouterConfig.PadToCapacity: dispatch is to pad each
	// expert's rows from this rank with zero rows up to Capacity, so that
	// every buffer has a static size. Padded is the number of such padding
	// rows over the global batch (every rank's E·Capacity minus its kept
	// slots, summed over the token shards), 0 without padding.
	Pad    bool
	Padded int64

	// Test hooks: this rank's logits and the score function.
	logits *autograd.Value
	score  ScoreFunc
}

// ScoreFunc is the function that turns a token's router logits into
// expert scores.
type ScoreFunc int

const (
	// Softmax scores are softmax(z) over the E experts (the default; the
	// reference, Switch, GShard, Mixtral).
	Softmax ScoreFunc = iota
	// Sigmoid scores are σ(z) per expert (DeepSeek-V3); with K > 1 they
	// are usually renormalised over the selected experts (Renormalize).
	// The load-balancing loss uses σ(z) normalised to sum to 1 over the
	// experts as P, as Megatron does.
	Sigmoid
)

// String returns "softmax" or "sigmoid".
func (s ScoreFunc) String() string {
	switch s {
	case Softmax:
		return "softmax"
	case Sigmoid:
		return "sigmoid"
	}
	return "ScoreFunc(" + strconv.Itoa(int(s)) + ")"
}

// DropPolicy chooses which slots an over-full expert keeps under a
// capacity limit (Megatron's moe_token_drop_policy).
type DropPolicy int

const (
	// DropByProb keeps the slots with the largest gate weights (before
	// dropping); equal weights keep the earlier token. The default.
	DropByProb DropPolicy = iota
	// DropByPosition keeps the earliest local tokens.
	DropByPosition
)

// String returns "probs" or "position", Megatron's names.
func (d DropPolicy) String() string {
	switch d {
	case DropByProb:
		return "probs"
	case DropByPosition:
		return "position"
	}
	return "DropPolicy(" + strconv.Itoa(int(d)) + ")"
}

// better reports whether expert (or group) a ranks before b under keys:
// a larger key first, equal keys the lower index first. NaN ranks last.
func better(keys []float64, a, b int) bool {
	ka, kb := keys[a], keys[b]
	switch {
	case math.IsNaN(ka):
		return math.IsNaN(kb) && a < b
	case math.IsNaN(kb):
		return true
	case ka != kb:
		return ka > kb
	}
	return a < b
}

// topK writes into out the indices of the len(out) best entries of keys
// among those allowed (nil allows all), best first (better's order).
// There must be at least len(out) allowed entries; taken is scratch of at
// least len(keys) entries.
func topK(keys []float64, allowed, taken []bool, out []int32) {
	taken = taken[:len(keys)]
	clear(taken)
	for j := range out {
		best := -1
		for e := range keys {
			if taken[e] || (allowed != nil && !allowed[e]) {
				continue
			}
			if best < 0 || better(keys, e, best) {
				best = e
			}
		}
		taken[best] = true
		out[j] = int32(best)
	}
}

// groupLimit is group-limited selection: the E experts form groups of
// size E/groups (contiguous), a token keeps its top best groups, each
// scored by the sum of its sumTop best keys.
type groupLimit struct {
	groups, top, sumTop int
}

// selector chooses a token's experts, reusing its scratch across tokens.
type selector struct {
	g       *groupLimit // nil: plain top-K
	taken   []bool
	allowed []bool
	gscore  []float64
	best    []int32
	chosen  []int32
}

func newSelector(e int, g *groupLimit) *selector {
	s := &selector{g: g, taken: make([]bool, e)}
	if g != nil {
		s.allowed = make([]bool, e)
		s.gscore = make([]float64, g.groups)
		s.best = make([]int32, g.sumTop)
		s.chosen = make([]int32, g.top)
	}
	return s
}

// choose writes a token's K experts (len(out)) into out, best first, from
// its selection keys [E].
func (s *selector) choose(keys []float64, out []int32) {
	g := s.g
	if g == nil {
		topK(keys, nil, s.taken, out)
		return
	}
	size := len(keys) / g.groups
	for gi := range g.groups {
		group := keys[gi*size : (gi+1)*size]
		topK(group, nil, s.taken, s.best)
		sum := 0.0
		for _, e := range s.best {
			sum += group[e]
		}
		s.gscore[gi] = sum
	}
	topK(s.gscore, nil, s.taken, s.chosen)
	clear(s.allowed)
	for _, gi := range s.chosen {
		for e := int(gi) * size; e < (int(gi)+1)*size; e++ {
			s.allowed[e] = true
		}
	}
	topK(keys, s.allowed, s.taken, out)
}

// selectExperts is a one-off selector's choice (g may be nil).
func selectExperts(keys []float64, g *groupLimit, out []int32) {
	newSelector(len(keys), g).choose(keys, out)
}

// capacityOf is Megatron's get_capacity for n local tokens:
// ⌈(n·K/E)·factor⌉.
func capacityOf(n, k, e int, factor float64) int {
	return int(math.Ceil(float64(n*k) / float64(e) * factor))
}

// dropOverCapacity marks in kept [n·K] (all true on entry) the slots that
// an over-full expert drops: each expert keeps at most capacity of its
// slots, chosen by policy (gates [n·K] for DropByProb).
func dropOverCapacity(sel []int32, gates []float64, e, capacity int, policy DropPolicy, kept []bool) {
	perExpert := make([][]int, e)
	for s, ex := range sel {
		perExpert[ex] = append(perExpert[ex], s)
	}
	for _, slots := range perExpert {
		if len(slots) <= capacity {
			continue
		}
		// slots are in token order (a token holds an expert in one slot).
		if policy == DropByProb {
			slices.SortStableFunc(slots, func(a, b int) int {
				return cmp.Compare(gates[b], gates[a])
			})
		}
		for _, s := range slots[capacity:] {
			kept[s] = false
		}
	}
}
