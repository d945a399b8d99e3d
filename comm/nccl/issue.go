package nccl

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// ncclDataType_t values (nccl.h).
const (
	ncclUint8    = 1
	ncclInt32    = 2
	ncclInt64    = 4
	ncclFloat16  = 6
	ncclFloat32  = 7
	ncclFloat64  = 8
	ncclBfloat16 = 9
)

// ncclRedOp_t values (nccl.h).
const (
	ncclSum  = 0
	ncclProd = 1
	ncclMax  = 2
	ncclMin  = 3
	ncclAvg  = 4
)

// DataType returns the ncclDataType_t of a comm.DType, or -1.
func DataType(dt comm.DType) int32 {
	switch dt {
	case comm.Float32:
		return ncclFloat32
	case comm.Float64:
		return ncclFloat64
	case comm.BFloat16:
		return ncclBfloat16
	case comm.Float16:
		return ncclFloat16
	case comm.Int32:
		return ncclInt32
	case comm.Int64:
		return ncclInt64
	case comm.Uint8:
		return ncclUint8
	}
	return -1
}

// RedOp returns the ncclRedOp_t of a comm.ReduceOp, or -1. Avg is ncclAvg
// (NCCL 2.10): a sum divided by the number of ranks, truncating for
// integer types.
func RedOp(op comm.ReduceOp) int32 {
	switch op {
	case comm.Sum:
		return ncclSum
	case comm.Prod:
		return ncclProd
	case comm.Max:
		return ncclMax
	case comm.Min:
		return ncclMin
	case comm.Avg:
		return ncclAvg
	}
	return -1
}

// Do implements comm.Communicator: Start, then Wait with ctx.
func (c *Comm) Do(ctx context.Context, call comm.Call) error {
	if ctx == nil {
		ctx = context.Background()
	}
	w, err := c.start(ctx, call, false)
	if err != nil {
		c.awaitAbort(ctx)
		return err
	}
	return w.Wait(ctx)
}

// Start implements comm.Communicator. A collective is enqueued on the
// communicator's stream, followed by a CUDA event that completes its Work;
// host buffers are staged through device memory (copied in now, copied
// out when the Work completes). Point-to-point work is batched: it is
// given to NCCL, as one group, when a Work of it is waited for (Wait or
// Done), before the next collective, or by Flush.
func (c *Comm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	w, err := c.start(ctx, call, true)
	if err != nil {
		c.awaitAbort(ctx)
		return nil, err
	}
	return w, nil
}

func (c *Comm) start(ctx context.Context, call comm.Call, async bool) (*work, error) {
	call = call.ForRank(c.rank)
	if call.Op == comm.OpBroadcast && call.Send == nil {
		call.Send = call.Recv
	}
	c.issueMu.Lock()
	defer c.issueMu.Unlock()
	p2p := call.Op == comm.OpSend || call.Op == comm.OpRecv
	seq, peer := c.seq+1, -1
	if p2p {
		seq, peer = c.p2pSeq+1, call.Peer
	}
	if err := c.usable(call.Op, seq, peer); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, c.refuseEnded(call.Op, seq, peer, err)
	}
	if call.Op == comm.OpSplit {
		return nil, c.errorf(call.Op, seq, -1, "%w: use Split", comm.ErrInvalid)
	}
	if call.Algorithm != comm.Auto {
		return nil, c.errorf(call.Op, seq, peer, "%w: NCCL chooses its own algorithms; only %v may be asked for, not %v",
			comm.ErrUnsupported, comm.Auto, call.Algorithm)
	}
	invalid := call.Validate(c.rank, c.size)
	var plan *stagePlan
	if invalid == nil {
		plan, invalid = c.plan(&call)
	}
	if p2p {
		if invalid != nil {
			return nil, c.wrap(call.Op, seq, peer, invalid)
		}
		return c.startP2P(ctx, &call, plan)
	}
	c.flushLocked(ctx)
	if err := c.usable(call.Op, seq, -1); err != nil {
		return nil, err // the flush failed and aborted
	}
	if c.cfg.opts.ConsistencyCheck {
		if err := c.checkFingerprint(ctx, seq, &call, invalid, 0, 0); err != nil {
			return nil, err
		}
	} else if invalid != nil && call.Op != comm.OpAllToAllV {
		return nil, c.wrap(call.Op, seq, -1, invalid)
	}
	if call.Op == comm.OpAllToAllV {
		if err := c.checkCounts(ctx, seq, &call, invalid); err != nil {
			return nil, err
		}
	}
	c.seq = seq
	w := c.newWork(ctx, &call, seq, false)
	if err := c.issue(ctx, w, plan); err != nil {
		return nil, err
	}
	if async {
		c.mu.Lock()
		c.driveLocked()
		c.mu.Unlock()
	}
	return w, nil
}

