package local

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// The life of one collective on one rank: post a descriptor, wait for every
// member to arrive, agree that the calls match, move the data by the
// compiled schedule, and depart once no peer still reads this rank's buffers.

// run executes one collective end to end on this rank.
func (c *Comm) run(ctx context.Context, seq uint64, call *comm.Call, id uint64, sh *sharing) error {
	// Async work whose context ended before it ran aborts here, as a
	// call given an ended context does when it is issued.
	if err := c.admit(ctx, call.Op, seq, -1); err != nil {
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	c.rec.Update(id, comm.Started, nil)
	err := c.collective(c.waiter(ctx), seq, call, id, sh)
	if err != nil {
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	c.rec.Update(id, comm.Completed, nil)
	return nil
}

func (c *Comm) collective(wt *waiter, seq uint64, call *comm.Call, id uint64, sh *sharing) error {
	d := &c.g.slots[c.rank].desc
	c.post(d, seq, call)
	if sh != nil {
		sh.post(d)
	}
	c.g.publish(c.rank, progressWord(seq, 0))
	if err := c.arrive(wt, seq, call.Op); err != nil {
		return err
	}
	if err := c.agree(seq, call); err != nil {
		if derr := c.depart(wt, seq, call.Op); derr != nil {
			return derr
		}
		return err
	}
	if err := c.move(wt, seq, call, id); err != nil {
		c.trial = nil
		return err
	}
	var useErr error
	if sh != nil {
		useErr = c.use(seq, sh)
	}
	err := c.depart(wt, seq, call.Op)
	d.shared = nil // not kept alive until the next call
	if c.trial != nil {
		if err == nil {
			c.g.record(c.trial, c.rank, c.trialStart, time.Now(), c.trialN)
		}
		c.trial = nil
	}
	if err != nil {
		return err
	}
	return useErr
}

// waiter prepares this rank's waiter for one blocking call.
func (c *Comm) waiter(ctx context.Context) *waiter {
	c.wt = waiter{
		g: c.g, rank: c.rank, ctx: ctx, deadline: time.Now().Add(c.g.w.opts.Timeout),
		spin: c.spin, yield: c.yield, timer: c.wt.timer,
	}
	return &c.wt
}

// post fills this rank's descriptor. Validation failures are posted, not
// returned, so that every member learns of them before any data moves.
func (c *Comm) post(d *descriptor, seq uint64, call *comm.Call) {
	*d = descriptor{fp: comm.FingerprintOf(seq, call), scratch: d.scratch[:0]}
	if c.g.w.opts.ConsistencyCheck {
		d.fp.Site = callerSite()
	}
	d.invalid = c.validate(call)
	if d.invalid != nil {
		return
	}
	if b := hostOf(call.Send); b != nil {
		d.send, d.dtype = b.Bytes(), b.DType()
	}
	if b := hostOf(call.Recv); b != nil {
		d.recv, d.dtype = b.Bytes(), b.DType()
	}
	d.sendCounts, d.recvCounts = call.SendCounts, call.RecvCounts
	d.inPlace = call.InPlace(c.rank)
	if halfAvg(call, d.dtype) {
		// Avg of 16-bit floats divides each input by p first, as NCCL does,
		// so that a sum larger than the type's range does not overflow. The
		// scaled copy is private memory, so the call is no longer in place.
		need := len(d.send)
		if cap(c.prescaled) < need {
			c.prescaled = make([]byte, need)
		}
		scaled := c.prescaled[:need]
		copy(scaled, d.send)
		kernel.Scale(d.dtype, scaled, c.g.size)
		d.send, d.inPlace = scaled, false
	}
}

// halfAvg reports whether call averages 16-bit floats, which are divided
// before the sum rather than after it.
func halfAvg(call *comm.Call, dt comm.DType) bool {
	return call.Op.Reduces() && call.Reduce == comm.Avg && (dt == comm.BFloat16 || dt == comm.Float16)
}

// hostOf is b's memory when the host can address it: a *comm.HostBuffer,
// or a device buffer implementing comm.HostBacked (the emulated device's),
// viewed in place; nil otherwise.
func hostOf(b comm.Buffer) *comm.HostBuffer { return comm.HostView(b) }

// validate checks what one rank can check alone.
func (c *Comm) validate(call *comm.Call) error {
	if err := call.Validate(c.rank, c.g.size); err != nil {
		return err
	}
	for _, b := range []comm.Buffer{call.Send, call.Recv} {
		if b != nil && hostOf(b) == nil {
			return fmt.Errorf("%w: the local backend needs host or comm.HostBacked buffers, got %T on %s", comm.ErrUnsupported, b, b.Device())
		}
	}
	if call.Algorithm != comm.Auto && !supports(call.Op, call.Algorithm) {
		return fmt.Errorf("%w: algorithm %v does not apply to %v (local supports %v)", comm.ErrUnsupported, call.Algorithm, call.Op, Algorithms(call.Op))
	}
	s, r := hostOf(call.Send), hostOf(call.Recv)
	if s == nil || r == nil || comm.HostOverlap(s, r) == comm.Disjoint {
		return nil
	}
	if !call.InPlace(c.rank) {
		return fmt.Errorf("%w: %v: send and recv overlap but not as the in-place form (%s)", comm.ErrInvalid, call.Op, comm.InPlaceRule(call.Op))
	}
	return nil
}

// arrive waits until every member has posted its descriptor for seq.
func (c *Comm) arrive(wt *waiter, seq uint64, op comm.Op) error {
	for q := 0; q < c.g.size; q++ {
		if q == c.rank {
			continue
		}
		if err := wt.until(q, progressWord(seq, 0)); err != nil {
			return c.waitFailed(op, seq, err)
		}
	}
	return nil
}

// depart publishes that this rank has finished reading its peers and waits
// until all have, so that no buffer is reused while a peer still reads it.
func (c *Comm) depart(wt *waiter, seq uint64, op comm.Op) error {
	c.g.publish(c.rank, progressWord(seq, departMark))
	for q := 0; q < c.g.size; q++ {
		if q == c.rank {
			continue
		}
		if err := wt.until(q, progressWord(seq, departMark)); err != nil {
			return c.waitFailed(op, seq, err)
		}
	}
	return nil
}

// agree checks, identically on every member, that all posted valid and
// matching calls. Every member reads the same descriptors, so all reach the
// same verdict and the communicator stays usable after a rejected call.
func (c *Comm) agree(seq uint64, call *comm.Call) error {
	slots := c.g.slots
	var bad []string
	for q := range slots {
		if err := slots[q].desc.invalid; err != nil {
			bad = append(bad, fmt.Sprintf("rank %d: %v", q, err))
		}
	}
	if bad != nil {
		return c.errorf(call.Op, seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
	}
	mismatch := false
	for q := range slots {
		if !slots[q].desc.fp.Matches(slots[0].desc.fp) {
			mismatch = true
		}
	}
	if !mismatch {
		if err := agreeSharing(slots); err != nil {
			return c.wrap(call.Op, seq, -1, err)
		}
	}
	if !mismatch && call.Op != comm.OpBarrier && call.Op != comm.OpSplit {
		// Same dtype is part of the fingerprint; buffers that a peer reads
		// must also be large enough, which the counts guarantee.
		for q := range slots {
			if slots[q].desc.dtype != slots[0].desc.dtype {
				mismatch = true
			}
		}
	}
	if mismatch {
		fps := make([]comm.Fingerprint, len(slots))
		for q := range slots {
			fps[q] = slots[q].desc.fp
			fps[q].SendCounts = slices.Clone(fps[q].SendCounts) // the caller's slice
		}
		return c.wrap(call.Op, seq, -1, &comm.MismatchError{Calls: fps})
	}
	if call.Op == comm.OpAllToAllV {
		send := make([][]int, len(slots))
		recv := make([][]int, len(slots))
		for q := range slots {
			send[q], recv[q] = slots[q].desc.sendCounts, slots[q].desc.recvCounts
		}
		if err := comm.CheckCounts(send, recv); err != nil {
			return c.wrap(call.Op, seq, -1, err)
		}
	}
	return nil
}

// move performs the data movement of a validated, agreed call.
func (c *Comm) move(wt *waiter, seq uint64, call *comm.Call, id uint64) error {
	slots := c.g.slots
	me := &slots[c.rank].desc
	es := me.dtype.Size()
	p := c.g.size
	switch call.Op {
	case comm.OpBarrier:
		return nil
	case comm.OpAllToAll:
		// Each rank starts with its own block and then reads its peers in
		// turn from the next rank on (Open MPI's linear shift), so that the
		// ranks read different peers' buffers at once rather than all
		// reading rank 0's, then rank 1's.
		n := len(me.send) / p
		for i := 0; i < p; i++ {
			q := (c.rank + i) % p
			copy(me.recv[q*n:(q+1)*n], slots[q].desc.send[c.rank*n:(c.rank+1)*n])
		}
		return nil
	case comm.OpAllToAllV:
		offs := c.a2avOffsets[:0]
		at := 0
		for q := 0; q < p; q++ {
			offs = append(offs, at)
			at += me.recvCounts[q] * es
		}
		c.a2avOffsets = offs
		for i := 0; i < p; i++ {
			q := (c.rank + i) % p
			peer := &slots[q].desc
			off := 0
			for j := 0; j < c.rank; j++ {
				off += peer.sendCounts[j]
			}
			n := me.recvCounts[q] * es
			copy(me.recv[offs[q]:offs[q]+n], peer.send[off*es:off*es+n])
		}
		return nil
	case comm.OpGather:
		if c.rank == call.Root {
			n := len(me.send)
			for q := 0; q < p; q++ {
				copy(me.recv[q*n:(q+1)*n], slots[q].desc.send)
			}
		}
		return nil
	case comm.OpScatter:
		n := len(me.recv)
		copy(me.recv, slots[call.Root].desc.send[c.rank*n:(c.rank+1)*n])
		return nil
	}
	s, tr, err := c.schedule(call, me)
	if err != nil {
		return c.wrap(call.Op, seq, -1, err)
	}
	if call.Algorithm == comm.Auto {
		c.rec.SetAlgorithm(id, s.algo)
	}
	if need := s.scratch[c.rank] * es; need > 0 {
		if cap(c.scratch) < need {
			c.scratch = make([]byte, need, need+need/4)
		}
		me.scratch = c.scratch[:need]
	}
	if tr != nil {
		// A tuning trial: collective records it once this member has
		// departed, before its next call can arrive (see tune.go).
		c.trial, c.trialStart, c.trialN = tr, time.Now(), call.Count()
	}
	return c.execute(wt, seq, call, s, me.dtype)
}

// execute runs this rank's steps of s.
func (c *Comm) execute(wt *waiter, seq uint64, call *comm.Call, s *schedule, dt comm.DType) error {
	es := dt.Size()
	steps := s.steps[c.rank]
	for i := range steps {
		st := &steps[i]
		for _, d := range st.deps {
			if err := wt.until(d.rank, progressWord(seq, d.mark)); err != nil {
				return c.waitFailed(call.Op, seq, err)
			}
		}
		switch st.kind {
		case stepCopy:
			src := c.bytesOf(st.srcs[0], es)
			for _, d := range st.dsts {
				copy(c.bytesOf(d, es), src)
			}
		case stepReduce:
			dsts, srcs := c.dsts[:0], c.srcs[:0]
			for _, r := range st.dsts {
				dsts = append(dsts, c.bytesOf(r, es))
			}
			for _, r := range st.srcs {
				srcs = append(srcs, c.bytesOf(r, es))
			}
			if err := kernel.ReduceInto(dt, call.Reduce, s.stream, dsts, srcs); err != nil {
				return c.wrap(call.Op, seq, -1, err)
			}
			clear(dsts)
			clear(srcs)
			c.dsts, c.srcs = dsts, srcs
		case stepScale:
			kernel.Scale(dt, c.bytesOf(st.dsts[0], es), c.g.size)
		}
		if st.signal {
			c.g.publish(c.rank, progressWord(seq, i+1))
		}
	}
	return nil
}

func (c *Comm) bytesOf(r ref, es int) []byte {
	d := &c.g.slots[r.rank].desc
	var b []byte
	switch r.buf {
	case bufSend:
		b = d.send
	case bufRecv:
		b = d.recv
	case bufScratch:
		b = d.scratch
	}
	return b[r.off*es : (r.off+r.n)*es]
}
