//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// Do implements comm.Communicator: Start, then Wait; or, with
// WithBlockingCalls, a blocking MPI call when it may.
func (c *Comm) Do(ctx context.Context, call comm.Call) error {
	if ctx == nil {
		ctx = context.Background()
	}
	w, err := c.start(ctx, call, c.cfg.blocking)
	if err != nil {
		return err
	}
	if w.blocking {
		return c.runBlocking(w)
	}
	return w.Wait(ctx)
}

// Start implements comm.Communicator. Collectives are posted in call order;
// Send and Recv are posted at once.
func (c *Comm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	w, err := c.start(ctx, call, false)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if !w.finished {
		c.driveLocked()
	}
	c.mu.Unlock()
	return w, nil
}

// start validates and issues call. With blocking, a collective is
// returned unissued, marked blocking, for the caller to run
// (runBlocking).
func (c *Comm) start(ctx context.Context, call comm.Call, blocking bool) (*work, error) {
	p2p := call.Op == comm.OpSend || call.Op == comm.OpRecv
	seq, peer := c.seq+1, -1
	if p2p {
		seq, peer = c.p2pSeq.Load()+1, call.Peer
	}
	if call.Op == comm.OpSplit {
		return nil, c.errorf(call.Op, seq, -1, "%w: use Split", comm.ErrInvalid)
	}
	if e := c.failure.Load(); e != nil {
		return nil, c.wrap(call.Op, seq, peer, e)
	}
	c.mu.Lock()
	freed := c.freed
	c.mu.Unlock()
	if freed {
		return nil, c.errorf(call.Op, seq, peer, "%w: communicator freed", comm.ErrInvalid)
	}
	if err := ctx.Err(); err != nil {
		return nil, c.refuseEnded(&call, err)
	}
	invalid := c.validate(&call)
	check := c.cfg.opts.ConsistencyCheck && !p2p
	if invalid != nil && !check && call.Op != comm.OpAllToAllV {
		// Rejected here alone: nothing was posted and no sequence number
		// is taken.
		e := c.wrap(call.Op, seq, peer, invalid)
		id := c.rec.Begin(seq, &call, call.Algorithm)
		c.rec.Update(id, comm.Failed, e)
		return nil, e
	}
	if p2p {
		seq = c.p2pSeq.Add(1)
	} else {
		c.seq++
	}
	w := c.newWork(ctx, &call, seq)
	if check {
		fp := comm.FingerprintOf(seq, &call)
		fp.Site = callerSite()
		w.steps = append(w.steps, c.fingerprintStep(fp, invalid, 0, 0))
	}
	switch {
	case call.Op == comm.OpAllToAllV:
		w.steps = append(w.steps, c.countsStep(invalid))
	case invalid == nil:
		w.steps = append(w.steps, (*work).issue)
	}
	c.enqueue(w, blocking && !p2p)
	return w, nil
}

// refuseEnded fails a call given a context that has already ended
// (cause is its error) and aborts the communicator, notifying the peers,
// whether this rank comes to the call before its peers or after them: a
// wait notices the context only while a peer is missing, so the same
// program would otherwise fail or succeed by arrival order. A peer's
// abort notice that has already arrived wins.
func (c *Comm) refuseEnded(call *comm.Call, cause error) error {
	p2p := call.Op == comm.OpSend || call.Op == comm.OpRecv
	peer := -1
	if p2p {
		peer = call.Peer
	}
	c.mu.Lock()
	c.pollCtlLocked()
	if e := c.failure.Load(); e != nil {
		c.mu.Unlock()
		seq := c.seq + 1
		if p2p {
			seq = c.p2pSeq.Load() + 1
		}
		return c.wrap(call.Op, seq, peer, e)
	}
	var seq uint64
	if p2p {
		seq = c.p2pSeq.Add(1)
	} else {
		c.seq++
		seq = c.seq
	}
	e := c.errorf(call.Op, seq, peer, "%w before the call started (context: %w)", errCancelled, cause)
	id := c.rec.Begin(seq, call, call.Algorithm)
	c.rec.Update(id, comm.Failed, e)
	c.abortLocked(&comm.AbortError{Rank: c.rank, Cause: e}, true)
	c.mu.Unlock()
	c.hardAbort()
	return e
}

// hostOf is b's memory when the host can address it: a *comm.HostBuffer,
// or a comm.HostBacked device buffer (the emulated device's), viewed in
// place; nil otherwise.
func hostOf(b comm.Buffer) *comm.HostBuffer { return comm.HostView(b) }