// refuseEnded fails a call at seq given a context that has already ended
// (cause is its error) and aborts the communicator, notifying the peers,
// whether this rank comes to the call before its peers or after them:
// issued, the call could complete with no wait that looks at the context,
// so the same program would fail or succeed by arrival order. The caller
// holds issueMu.
func (c *Comm) refuseEnded(op comm.Op, seq uint64, peer int, cause error) error {
	e := c.errorf(op, seq, peer, "%w before the call started (context: %w)", errCancelled, cause)
	c.abort(&comm.AbortError{Rank: c.rank, Cause: e}, true, true)
	return e
}

// issue stages w's buffers, enqueues its NCCL work and its event, and
// queues it. On failure w fails and, since the ranks can no longer agree
// on the sequence, the communicator is aborted.
func (c *Comm) issue(ctx context.Context, w *work, plan *stagePlan) error {
	fail := func(err error) error {
		e := c.wrap(w.op, w.seq, w.peer, err)
		c.fail(w, e, true)
		return e
	}
	if err := c.stage(w, plan); err != nil {
		return fail(err)
	}
	if c.empty(&w.call) {
		c.mu.Lock()
		err := c.finishLocked(w, nil)
		c.mu.Unlock()
		if err != nil {
			return fail(err)
		}
		return nil
	}
	if w.recorded {
		c.rec.Update(w.id, comm.Started, nil)
	}
	if err := c.enqueue(ctx, w); err != nil {
		return fail(err)
	}
	return c.record(w)
}

// record enqueues w's event and queues w; on failure w fails and the
// communicator is aborted.
func (c *Comm) record(w *work) error {
	c.mu.Lock()
	ev, err := c.eventLocked()
	if err == nil {
		err = ev.Record(c.stream)
		if err != nil {
			c.events = append(c.events, ev)
		}
	}
	if err != nil {
		c.mu.Unlock()
		e := c.wrap(w.op, w.seq, w.peer, err)
		c.fail(w, e, true)
		return e
	}
	w.event = ev
	w.issued = true
	if c.aborted {
		// A blocking-mode abort from another thread came between the
		// issue and now: nothing will complete w.
		e := c.wrap(w.op, w.seq, w.peer, c.failure.Load())
		c.abandonLocked(w, e)
		c.mu.Unlock()
		return e
	}
	c.queue = append(c.queue, w)
	c.mu.Unlock()
	return nil
}

// empty reports whether a collective moves no data on any rank, so that
// every rank skips NCCL alike.
func (c *Comm) empty(call *comm.Call) bool {
	switch call.Op {
	case comm.OpBarrier, comm.OpAllToAllV, comm.OpSend, comm.OpRecv:
		return false
	}
	return call.Count() == 0
}

// p2pOp is one ncclSend or ncclRecv of a group.
type p2pOp struct {
	send  bool
	ptr   uintptr
	count int
	peer  int
}

