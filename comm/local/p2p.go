package local

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Point-to-point messages match by (source, destination, tag) in posting
// order, as in MPI. Whichever side posts second copies the data straight
// from the send buffer into the receive buffer and completes both, so a
// message is copied once and no goroutine is needed to make progress.

type pairQueue struct {
	mu    sync.Mutex
	sends []*p2pOp
	recvs []*p2pOp
}

// p2pOp is a posted Send or Recv; it implements comm.Work.
type p2pOp struct {
	c        *Comm
	op       comm.Op
	seq      uint64
	peer     int
	tag      int
	buf      *comm.HostBuffer
	id       uint64
	deadline time.Time

	state atomic.Uint32 // 0 pending, 1 done
	once  sync.Once
	done  chan struct{}
	err   error
}

func (c *Comm) postP2P(ctx context.Context, call comm.Call) (*p2pOp, error) {
	seq := c.p2pSeq.Add(1)
	id := c.rec.BeginLabeled(comm.LabelOf(ctx), seq, &call, comm.Auto)
	fail := func(err error) (*p2pOp, error) {
		e := c.wrap(call.Op, seq, call.Peer, err)
		c.rec.Update(id, comm.Failed, e)
		return nil, e
	}
	if err := call.Validate(c.rank, c.g.size); err != nil {
		return fail(err)
	}
	b := call.Send
	if call.Op == comm.OpRecv {
		b = call.Recv
	}
	h := hostOf(b)
	if h == nil {
		return fail(fmt.Errorf("%w: the local backend needs host or comm.HostBacked buffers, got %T", comm.ErrUnsupported, b))
	}
	if err := c.admit(ctx, call.Op, seq, call.Peer); err != nil {
		c.rec.Update(id, comm.Failed, err)
		return nil, err
	}
	o := &p2pOp{
		c: c, op: call.Op, seq: seq, peer: call.Peer, tag: call.Tag, buf: h, id: id,
		deadline: time.Now().Add(c.g.w.opts.Timeout), done: make(chan struct{}),
	}
	c.rec.Update(id, comm.Started, nil)
	var match *p2pOp
	if call.Op == comm.OpSend {
		q := &c.g.p2p[c.rank*c.g.size+call.Peer]
		q.mu.Lock()
		if i := findTag(q.recvs, call.Tag); i >= 0 {
			match = q.recvs[i]
			q.recvs = append(q.recvs[:i], q.recvs[i+1:]...)
		} else {
			q.sends = append(q.sends, o)
		}
		q.mu.Unlock()
		if match != nil {
			deliver(o, match)
		}
	} else {
		q := &c.g.p2p[call.Peer*c.g.size+c.rank]
		q.mu.Lock()
		if i := findTag(q.sends, call.Tag); i >= 0 {
			match = q.sends[i]
			q.sends = append(q.sends[:i], q.sends[i+1:]...)
		} else {
			q.recvs = append(q.recvs, o)
		}
		q.mu.Unlock()
		if match != nil {
			deliver(match, o)
		}
	}
	return o, nil
}

func findTag(ops []*p2pOp, tag int) int {
	for i, o := range ops {
		if o.tag == tag {
			return i
		}
	}
	return -1
}

// deliver copies a matched message and completes both sides.
func deliver(send, recv *p2pOp) {
	var err error
	defer func() { // never leave a side pending, whatever happens
		if v := recover(); v != nil {
			err = fmt.Errorf("panic while delivering: %v", v)
			send.complete(err)
			recv.complete(err)
		}
	}()
	switch {
	case send.buf.DType() != recv.buf.DType():
		err = fmt.Errorf("%w: send of %v from rank %d matched a receive of %v on rank %d (tag %d)",
			comm.ErrInvalid, send.buf.DType(), send.c.rank, recv.buf.DType(), recv.c.rank, send.tag)
	case send.buf.Len() != recv.buf.Len():
		err = fmt.Errorf("%w: send of %d elements from rank %d matched a receive of %d elements on rank %d (tag %d)",
			comm.ErrInvalid, send.buf.Len(), send.c.rank, recv.buf.Len(), recv.c.rank, send.tag)
	default:
		copy(recv.buf.Bytes(), send.buf.Bytes())
	}
	send.complete(err)
	recv.complete(err)
}

func (o *p2pOp) complete(err error) {
	o.once.Do(func() { o.finish(err) })
}

func (o *p2pOp) finish(err error) {
	if err != nil {
		e := o.c.wrap(o.op, o.seq, o.peer, err)
		o.err = e
		o.c.rec.Update(o.id, comm.Failed, e)
	} else {
		o.c.rec.Update(o.id, comm.Completed, nil)
	}
	o.state.Store(1)
	close(o.done)
}

// Done implements comm.Work.
func (o *p2pOp) Done() <-chan struct{} { return o.done }

// Wait implements comm.Work. A cancelled ctx or the timeout aborts the
// communicator.
func (o *p2pOp) Wait(ctx context.Context) error {
	if o.c.spin > 0 {
		start := time.Now()
		for i := 1; o.state.Load() == 0; i++ {
			if i&255 == 0 && time.Since(start) > o.c.spin {
				break
			}
		}
	}
	if o.state.Load() == 1 {
		return o.err
	}
	timer := time.NewTimer(time.Until(o.deadline))
	defer timer.Stop()
	g := o.c.g
	var cause error
	for cause == nil {
		left := g.w.leaving()
		if e := g.err(); e != nil && o.state.Load() == 0 { // the cause beats "left"
			cause = e
			break
		}
		if g.w.left[g.worldRanks[o.peer]].Load() && o.state.Load() == 0 {
			cause = fmt.Errorf("%w: rank %d finished without matching this %v (tag %d)", ErrRankLeft, o.peer, o.op, o.tag)
			break
		}
		select {
		case <-o.done:
			return o.err
		case <-g.failed:
			cause = g.err()
		case <-g.w.failed:
			cause = g.err()
		case <-ctx.Done():
			cause = fmt.Errorf("%w while waiting (context: %w)", errCancelled, ctx.Err())
		case <-timer.C:
			te := o.c.blameP2P(o.peer, o.tag)
			te.Detail += o.c.dump(o.seq)
			cause = te
		case <-left:
		}
	}
	select {
	case <-o.done: // completed meanwhile
		return o.err
	default:
	}
	var err error
	if _, aborted := cause.(*comm.AbortError); aborted {
		err = o.c.wrap(o.op, o.seq, o.peer, cause)
	} else {
		err = o.c.abortFor(o.c.wrap(o.op, o.seq, o.peer, cause))
	}
	o.c.rec.Update(o.id, comm.Failed, err)
	return err
}