// validate checks what this rank can check alone.
func (c *Comm) validate(call *comm.Call) error {
	if err := call.Validate(c.rank, c.size); err != nil {
		return err
	}
	for _, b := range []comm.Buffer{call.Send, call.Recv} {
		if b != nil && hostOf(b) == nil {
			return fmt.Errorf("%w: the mpi backend needs host or comm.HostBacked buffers, got %T on %s", comm.ErrUnsupported, b, b.Device())
		}
	}
	if call.Algorithm != comm.Auto {
		return fmt.Errorf("%w: algorithm %v: the MPI library chooses its own algorithms; only auto applies", comm.ErrUnsupported, call.Algorithm)
	}
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		if call.Tag < 0 || call.Tag >= lib.tagUB {
			return fmt.Errorf("%w: %v: tag %d out of range [0,%d)", comm.ErrInvalid, call.Op, call.Tag, lib.tagUB)
		}
	}
	s, r := hostOf(call.Send), hostOf(call.Recv)
	if s != nil && r != nil && comm.HostOverlap(s, r) != comm.Disjoint && !call.InPlace(c.rank) {
		return fmt.Errorf("%w: %v: send and recv overlap but not as the in-place form (%s)", comm.ErrInvalid, call.Op, comm.InPlaceRule(call.Op))
	}
	block := -1
	switch call.Op {
	case comm.OpAllGather, comm.OpGather:
		block = s.Len()
	case comm.OpReduceScatter, comm.OpScatter:
		block = r.Len()
	case comm.OpAllToAll:
		block = s.Len() / c.size
	case comm.OpAllToAllV:
		for _, counts := range [][]int{call.SendCounts, call.RecvCounts} {
			off := 0
			for j, n := range counts {
				if n > maxCount || off > maxCount {
					return fmt.Errorf("%w: alltoallv: the block for rank %d (%d elements at displacement %d) exceeds MPI's int count limit %d; split the call", comm.ErrUnsupported, j, n, off, maxCount)
				}
				off += n
			}
		}
	}
	if block > maxCount {
		return fmt.Errorf("%w: %v: per-rank block of %d elements exceeds MPI's int count limit %d; split the call", comm.ErrUnsupported, call.Op, block, maxCount)
	}
	return nil
}

// chunks calls f for consecutive pieces [lo, lo+n) of total elements, at
// most maxCount each, and at least once (for zero elements).
func chunks(total int, f func(lo, n int) error) error {
	for lo := 0; ; lo += maxCount {
		n := min(maxCount, total-lo)
		if err := f(lo, n); err != nil {
			return err
		}
		if lo+n >= total {
			return nil
		}
	}
}