// enqueue issues w's NCCL call(s) on the stream.
func (c *Comm) enqueue(ctx context.Context, w *work) error {
	call := &w.call
	nc := &c.lib.nc
	h, s := c.h, c.stream.Handle()
	send, recv := w.sendPtr, w.recvPtr
	var dt comm.DType
	switch {
	case call.Send != nil:
		dt = call.Send.DType()
	case call.Recv != nil:
		dt = call.Recv.DType()
	}
	t, op := DataType(dt), RedOp(call.Reduce)
	es := uintptr(dt.Size())
	p := c.size
	switch call.Op {
	case comm.OpAllReduce:
		n := uintptr(call.Send.Len())
		return c.launch(ctx, w, "ncclAllReduce", func() int32 { return nc.allReduce(send, recv, n, t, op, h, s) })
	case comm.OpBarrier:
		b := uintptr(c.barrier.Ptr)
		return c.launch(ctx, w, "ncclAllReduce", func() int32 { return nc.allReduce(b, b, 1, ncclFloat32, ncclSum, h, s) })
	case comm.OpBroadcast:
		n := uintptr(call.Recv.Len())
		root := int32(call.Root)
		return c.launch(ctx, w, "ncclBroadcast", func() int32 { return nc.broadcast(send, recv, n, t, root, h, s) })
	case comm.OpReduce:
		n := uintptr(call.Send.Len())
		root := int32(call.Root)
		return c.launch(ctx, w, "ncclReduce", func() int32 { return nc.reduce(send, recv, n, t, op, root, h, s) })
	case comm.OpAllGather:
		n := uintptr(call.Send.Len())
		return c.launch(ctx, w, "ncclAllGather", func() int32 { return nc.allGather(send, recv, n, t, h, s) })
	case comm.OpReduceScatter:
		n := uintptr(call.Recv.Len())
		return c.launch(ctx, w, "ncclReduceScatter", func() int32 { return nc.reduceScatter(send, recv, n, t, op, h, s) })
	case comm.OpGather:
		n := call.Send.Len()
		root := call.Root
		if c.lib.nativeA2A {
			return c.launch(ctx, w, "ncclGather", func() int32 { return nc.gather(send, recv, uintptr(n), t, int32(root), h, s) })
		}
		var ops []p2pOp
		if c.rank == root {
			for r := range p {
				ops = append(ops, p2pOp{ptr: recv + uintptr(r*n)*es, count: n, peer: r})
			}
		}
		ops = append(ops, p2pOp{send: true, ptr: send, count: n, peer: root})
		return c.group(ctx, w, ops, t)
	case comm.OpScatter:
		n := call.Recv.Len()
		root := call.Root
		if c.lib.nativeA2A {
			return c.launch(ctx, w, "ncclScatter", func() int32 { return nc.scatter(send, recv, uintptr(n), t, int32(root), h, s) })
		}
		var ops []p2pOp
		if c.rank == root {
			for r := range p {
				ops = append(ops, p2pOp{send: true, ptr: send + uintptr(r*n)*es, count: n, peer: r})
			}
		}
		ops = append(ops, p2pOp{ptr: recv, count: n, peer: root})
		return c.group(ctx, w, ops, t)
	case comm.OpAllToAll:
		n := call.Send.Len() / p
		if c.lib.nativeA2A {
			return c.launch(ctx, w, "ncclAlltoAll", func() int32 { return nc.allToAll(send, recv, uintptr(n), t, h, s) })
		}
		var ops []p2pOp
		for r := range p {
			ops = append(ops,
				p2pOp{send: true, ptr: send + uintptr(r*n)*es, count: n, peer: r},
				p2pOp{ptr: recv + uintptr(r*n)*es, count: n, peer: r})
		}
		return c.group(ctx, w, ops, t)
	case comm.OpAllToAllV:
		// Every peer gets a send and a receive, zero-length ones too:
		// skipping them would desynchronise the group (NCCL 2.12.10+
		// accepts zero bytes).
		var ops []p2pOp
		soff, roff := 0, 0
		for r := range p {
			sc, rc := call.SendCounts[r], call.RecvCounts[r]
			ops = append(ops,
				p2pOp{send: true, ptr: offset(send, soff, es), count: sc, peer: r},
				p2pOp{ptr: offset(recv, roff, es), count: rc, peer: r})
			soff += sc
			roff += rc
		}
		return c.group(ctx, w, ops, t)
	}
	return fmt.Errorf("%w: op %v", comm.ErrUnsupported, call.Op)
}

// offset is base + n elements, or 0 when base is 0 (an empty buffer).
func offset(base uintptr, n int, es uintptr) uintptr {
	if base == 0 {
		return 0
	}
	return base + uintptr(n)*es
}

// launch runs one NCCL call on the device and settles it.
func (c *Comm) launch(ctx context.Context, w *work, name string, f func() int32) error {
	var rc int32
	if err := c.dev.Run(func() error { rc = f(); return nil }); err != nil {
		return err
	}
	return c.settled(ctx, w, name, rc)
}

