package local

import (
	"context"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// sharing is one Share call on one rank: what it contributes and what it
// runs on everyone's contributions.
type sharing struct {
	v   any
	use func(peers []any) error
}

// Share implements comm.SharedMemory. It runs as a barrier whose
// descriptor carries v: after every rank has arrived and the calls agree,
// each rank runs use on the posted values, and the barrier's departure
// (no rank leaves before every rank has finished reading) keeps each v
// valid for its readers.
func (c *Comm) Share(ctx context.Context, v any, use func(peers []any) error) error {
	call := comm.Call{Op: comm.OpBarrier}.ForRank(c.rank)
	c.seq++
	seq := c.seq
	c.fillAlgorithm(&call)
	id := c.rec.BeginLabeled(comm.LabelOf(ctx), seq, &call, call.Algorithm)
	if err := c.admit(ctx, call.Op, seq, -1); err != nil {
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	return c.issue(ctx, seq, call, id, &sharing{v: v, use: use})
}

// post adds the Share to this rank's descriptor; a nil use is posted as
// invalid, so that every rank rejects the call together.
func (sh *sharing) post(d *descriptor) {
	d.sharing, d.shared = true, sh.v
	if sh.use == nil && d.invalid == nil {
		d.invalid = fmt.Errorf("%w: Share with a nil use function", comm.ErrInvalid)
	}
}

// use runs this rank's use function on the values every rank posted for
// seq; a panic becomes the error, since the peers still wait for this
// rank to depart.
func (c *Comm) use(seq uint64, sh *sharing) (err error) {
	peers := make([]any, c.g.size)
	for q := range peers {
		peers[q] = c.g.slots[q].desc.shared
	}
	defer func() {
		if v := recover(); v != nil {
			err = c.errorf(comm.OpBarrier, seq, -1, "Share: panic in use: %v", v)
		}
	}()
	return sh.use(peers)
}

// agreeSharing fails, identically on every member, a barrier that some
// ranks entered through Share and others as a plain barrier.
func agreeSharing(slots []slot) error {
	var share, plain []string
	for q := range slots {
		if slots[q].desc.sharing {
			share = append(share, fmt.Sprint(q))
		} else {
			plain = append(plain, fmt.Sprint(q))
		}
	}
	if share == nil || plain == nil {
		return nil
	}
	return fmt.Errorf("%w: rank(s) %s called Share where rank(s) %s called a barrier", comm.ErrMismatch, strings.Join(share, ", "), strings.Join(plain, ", "))
}