// issue is the data step: it posts the operation's MPI requests.
func (w *work) issue() error {
	c, call := w.c, &w.call
	c.rec.Update(w.id, comm.Started, nil)
	send, recv := hostOf(call.Send), hostOf(call.Recv)
	var dt comm.DType
	var sb, rb []byte
	if send != nil {
		dt, sb = send.DType(), send.Bytes()
	}
	if recv != nil {
		dt, rb = recv.DType(), recv.Bytes()
	}
	mdt := C.loom_dtype(C.int(dt))
	es := dt.Size()
	var mop C.MPI_Op
	if call.Op.Reduces() {
		mop = C.loom_op(C.int(call.Reduce), C.int(dt))
	}
	at := func(b []byte, lo int) unsafe.Pointer { return ptr(b[lo*es:]) }
	inPlace := call.InPlace(c.rank)
	avg := func(b []byte) {
		if call.Reduce == comm.Avg {
			w.finish = append(w.finish, func() error { kernel.Scale(dt, b, c.size); return nil })
		}
	}
	h, root := c.h, C.int(call.Root)
	atRoot := c.rank == call.Root
	switch call.Op {
	case comm.OpAllReduce:
		w.use(sb, rb)
		avg(rb)
		return chunks(send.Len(), func(lo, n int) error {
			sp := at(sb, lo)
			if inPlace {
				sp = C.loom_in_place()
			}
			return ok(C.loom_allreduce(sp, at(rb, lo), C.int(n), mdt, mop, h, w.newReq()), w.mpiName("Allreduce"))
		})
	case comm.OpBroadcast:
		if atRoot && send != nil && comm.HostOverlap(send, recv) != comm.Same {
			copy(rb, sb)
		}
		w.use(rb)
		return chunks(recv.Len(), func(lo, n int) error {
			return ok(C.loom_bcast(at(rb, lo), C.int(n), mdt, root, h, w.newReq()), w.mpiName("Bcast"))
		})
	case comm.OpReduce:
		if atRoot {
			w.use(sb, rb)
			avg(rb)
		} else {
			w.use(sb)
		}
		return chunks(send.Len(), func(lo, n int) error {
			sp := at(sb, lo)
			var rp unsafe.Pointer
			if atRoot {
				rp = at(rb, lo)
				if inPlace {
					sp = C.loom_in_place()
				}
			}
			return ok(C.loom_reduce(sp, rp, C.int(n), mdt, mop, root, h, w.newReq()), w.mpiName("Reduce"))
		})
	case comm.OpAllGather:
		n := C.int(send.Len())
		w.use(sb, rb)
		sp := ptr(sb)
		if inPlace {
			sp = C.loom_in_place()
		}
		return ok(C.loom_allgather(sp, n, mdt, ptr(rb), n, mdt, h, w.newReq()), w.mpiName("Allgather"))
	case comm.OpReduceScatter:
		n := recv.Len()
		out := rb
		if inPlace {
			// MPI_IN_PLACE would leave the result at the start of the send
			// buffer; reduce into scratch and copy it to the rank-th block.
			out = scratch(len(rb))
			w.finish = append(w.finish, func() error { copy(rb, out); return nil })
		}
		w.use(sb, out)
		avg(rb)
		return ok(C.loom_reduce_scatter_block(ptr(sb), ptr(out), C.int(n), mdt, mop, h, w.newReq()), w.mpiName("Reduce_scatter_block"))
	case comm.OpGather:
		n := C.int(send.Len())
		var rp unsafe.Pointer
		if atRoot {
			rp = ptr(rb)
			w.use(rb)
		}
		w.use(sb)
		return ok(C.loom_gather(ptr(sb), n, mdt, rp, n, mdt, root, h, w.newReq()), w.mpiName("Gather"))
	case comm.OpScatter:
		n := C.int(recv.Len())
		var sp unsafe.Pointer
		if atRoot {
			sp = ptr(sb)
			w.use(sb)
		}
		w.use(rb)
		return ok(C.loom_scatter(sp, n, mdt, ptr(rb), n, mdt, root, h, w.newReq()), w.mpiName("Scatter"))
	case comm.OpAllToAll:
		n := C.int(send.Len() / c.size)
		w.use(sb, rb)
		return ok(C.loom_alltoall(ptr(sb), n, mdt, ptr(rb), n, mdt, h, w.newReq()), w.mpiName("Alltoall"))
	case comm.OpAllToAllV:
		p := c.size
		arr := unsafe.Slice((*C.int)(w.cAlloc(4*p*int(unsafe.Sizeof(C.int(0))))), 4*p)
		sc, sd, rc, rd := arr[:p], arr[p:2*p], arr[2*p:3*p], arr[3*p:]
		so, ro := 0, 0
		for j := range p {
			sc[j], sd[j] = C.int(call.SendCounts[j]), C.int(so)
			rc[j], rd[j] = C.int(call.RecvCounts[j]), C.int(ro)
			so += call.SendCounts[j]
			ro += call.RecvCounts[j]
		}
		w.use(sb, rb)
		return ok(C.loom_alltoallv(ptr(sb), &sc[0], &sd[0], mdt, ptr(rb), &rc[0], &rd[0], mdt, h, w.newReq()), w.mpiName("Alltoallv"))
	case comm.OpBarrier:
		return ok(C.loom_barrier(h, w.newReq()), w.mpiName("Barrier"))
	case comm.OpSend:
		w.use(sb)
		return chunks(send.Len(), func(lo, n int) error {
			return ok(C.MPI_Issend(at(sb, lo), C.int(n), mdt, C.int(call.Peer), C.int(call.Tag), h, w.newReq()), "MPI_Issend")
		})
	case comm.OpRecv:
		w.use(rb)
		w.recvType = mdt
		return chunks(recv.Len(), func(lo, n int) error {
			w.recvWant = append(w.recvWant, n)
			w.recvGot = append(w.recvGot, 0)
			w.recvDone = append(w.recvDone, false)
			return ok(C.MPI_Irecv(at(rb, lo), C.int(n), mdt, C.int(call.Peer), C.int(call.Tag), h, w.newReq()), "MPI_Irecv")
		})
	}
	return fmt.Errorf("%w: op %v", comm.ErrUnsupported, call.Op)
}

// scratch allocates n bytes aligned for any element type.
func scratch(n int) []byte {
	if n == 0 {
		return nil
	}
	words := make([]uint64, (n+7)/8)
	return unsafe.Slice((*byte)(unsafe.Pointer(&words[0])), n)
}
