package local

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
)

type splitKey struct {
	seq   uint64
	color int
}

// splitResult is the group made for one color, handed to its members.
type splitResult struct {
	g       *group
	members []int // parent ranks in new-rank order
	pending int   // members yet to pick it up
}

// Split implements comm.Communicator. It is a collective on c: members post
// (color, key), every member computes the same partition, and the first
// member of each part to get there creates the shared group.
func (c *Comm) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	if err := c.admit(ctx, comm.OpSplit, c.seq+1, -1); err != nil {
		return nil, err
	}
	// Split is ordered after every async collective issued before it.
	if err := c.quiesce(ctx); err != nil {
		return nil, c.abortFor(c.errorf(comm.OpSplit, c.seq+1, -1, "%w while waiting for earlier async work (context: %w)", errCancelled, err))
	}
	defer c.leaveInline()
	c.seq++
	seq := c.seq
	call := comm.Call{Op: comm.OpSplit}
	id := c.rec.BeginLabeled(comm.LabelOf(ctx), seq, &call, comm.Auto)
	nc, err := c.split(c.waiter(ctx), seq, color, key)
	if err != nil {
		c.rec.Update(id, comm.Failed, err)
		return nil, err
	}
	c.rec.Update(id, comm.Completed, nil)
	if nc == nil {
		return nil, nil // a nil *Comm must not become a non-nil interface
	}
	return nc, nil
}

func (c *Comm) split(wt *waiter, seq uint64, color, key int) (*Comm, error) {
	if e := c.g.err(); e != nil {
		return nil, c.wrap(comm.OpSplit, seq, -1, e)
	}
	d := &c.g.slots[c.rank].desc
	*d = descriptor{fp: comm.FingerprintOf(seq, &comm.Call{Op: comm.OpSplit}), scratch: d.scratch[:0], color: color, key: key}
	if c.g.w.opts.ConsistencyCheck {
		d.fp.Site = callerSite()
	}
	c.g.publish(c.rank, progressWord(seq, 0))
	if err := c.arrive(wt, seq, comm.OpSplit); err != nil {
		return nil, err
	}
	if err := c.agree(seq, &comm.Call{Op: comm.OpSplit}); err != nil {
		if derr := c.depart(wt, seq, comm.OpSplit); derr != nil {
			return nil, derr
		}
		return nil, err
	}
	var nc *Comm
	if color >= 0 {
		nc = c.join(seq, color)
	}
	// join always finds this rank: it posted color, so it is a member.
	if err := c.depart(wt, seq, comm.OpSplit); err != nil {
		return nil, err
	}
	return nc, nil
}

// join finds or creates the group for color and returns this rank's handle.
func (c *Comm) join(seq uint64, color int) *Comm {
	k := splitKey{seq, color}
	c.g.splitMu.Lock()
	defer c.g.splitMu.Unlock()
	res, ok := c.g.splits[k]
	if !ok {
		var ranks []int
		keys := make([]int, c.g.size)
		for q := range c.g.slots {
			keys[q] = c.g.slots[q].desc.key
			if c.g.slots[q].desc.color == color {
				ranks = append(ranks, q)
			}
		}
		members := sortedMembers(ranks, keys)
		worldRanks := make([]int, len(members))
		for i, q := range members {
			worldRanks[i] = c.g.worldRanks[q]
		}
		res = &splitResult{
			g:       newGroup(c.g.w, fmt.Sprintf("%s/split%d.c%d", c.g.name, seq, color), worldRanks),
			members: members,
			pending: len(members),
		}
		c.g.splits[k] = res
	}
	res.pending--
	if res.pending == 0 {
		delete(c.g.splits, k)
	}
	i := slices.Index(res.members, c.rank)
	return newComm(res.g, i)
}

// sortedMembers lists the ranks of a split part ordered by (key, rank).
func sortedMembers(ranks, keys []int) []int {
	out := slices.Clone(ranks)
	slices.SortStableFunc(out, func(a, b int) int {
		return cmp.Or(cmp.Compare(keys[a], keys[b]), cmp.Compare(a, b))
	})
	return out
}