// settled turns an NCCL return code into an error, polling a nonblocking
// communicator until the call has been enqueued.
func (c *Comm) settled(ctx context.Context, w *work, name string, rc int32) error {
	switch Result(rc) {
	case Success:
		return nil
	case InProgress:
		return settle(ctx, c.lib, c.h, name, w.deadline, c.Err)
	}
	return c.lib.ncclError(name, rc, c.h)
}

// group issues ops as one NCCL group (ncclGroupStart, ncclSend/ncclRecv,
// ncclGroupEnd) and settles it.
func (c *Comm) group(ctx context.Context, w *work, ops []p2pOp, t int32) error {
	nc := &c.lib.nc
	h, s := c.h, c.stream.Handle()
	var rc int32
	var name string
	err := c.dev.Run(func() error {
		if r := nc.groupStart(); r != 0 {
			rc, name = r, "ncclGroupStart"
			return nil
		}
		for _, o := range ops {
			var r int32
			if o.send {
				r = nc.send(o.ptr, uintptr(o.count), t, int32(o.peer), h, s)
			} else {
				r = nc.recv(o.ptr, uintptr(o.count), t, int32(o.peer), h, s)
			}
			if r != int32(Success) && r != int32(InProgress) {
				rc, name = r, "ncclSend"
				if !o.send {
					name = "ncclRecv"
				}
				_ = nc.groupEnd() // leave the group; its operations are abandoned
				return nil
			}
		}
		rc, name = nc.groupEnd(), "ncclGroupEnd"
		return nil
	})
	if err != nil {
		return err
	}
	return c.settled(ctx, w, name, rc)
}

