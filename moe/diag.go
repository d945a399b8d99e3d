package moe

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Timings splits the wall-clock time of one MoE layer pass on this rank.
// Each field sums every call of its kind through one handle.
type Timings struct {
	// Wait is the time this rank spent at a barrier over the
	// expert-parallel axis before each combine, combine backward and
	// dispatch backward, waiting for the group's slowest rank to arrive:
	// what imbalance costs (experts with more rows, ranks sharing a
	// core), measured only with DispatchConfig.Diagnostics, which adds
	// those barriers. Without them the wait falls into the pass's first
	// exchange (PayloadExchange), where it looks like slow communication.
	Wait time.Duration
	// Permute is the local row movement of dispatch: the expert-major
	// pack of the token copies and the regrouping by local expert after
	// the all-to-all (in backward: dispatch's backward, the regrouping by
	// rank and the scatter-add of each token's copies).
	Permute time.Duration
	// CountExchange is the all-gather of per-expert counts (forward only;
	// zero for a static-capacity dispatch without diagnostics).
	CountExchange time.Duration
	// PayloadExchange is the token rows' all-to-all-v's, of dispatch and
	// of combine (one, or one per local expert; see Dispatch).
	PayloadExchange time.Duration
	// Fused is the whole of each pass on the fused path, where the ranks
	// pull rows from each other's memory: permute, exchange and weighted
	// sum in one (Permute, PayloadExchange and Combine then stay zero).
	Fused time.Duration
	// Experts is the experts' compute (Experts.Forward and its backward).
	Experts time.Duration
	// Combine is the local row movement of combine: the regrouping by
	// rank and the gate-weighted sum (in backward: the gate-scaled gather
	// and the gate gradient).
	Combine time.Duration
}

// Total is the sum of the fields.
func (t Timings) Total() time.Duration {
	return t.Wait + t.Permute + t.CountExchange + t.PayloadExchange + t.Fused + t.Experts + t.Combine
}

// Add returns the field-wise sum of t and u.
func (t Timings) Add(u Timings) Timings {
	t.Wait += u.Wait
	t.Permute += u.Permute
	t.CountExchange += u.CountExchange
	t.PayloadExchange += u.PayloadExchange
	t.Fused += u.Fused
	t.Experts += u.Experts
	t.Combine += u.Combine
	return t
}

// String lists the parts of t that the path taken has ("fused" for the
// fused path's passes, "permute", "payload" and "combine" for the
// all-to-all path's), each with its duration; "wait" only when measured.
func (t Timings) String() string {
	parts := []struct {
		name string
		d    time.Duration
		keep bool
	}{
		{"wait", t.Wait, t.Wait > 0},
		{"fused", t.Fused, t.Fused > 0},
		{"permute", t.Permute, t.Fused == 0},
		{"counts", t.CountExchange, true},
		{"payload", t.PayloadExchange, t.Fused == 0},
		{"experts", t.Experts, true},
		{"combine", t.Combine, t.Fused == 0},
	}
	var out []string
	for _, p := range parts {
		if p.keep {
			out = append(out, fmt.Sprintf("%s %v", p.name, p.d))
		}
	}
	return strings.Join(out, ", ")
}

// Stats are the diagnostics of one dispatch, from the counts the dispatch
// already has; computing them costs no communication. Row counts are token
// copies (one per token and expert); padding rows of the static layout are
// counted only where a field says so.
type Stats struct {
	// Ranks is the size P of the expert-parallel axis and Rank this
	// rank's index on it; Experts is E and Capacity the static capacity
	// (0 for the ragged layout).
	Ranks, Rank, Experts, Capacity int

	// SendMatrix[i][j] is the number of token rows expert-parallel rank i
	// sends to rank j in this rank's expert-parallel group, padding
	// excluded ([P][P]); TokensPerExpert[e] the rows expert e receives in
	// the group, after the capacity limit. MaxSend and MaxRecv are the
	// largest row and column sums of the matrix: the busiest sender's and
	// the busiest receiver's rows (a receiver's rows are its experts'
	// load). These need every rank's counts, which the ragged layout
	// exchanges anyway; a static-capacity dispatch has them only with
	// DispatchConfig.Diagnostics (nil and 0 otherwise).
	SendMatrix      [][]int64
	TokensPerExpert []int64
	MaxSend         int64
	MaxRecv         int64

	// Slots is this rank's token slots (n·K); Unrouted those the router
	// left without an expert (dropped by the router's capacity limit) and
	// Dropped those dispatch dropped beyond its static capacity. Sent and
	// Received are the rows this rank sends and receives, padding
	// included; Padded is the padding rows among those it sends.
	Slots, Unrouted, Dropped, Padded, Sent, Received int64
	// DroppedFraction is (Unrouted + Dropped) / Slots and PaddedFraction
	// Padded / Sent, on this rank (0 when the denominator is).
	DroppedFraction, PaddedFraction float64

	// Forward and Backward split the time of the ops that used the
	// handle, in the forward pass and in Backward.
	Forward, Backward Timings
}

