package local

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// Blame for a timeout. Every member of a collective publishes its arrival
// (its progress word), so a call that times out names the members that
// have not arrived rather than the one it happened to wait on, which may
// be waiting itself. A member that has not arrived may be blocked in a
// call of another communicator of the world, waiting for ranks of its
// own; blame follows those waits to the ranks that wait for nothing, the
// late ones, so that every rank of a cascade names the same rank.
// Ranks blocked in a Send or Recv are not followed: they count as late.

// waitNode is one rank found blocked: world rank wr waits in its call
// #seq of g, as member i, for the world ranks on. When timedOut is set, a
// timeout has already aborted that call, and on are the ranks it blamed.
type waitNode struct {
	wr       int
	g        *group
	i        int
	seq      uint64
	on       []int
	timedOut bool
}

// absent lists the members of g other than skip that have not arrived at
// call seq.
func (g *group) absent(seq uint64, skip int) []int {
	var out []int
	for q := range g.slots {
		if q != skip && g.slots[q].progress.Load() < progressWord(seq, 0) {
			out = append(out, q)
		}
	}
	return out
}

// blockedIn finds where world rank wr is blocked: in a call of one of
// groups that some members have not joined, or in one that a timeout
// aborted (the late ranks are then those that timeout found). It returns
// nil when wr is in no such call.
func blockedIn(groups []*group, wr int) *waitNode {
	for _, h := range groups {
		i := slices.Index(h.worldRanks, wr)
		if i < 0 {
			continue
		}
		pw := h.slots[i].progress.Load()
		seq, mark := pw>>markBits, pw&departMark
		if seq == 0 || mark == departMark {
			continue // in no call of h, or about to leave one
		}
		n := &waitNode{wr: wr, g: h, i: i, seq: seq}
		if e := h.err(); e != nil {
			var te *comm.TimeoutError
			if !errors.As(e, &te) {
				continue // another failure ends wr's call: it is not blocked there
			}
			n.on, n.timedOut = te.Late, true
			return n
		}
		for _, q := range h.absent(seq, i) {
			n.on = append(n.on, h.worldRanks[q])
		}
		if len(n.on) > 0 {
			return n
		}
		// All there: the call moves on.
	}
	return nil
}

// trace follows the waits from the world ranks start and returns the late
// ranks (ascending) and the blocked ranks met on the way.
func (w *world) trace(start []int) (late []int, nodes []waitNode) {
	groups := w.liveGroups()
	seen := map[int]bool{}
	queue := slices.Clone(start)
	for len(queue) > 0 {
		wr := queue[0]
		queue = queue[1:]
		if seen[wr] {
			continue
		}
		seen[wr] = true
		n := blockedIn(groups, wr)
		switch {
		case n == nil:
			late = append(late, wr)
		case n.timedOut: // that timeout has traced its own waits
			nodes = append(nodes, *n)
			late = append(late, n.on...)
		default:
			nodes = append(nodes, *n)
			queue = append(queue, n.on...)
		}
	}
	slices.Sort(late)
	return slices.Compact(late), nodes
}

// blameCollective builds the timeout of this rank's collective #seq, which
// waited for member peer. It returns the error's cause and the peer to
// report: the late member when it is the only one, else -1.
func (c *Comm) blameCollective(seq uint64, peer int) (*comm.TimeoutError, int) {
	te := &comm.TimeoutError{After: c.g.w.opts.Timeout}
	miss := c.g.absent(seq, c.rank)
	if len(miss) == 0 {
		// Every member arrived: one is slow inside the call.
		te.Detail = fmt.Sprintf("waiting for %s, which joined this call but has not finished its part", c.name(c.g.worldRanks[peer]))
		return te, peer
	}
	start := make([]int, len(miss))
	for k, q := range miss {
		start[k] = c.g.worldRanks[q]
	}
	late, nodes := c.g.w.trace(start)
	te.Late = late
	if len(late) == 0 {
		te.Detail = "for ranks that wait for each other (" + c.chain(nodes) + ")"
		return te, -1
	}
	verb := "has"
	if len(late) > 1 {
		verb = "have"
	}
	where := " this call"
	for _, wr := range late {
		if !slices.Contains(start, wr) {
			where = "" // a call that a member waits in, named below
		}
	}
	te.Detail = fmt.Sprintf("waiting for %s, which %s not joined%s", c.names(late), verb, where)
	if len(nodes) > 0 {
		te.Detail += " (" + c.chain(nodes) + ")"
	}
	if len(late) == 1 {
		if q := slices.Index(c.g.worldRanks, late[0]); q >= 0 {
			return te, q
		}
	}
	return te, -1
}

// blameP2P builds the timeout of a Send or Recv with peer: the peer is
// late unless it is blocked in a collective, whose late ranks are then
// named too.
func (c *Comm) blameP2P(peer, tag int) *comm.TimeoutError {
	te := &comm.TimeoutError{After: c.g.w.opts.Timeout, Detail: fmt.Sprintf("waiting for rank %d (tag %d)", peer, tag)}
	late, nodes := c.g.w.trace([]int{c.g.worldRanks[peer]})
	te.Late = late
	if len(nodes) > 0 {
		if len(late) > 0 {
			te.Detail += ", which waits for " + c.names(late)
		}
		te.Detail += " (" + c.chain(nodes) + ")"
	}
	return te
}

// name names world rank wr for this rank's errors: by its rank here when
// it is a member, adding its world rank when that differs.
func (c *Comm) name(wr int) string {
	q := slices.Index(c.g.worldRanks, wr)
	switch {
	case q < 0:
		return fmt.Sprintf("world rank %d", wr)
	case c.g.identity():
		return fmt.Sprintf("rank %d", q)
	}
	return fmt.Sprintf("rank %d (world rank %d)", q, wr)
}

func (c *Comm) names(wrs []int) string {
	s := make([]string, len(wrs))
	for k, wr := range wrs {
		s[k] = c.name(wr)
	}
	if len(s) == 1 {
		return s[0]
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

// chain says where each blocked rank waits: "rank 0 waits in
// world/split2.c0 allgather #1 [label] for rank 1".
func (c *Comm) chain(nodes []waitNode) string {
	s := make([]string, len(nodes))
	for k, n := range nodes {
		what := fmt.Sprintf("call #%d", n.seq)
		if rec := n.g.slots[n.i].rec.Load(); rec != nil {
			if e, ok := rec.Find(n.seq, false); ok {
				what = fmt.Sprintf("%s #%d", e.Op, n.seq)
				if e.Label != "" {
					what += " [" + e.Label + "]"
				}
			}
		}
		switch {
		case !n.timedOut:
			s[k] = fmt.Sprintf("%s waits in %s %s for %s", c.name(n.wr), n.g.name, what, c.names(n.on))
		case len(n.on) > 0:
			s[k] = fmt.Sprintf("%s is in %s %s, which timed out waiting for %s", c.name(n.wr), n.g.name, what, c.names(n.on))
		default:
			s[k] = fmt.Sprintf("%s is in %s %s, which timed out", c.name(n.wr), n.g.name, what)
		}
	}
	return strings.Join(s, "; ")
}

// identity reports whether every member's rank equals its world rank.
func (g *group) identity() bool {
	for q, wr := range g.worldRanks {
		if q != wr {
			return false
		}
	}
	return true
}