// startP2P stages a Send or Recv and adds it to the batch (issueMu held).
func (c *Comm) startP2P(ctx context.Context, call *comm.Call, plan *stagePlan) (*work, error) {
	c.p2pSeq++
	w := c.newWork(ctx, call, c.p2pSeq, false)
	if err := c.stage(w, plan); err != nil {
		e := c.wrap(w.op, w.seq, w.peer, err)
		c.mu.Lock()
		_ = c.finishLocked(w, e) // nil: e is not nil, so nothing is copied
		c.mu.Unlock()
		return nil, e
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.aborted {
		e := c.wrap(w.op, w.seq, w.peer, c.failure.Load())
		_ = c.finishLocked(w, e) // nil: e is not nil, so nothing is copied
		return nil, e
	}
	c.batch = append(c.batch, w)
	return w, nil
}

// Flush gives the batched point-to-point work to NCCL as one group. Wait,
// Done and every collective do this implicitly.
func (c *Comm) Flush(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c.issueMu.Lock()
	c.flushLocked(ctx)
	c.issueMu.Unlock()
	err := c.Err()
	if err != nil {
		c.awaitAbort(ctx)
	}
	return err
}

// flushFor flushes the batch if w is still in it.
func (c *Comm) flushFor(ctx context.Context, w *work) {
	c.mu.Lock()
	waiting := !w.issued && !w.finished
	c.mu.Unlock()
	if !waiting || c.failure.Load() != nil {
		return // nothing to flush, or the abort fails the batch
	}
	c.issueMu.Lock()
	c.flushLocked(ctx)
	c.issueMu.Unlock()
}

// flushLocked issues the batch (issueMu held). NCCL has no tags: it matches
// a peer's sends with this rank's receives in issue order. So that Send
// and Recv match by tag as comm promises, the batch is ordered by tag
// (stably, so messages with one tag keep their order) on both sides: two
// ranks that post the same messages before a wait issue them in the same
// order. A failure fails the batch and aborts the communicator.
func (c *Comm) flushLocked(ctx context.Context) {
	c.mu.Lock()
	batch := c.batch
	c.batch = nil
	c.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	slices.SortStableFunc(batch, func(a, b *work) int { return a.tag - b.tag })
	ops := make([]p2pOp, len(batch))
	var dt comm.DType
	mixed := false
	for i, w := range batch {
		o := p2pOp{send: w.op == comm.OpSend, peer: w.peer}
		if o.send {
			o.ptr, o.count, dt = w.sendPtr, w.call.Send.Len(), w.call.Send.DType()
		} else {
			o.ptr, o.count, dt = w.recvPtr, w.call.Recv.Len(), w.call.Recv.DType()
		}
		ops[i] = o
		if i > 0 && dt != batchType(batch[0]) {
			mixed = true
		}
	}
	var err error
	if mixed {
		err = c.groupTyped(ctx, batch, ops)
	} else {
		err = c.group(ctx, batch[0], ops, DataType(dt))
	}
	if err != nil {
		c.failBatch(batch, err)
		return
	}
	for i, w := range batch {
		if w.recorded {
			c.rec.Update(w.id, comm.Started, nil)
		}
		if c.record(w) != nil {
			// The communicator is aborted: the rest of the batch, given to
			// NCCL but in no queue, fails with it.
			for _, rest := range batch[i+1:] {
				c.fail(rest, c.wrap(rest.op, rest.seq, rest.peer, c.failure.Load()), true)
			}
			return
		}
	}
	c.mu.Lock()
	c.driveLocked()
	c.mu.Unlock()
}

func batchType(w *work) comm.DType {
	if w.op == comm.OpSend {
		return w.call.Send.DType()
	}
	return w.call.Recv.DType()
}

// groupTyped is group for a batch whose operations have different types.
func (c *Comm) groupTyped(ctx context.Context, batch []*work, ops []p2pOp) error {
	nc := &c.lib.nc
	h, s := c.h, c.stream.Handle()
	var rc int32
	var name string
	err := c.dev.Run(func() error {
		if r := nc.groupStart(); r != 0 {
			rc, name = r, "ncclGroupStart"
			return nil
		}
		for i, o := range ops {
			t := DataType(batchType(batch[i]))
			var r int32
			if o.send {
				r, name = nc.send(o.ptr, uintptr(o.count), t, int32(o.peer), h, s), "ncclSend"
			} else {
				r, name = nc.recv(o.ptr, uintptr(o.count), t, int32(o.peer), h, s), "ncclRecv"
			}
			if r != int32(Success) && r != int32(InProgress) {
				rc = r
				_ = nc.groupEnd() // leave the group; its operations are abandoned
				return nil
			}
		}
		rc, name = nc.groupEnd(), "ncclGroupEnd"
		return nil
	})
	if err != nil {
		return err
	}
	return c.settled(ctx, batch[0], name, rc)
}

// failBatch fails every work of a batch that NCCL rejected and aborts the
// communicator (issueMu held).
func (c *Comm) failBatch(batch []*work, err error) {
	for _, w := range batch {
		c.fail(w, c.wrap(w.op, w.seq, w.peer, err), true)
	}
}

// exchange allgathers len(mine) bytes from every rank through NCCL (for
// the consistency and count checks) and returns them in rank order. It is
// not recorded and takes no sequence number; a failure aborts the
// communicator.
func (c *Comm) exchange(ctx context.Context, op comm.Op, seq uint64, mine []byte) ([]byte, error) {
	all := make([]byte, len(mine)*c.size)
	call := comm.Call{Op: comm.OpAllGather, Send: comm.Host(mine), Recv: comm.Host(all)}
	plan, err := c.plan(&call)
	if err != nil {
		return nil, c.wrap(op, seq, -1, err)
	}
	w := c.newWork(ctx, &call, seq, true)
	w.op = op
	if err := c.issue(ctx, w, plan); err != nil {
		return nil, err
	}
	// Wait without releasing issueMu: no other call may slip in between.
	start := time.Now()
	for {
		select {
		case <-w.done:
			if w.err != nil {
				return nil, w.err
			}
			return all, nil
		default:
		}
		c.mu.Lock()
		perr := c.progressLocked()
		c.mu.Unlock()
		if perr != nil {
			c.abort(&comm.AbortError{Rank: c.rank, Cause: perr}, true, true)
			continue
		}
		select {
		case <-w.done:
			continue
		default:
		}
		var cause error
		if e := c.failure.Load(); e != nil {
			// Another thread is aborting and needs issueMu to finish.
			cause = e
		} else if err := ctx.Err(); err != nil {
			cause = fmt.Errorf("%w during the cross-rank check (context: %w)", errCancelled, err)
		} else if time.Now().After(w.deadline) {
			cause = c.timeoutCause(w)
		}
		if cause != nil {
			e := c.wrap(op, seq, -1, cause)
			c.fail(w, e, true)
			return nil, e
		}
		pause(time.Since(start))
	}
}