// Stats returns a copy of the handle's diagnostics, with the time of every
// op that has used it so far (Combine and Experts.Forward add theirs, and
// backward passes theirs as Backward runs).
func (h *Handle) Stats() Stats {
	if h == nil {
		return Stats{}
	}
	s := h.stats
	s.SendMatrix = make([][]int64, len(h.stats.SendMatrix))
	for i, row := range h.stats.SendMatrix {
		s.SendMatrix[i] = slices.Clone(row)
	}
	if h.stats.SendMatrix == nil {
		s.SendMatrix = nil
	}
	s.TokensPerExpert = slices.Clone(h.stats.TokensPerExpert)
	return s
}

// init sets the fields known before any counting.
func (s *Stats) init(h *Handle) {
	s.Ranks, s.Rank, s.Experts, s.Capacity = h.ranks, h.rank, h.e, h.capacity
}

// fill sets the counts once the layout is known; gathered holds every
// token-group rank's exchange message (nil without exchange) and member(q)
// the token-group rank of expert-parallel rank q in this rank's group.
func (s *Stats) fill(h *Handle, gathered [][]int64, member func(q int) int) {
	p, e := h.ranks, h.e
	s.Slots = int64(h.n * h.k)
	s.Unrouted, s.Dropped, s.Padded = int64(h.plan.Unrouted), int64(h.plan.Dropped), int64(h.plan.Padded)
	s.Sent, s.Received = int64(sum(h.send)), int64(sum(h.recv))
	if s.Slots > 0 {
		s.DroppedFraction = float64(s.Unrouted+s.Dropped) / float64(s.Slots)
	}
	if s.Sent > 0 {
		s.PaddedFraction = float64(s.Padded) / float64(s.Sent)
	}
	if gathered == nil {
		return
	}
	s.SendMatrix = make([][]int64, p)
	s.TokensPerExpert = make([]int64, e)
	colSums := make([]int64, p)
	for i := range p {
		msg := gathered[member(i)]
		s.SendMatrix[i] = make([]int64, p)
		var row int64
		for x := range e {
			c := msg[hdrLen+x]
			s.SendMatrix[i][x/h.local] += c
			s.TokensPerExpert[x] += c
			row += c
		}
		s.MaxSend = max(s.MaxSend, row)
		for j := range p {
			colSums[j] += s.SendMatrix[i][j]
		}
	}
	s.MaxRecv = slices.Max(colSums)
}

// String summarises the stats on a few lines.
func (s Stats) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "moe dispatch: rank %d of %d, %d experts", s.Rank, s.Ranks, s.Experts)
	if s.Capacity > 0 {
		fmt.Fprintf(&b, ", capacity %d", s.Capacity)
	}
	fmt.Fprintf(&b, "\n  slots %d, sent %d rows, received %d, dropped %.2f%%, padded %.2f%%",
		s.Slots, s.Sent, s.Received, 100*s.DroppedFraction, 100*s.PaddedFraction)
	if s.SendMatrix != nil {
		fmt.Fprintf(&b, "\n  send matrix %v, max send %d, max receive %d\n  tokens per expert %v", s.SendMatrix, s.MaxSend, s.MaxRecv, s.TokensPerExpert)
	}
	for _, t := range []struct {
		name string
		t    Timings
	}{{"forward", s.Forward}, {"backward", s.Backward}} {
		fmt.Fprintf(&b, "\n  %s: %v", t.name, t.t)
	}
	return b.String()
}
