package tcp

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// Algorithms returns the algorithms the tcp backend can force for op, in
// the order of comm.AllAlgorithms. Each applies to every group size.
func Algorithms(op comm.Op) []comm.Algorithm {
	switch op {
	case comm.OpAllReduce:
		return []comm.Algorithm{comm.Direct, comm.Ring, comm.Tree}
	case comm.OpAllGather, comm.OpReduceScatter:
		return []comm.Algorithm{comm.Direct, comm.Ring}
	case comm.OpBroadcast, comm.OpReduce:
		return []comm.Algorithm{comm.Direct, comm.Tree}
	case comm.OpGather, comm.OpScatter, comm.OpAllToAll, comm.OpAllToAllV, comm.OpBarrier:
		return []comm.Algorithm{comm.Direct}
	}
	return nil
}

func supports(op comm.Op, a comm.Algorithm) bool { return slices.Contains(Algorithms(op), a) }

// Crossovers of the automatic choice, from loombench -compare runs of
// every algorithm at 4 KiB to 64 MiB for 2 and 4 processes on a loaded
// two-core machine (README, Performance), where a message's latency (a
// wakeup of the receiving process) is a few hundred microseconds and
// costs as much as some 512 KiB on the wire.
//
// All-reduce: below directBytes every rank sends the whole vector to
// every other at once (one round of p-1 messages, summed in rank order);
// above, the ring (2(p-1) rounds of 1/p of the vector, pipelined by
// segment), except that with four ranks or more and under treeBytes the
// binomial tree (2·⌈log2 p⌉ rounds of the whole vector) takes fewer
// rounds and wins (at p=2 and 3 it has as many rounds as the ring and
// more bytes). All-gather: below allGatherDirectBytes of output with more than
// two ranks, the pairwise exchange (one round, p-1 segmented streams at
// once) beats the ring's p-1 rounds; above, the ring's one stream at a
// time does (at p=2 the two are the same exchange). Reduce-scatter:
// direct below directBytes per rank, the ring above.
const (
	directBytes          = 16 << 10
	treeBytes            = 512 << 10
	allGatherDirectBytes = 4 << 20
)

// segmentBytes is the size of the frames a ring step is cut into, so that
// the receiver reduces one segment while the next is on the wire;
// minSegmentBytes bounds how small segmentOf cuts a small block.
const (
	segmentBytes    = 256 << 10
	minSegmentBytes = 32 << 10
)

func (c *Comm) choose(call *comm.Call) (comm.Algorithm, error) {
	a := call.Algorithm
	if a == comm.Auto {
		a = c.cfg.opts.Algorithms.For(call.Op, supports)
	}
	if a != comm.Auto {
		if !supports(call.Op, a) {
			return 0, fmt.Errorf("%w: algorithm %v for %v (the tcp backend has %v)", comm.ErrUnsupported, a, call.Op, Algorithms(call.Op))
		}
		return a, nil
	}
	var bytes int
	if b := call.Send; b != nil {
		bytes = b.Len() * b.DType().Size()
	} else if b := call.Recv; b != nil {
		bytes = b.Len() * b.DType().Size()
	}
	switch call.Op {
	case comm.OpAllReduce:
		if bytes < directBytes {
			return comm.Direct, nil
		}
		if c.Size() >= 4 && bytes < treeBytes {
			return comm.Tree, nil
		}
		return comm.Ring, nil
	case comm.OpAllGather:
		// bytes is this rank's block: the output is p of them.
		if bytes < directBytes || c.Size() > 2 && bytes*c.Size() < allGatherDirectBytes {
			return comm.Direct, nil
		}
		return comm.Ring, nil
	case comm.OpReduceScatter:
		if bytes/c.Size() < directBytes {
			return comm.Direct, nil
		}
		return comm.Ring, nil
	case comm.OpBroadcast, comm.OpReduce:
		return comm.Tree, nil
	}
	return comm.Direct, nil
}

func bytesOf(b comm.Buffer) []byte {
	if b == nil {
		return nil
	}
	return b.(*comm.HostBuffer).Bytes()
}

func sameStart(a, b []byte) bool {
	return len(a) > 0 && len(b) > 0 && &a[0] == &b[0]
}

// run moves the operation's data.
func (e *exec) run(ctx context.Context) error {
	call := &e.call
	p, r := e.c.Size(), e.rank()
	send, recv := bytesOf(call.Send), bytesOf(call.Recv)
	var dt comm.DType
	if call.Send != nil {
		dt = call.Send.DType()
	} else if call.Recv != nil {
		dt = call.Recv.DType()
	}
	es := max(dt.Size(), 1)
	if call.Op.Collective() && e.c.cfg.opts.ConsistencyCheck && p > 1 {
		if err := e.checkConsistency(ctx); err != nil {
			return err
		}
	}
	switch call.Op {
	case comm.OpSend:
		return e.sent(ctx, []*outFrame{e.posted}, []int{call.Peer})
	case comm.OpRecv:
		return e.recvInto(ctx, call.Peer, recv)
	case comm.OpBarrier:
		return e.exchange(ctx, func(int) []byte { return nil }, func(int, []byte) error { return nil })
	case comm.OpAllReduce:
		if !sameStart(send, recv) {
			copy(recv, send)
		}
		switch e.algo {
		case comm.Ring:
			return e.allReduceRing(ctx, dt, recv)
		case comm.Tree:
			if err := e.reduceTree(ctx, dt, recv, 0); err != nil {
				return err
			}
			return e.broadcastTree(ctx, recv, 0)
		}
		return e.reduceDirect(ctx, dt, send, recv, true)
	case comm.OpReduce:
		work := recv
		if r != call.Root {
			work = slices.Clone(send)
		} else if !sameStart(send, recv) {
			copy(recv, send)
		}
		if e.algo == comm.Tree {
			return e.reduceTree(ctx, dt, work, call.Root)
		}
		return e.reduceDirect(ctx, dt, send, work, false)
	case comm.OpBroadcast:
		if r == call.Root && !sameStart(send, recv) {
			copy(recv, send)
		}
		if e.algo == comm.Tree {
			return e.broadcastTree(ctx, recv, call.Root)
		}
		if r == call.Root {
			return e.toAll(ctx, func(int) []byte { return recv })
		}
		return e.recvInto(ctx, call.Root, recv)
	case comm.OpAllGather:
		n := len(recv) / p
		own := recv[r*n : (r+1)*n]
		if !sameStart(send, own) {
			copy(own, send)
		}
		if e.algo == comm.Ring {
			return e.ring(ctx, p-1, 0, func(s int) (int, int) { return (r - s + p) % p, (r - s - 1 + p) % p },
				func(i int) []byte { return recv[i*n : (i+1)*n] }, nil, dt, false)
		}
		// Direct: the pairwise, segmented exchange of AllToAll with this
		// rank's block as every peer's message.
		return e.allToAll(ctx, func(int) []byte { return own }, func(q int) []byte { return recv[q*n : (q+1)*n] }, es)
	case comm.OpReduceScatter:
		n := len(send) / p
		if p == 1 {
			copy(recv, send)
			return nil
		}
		if e.algo == comm.Ring {
			// The partial sums land in scratch memory, slot s holding the
			// block received at step s, and the last one, block r, in
			// recv: send is only read, never copied, and p=2 needs no
			// scratch at all.
			work := e.c.scratchOf((p - 2) * n)
			block := func(i int) []byte {
				if i == r {
					return recv
				}
				s := (r - i - 2 + 2*p) % p
				return work[s*n : (s+1)*n]
			}
			err := e.ring(ctx, p-1, p-1, func(s int) (int, int) { return (r - s - 1 + p) % p, (r - s - 2 + 2*p) % p },
				block, func(i int) []byte { return send[i*n : (i+1)*n] }, dt, false)
			if err != nil {
				return err
			}
			e.scale(dt, recv)
			return nil
		}
		srcs := make([][]byte, p)
		srcs[r] = send[r*n : (r+1)*n]
		err := e.exchange(ctx, func(q int) []byte { return send[q*n : (q+1)*n] },
			func(q int, b []byte) error {
				if len(b) != n {
					return e.lengthMismatch(q, len(b), n)
				}
				srcs[q] = b
				return nil
			})
		if err != nil {
			return err
		}
		if err := kernel.Reduce(dt, call.Reduce, recv, srcs...); err != nil {
			return err
		}
		e.scale(dt, recv)
		return nil
	case comm.OpGather:
		if r != call.Root {
			return e.sent(ctx, []*outFrame{e.send(call.Root, send)}, []int{call.Root})
		}
		n := len(send)
		copy(recv[r*n:(r+1)*n], send)
		// Every receive posted first, so that each lands in place.
		pds := make([]pending, 0, p)
		for q := range p {
			if q != r {
				pds = append(pds, e.expect(q, recv[q*n:(q+1)*n]))
			}
		}
		for _, pd := range pds {
			if err := e.awaitInto(ctx, pd); err != nil {
				return err
			}
		}
		return nil
	case comm.OpScatter:
		if r != call.Root {
			return e.recvInto(ctx, call.Root, recv)
		}
		n := len(recv)
		copy(recv, send[r*n:(r+1)*n])
		return e.toAll(ctx, func(q int) []byte { return send[q*n : (q+1)*n] })
	case comm.OpAllToAll:
		n := len(send) / p
		return e.allToAll(ctx, func(q int) []byte { return send[q*n : (q+1)*n] }, func(q int) []byte { return recv[q*n : (q+1)*n] }, es)
	case comm.OpAllToAllV:
		so, ro := offsets(call.SendCounts, es), offsets(call.RecvCounts, es)
		return e.allToAll(ctx, func(q int) []byte { return send[so[q]:so[q+1]] }, func(q int) []byte { return recv[ro[q]:ro[q+1]] }, es)
	}
	return fmt.Errorf("%w: op %v", comm.ErrUnsupported, call.Op)
}

func (e *exec) rank() int { return e.c.rank }

func offsets(counts []int, es int) []int {
	o := make([]int, len(counts)+1)
	for i, n := range counts {
		o[i+1] = o[i] + n*es
	}
	return o
}

// scale finishes an average.
func (e *exec) scale(dt comm.DType, b []byte) {
	if e.call.Reduce == comm.Avg {
		kernel.Scale(dt, b, e.c.Size())
	}
}

func (e *exec) lengthMismatch(src, got, want int) error {
	err := fmt.Errorf("%w: rank %d sent %d bytes where this rank expects %d", comm.ErrMismatch, src, got, want)
	e.c.Abort(err)
	return e.c.failure.Load()
}

// fill copies a received message into dst, checking its length.
func (e *exec) fill(src int, dst, b []byte) error {
	if len(b) != len(dst) {
		return e.lengthMismatch(src, len(b), len(dst))
	}
	copy(dst, b)
	e.c.t.release(b)
	return nil
}

// toAll sends out(q) to every other rank and waits for the writes.
func (e *exec) toAll(ctx context.Context, out func(q int) []byte) error {
	p, r := e.c.Size(), e.rank()
	fs, ds := make([]*outFrame, 0, p), make([]int, 0, p)
	for i := 1; i < p; i++ {
		q := (r + i) % p
		fs, ds = append(fs, e.send(q, out(q))), append(ds, q)
	}
	return e.sent(ctx, fs, ds)
}

// allToAll sends out(q) to every rank q and receives rank q's message for
// this rank into in(q), in p-1 pairwise steps: at step s this rank sends
// to r+s and receives from r-s, so that each peer is written to by one
// rank at a time. Every receive is posted before the first send, so that
// the segments land in place (no pooled buffer, no copy); each message is
// cut into segments of segmentBytes (elements of es bytes), so that a
// large one streams and the reader claims its later segments even when
// the first came before the post; the sends of step s+1 are queued before
// this rank waits for step s's receives, so that each step's sends and
// receives overlap and the next step's start while they finish.
func (e *exec) allToAll(ctx context.Context, out, in func(q int) []byte, es int) error {
	p, r := e.c.Size(), e.rank()
	if !sameStart(in(r), out(r)) {
		copy(in(r), out(r))
	}
	seg := max(segmentBytes/es, 1) * es
	steps := make([][]pending, p)
	for s := 1; s < p; s++ {
		q := (r - s + p) % p
		dst := in(q)
		for lo := 0; ; lo += seg {
			hi := min(lo+seg, len(dst))
			pd := e.expect(q, dst[lo:hi])
			pd.more = hi < len(dst)
			steps[s] = append(steps[s], pd)
			if hi == len(dst) {
				break
			}
		}
	}
	var fs []*outFrame
	var ds []int
	sendStep := func(s int) {
		q := (r + s) % p
		b := out(q)
		for lo := 0; ; lo += seg {
			hi := min(lo+seg, len(b))
			fs, ds = append(fs, e.sendSeg(q, b[lo:hi], hi < len(b))), append(ds, q)
			if hi == len(b) {
				break
			}
		}
	}
	if p > 1 {
		sendStep(1)
	}
	for s := 1; s < p; s++ {
		if s+1 < p {
			sendStep(s + 1)
		}
		for _, pd := range steps[s] {
			if err := e.awaitInto(ctx, pd); err != nil {
				return err
			}
		}
	}
	return e.sent(ctx, fs, ds)
}

// exchange sends out(q) to every other rank and hands each rank's message
// to in, in rank order after this one, then waits for the writes.
func (e *exec) exchange(ctx context.Context, out func(q int) []byte, in func(q int, b []byte) error) error {
	p, r := e.c.Size(), e.rank()
	fs, ds := make([]*outFrame, 0, p), make([]int, 0, p)
	for i := 1; i < p; i++ {
		q := (r + i) % p
		fs, ds = append(fs, e.send(q, out(q))), append(ds, q)
	}
	for i := 1; i < p; i++ {
		q := (r - i + p) % p
		b, err := e.recv(ctx, q)
		if err != nil {
			return err
		}
		if err := in(q, b); err != nil {
			return err
		}
	}
	return e.sent(ctx, fs, ds)
}

// ring runs steps of a ring: at step s this rank sends block out of
// idx(s) to its right neighbour and receives block in from its left one,
// reducing it into its own block (the first reduceSteps steps) or
// overwriting it (the rest). Every caller's ring passes on at step s+1 the
// block it received at step s, so the ring is pipelined by segment: each
// segment goes on to the right as soon as it is reduced or copied, while
// the next one is still on the wire, instead of a step waiting for the
// whole of the previous one. With scale, the segments of the last reduced
// block are averaged before they go on (an all-reduce's Avg). src, when
// not nil, holds this rank's own contribution by block, read only: step
// 0 sends src's block and a reduction writes src's block plus the
// received one into block's; nil means block holds it, reduced in place.
//
// A segment is overwritten (a later step's copy) only after this rank's
// own earlier frame of it was written: the value that overwrites it came
// round the ring from the peers, which could only compute it from the
// bytes of that frame, already taken by the kernel. The writes all finish
// before ring returns, so callers may reuse the memory.
func (e *exec) ring(ctx context.Context, steps, reduceSteps int, idx func(s int) (out, in int), block, src func(i int) []byte, dt comm.DType, scale bool) error {
	if steps == 0 {
		return nil
	}
	if src == nil {
		src = block
	}
	p, r := e.c.Size(), e.rank()
	right, left := (r+1)%p, (r-1+p)%p
	es := max(dt.Size(), 1)
	var fs []*outFrame
	var ds []int
	// Every receive is reserved before the first send, in the order the
	// frames come, and those of the copying steps post their destination,
	// so that they land in place.
	var pds []pending
	for s := range steps {
		_, i := idx(s)
		ib := block(i)
		seg := segmentOf(len(ib), es)
		for lo := 0; lo < len(ib); lo += seg {
			var dst []byte
			if s >= reduceSteps {
				dst = ib[lo:min(lo+seg, len(ib))]
			}
			pds = append(pds, e.expect(left, dst))
		}
	}
	o, _ := idx(0)
	ob := src(o)
	seg := segmentOf(len(ob), es)
	for lo := 0; lo < len(ob); lo += seg {
		fs, ds = append(fs, e.send(right, ob[lo:min(lo+seg, len(ob))])), append(ds, right)
	}
	for s := range steps {
		_, i := idx(s)
		ib, sb := block(i), src(i)
		seg := segmentOf(len(ib), es)
		for lo := 0; lo < len(ib); lo += seg {
			hi := min(lo+seg, len(ib))
			dst := ib[lo:hi]
			pd := pds[0]
			pds = pds[1:]
			if s >= reduceSteps {
				if err := e.awaitInto(ctx, pd); err != nil {
					return err
				}
				if s+1 < steps {
					fs, ds = append(fs, e.send(right, dst)), append(ds, right)
				}
				continue
			}
			b, _, err := e.await(ctx, pd)
			if err != nil {
				return err
			}
			if len(b) != len(dst) {
				return e.lengthMismatch(left, len(b), len(dst))
			}
			if err := kernel.Reduce(dt, e.call.Reduce, dst, sb[lo:hi], b); err != nil {
				return err
			}
			if scale && s == reduceSteps-1 {
				e.scale(dt, dst)
			}
			e.c.t.release(b)
			if s+1 < steps {
				fs, ds = append(fs, e.send(right, dst)), append(ds, right)
			}
		}
	}
	return e.sent(ctx, fs, ds)
}

// segmentOf returns the frame size, in bytes, a ring cuts a block of n
// bytes into: segmentBytes, or for a block under four of them a quarter of
// it (at least minSegmentBytes), so that even a small block pipelines;
// always a whole number of elements of es bytes.
func segmentOf(n, es int) int {
	seg := segmentBytes
	if n < 4*segmentBytes {
		seg = max(n/4, minSegmentBytes)
	}
	return max(seg/es, 1) * es
}

// allReduceRing reduce-scatters buf around the ring (p-1 steps, leaving
// rank r with block r+1 reduced), then all-gathers the blocks (p-1 more),
// as one ring of 2(p-1) steps: the step that passes on block r+1 finished
// is the step after the one that reduced it, so the two phases pipeline
// into each other.
func (e *exec) allReduceRing(ctx context.Context, dt comm.DType, buf []byte) error {
	p, r := e.c.Size(), e.rank()
	es := dt.Size()
	n := len(buf) / es
	block := func(i int) []byte { return buf[i*n/p*es : (i+1)*n/p*es] }
	return e.ring(ctx, 2*(p-1), p-1, func(s int) (int, int) { return ((r-s)%p + p) % p, ((r-s-1)%p + p) % p }, block, nil, dt, true)
}

// reduceTree reduces work up a binomial tree rooted at root; the result
// (averaged for Avg) is left in root's work.
func (e *exec) reduceTree(ctx context.Context, dt comm.DType, work []byte, root int) error {
	p, r := e.c.Size(), e.rank()
	v := (r - root + p) % p
	for mask := 1; mask < p; mask <<= 1 {
		if v&mask != 0 {
			to := (v - mask + root) % p
			return e.sent(ctx, []*outFrame{e.send(to, work)}, []int{to})
		}
		if v+mask < p {
			from := (v + mask + root) % p
			b, err := e.recv(ctx, from)
			if err != nil {
				return err
			}
			if len(b) != len(work) {
				return e.lengthMismatch(from, len(b), len(work))
			}
			if err := kernel.Reduce(dt, e.call.Reduce, work, work, b); err != nil {
				return err
			}
			e.c.t.release(b)
		}
	}
	e.scale(dt, work)
	return nil
}

// broadcastTree copies root's buf down a binomial tree.
func (e *exec) broadcastTree(ctx context.Context, buf []byte, root int) error {
	p, r := e.c.Size(), e.rank()
	v := (r - root + p) % p
	mask := 1
	for ; mask < p; mask <<= 1 {
		if v&mask != 0 {
			if err := e.recvInto(ctx, (v-mask+root)%p, buf); err != nil {
				return err
			}
			break
		}
	}
	var fs []*outFrame
	var ds []int
	for mask >>= 1; mask > 0; mask >>= 1 {
		if v+mask < p {
			to := (v + mask + root) % p
			fs, ds = append(fs, e.send(to, buf)), append(ds, to)
		}
	}
	return e.sent(ctx, fs, ds)
}

// reduceDirect: every rank sends its input to the root (to every rank when
// all), which reduces the inputs in rank order.
func (e *exec) reduceDirect(ctx context.Context, dt comm.DType, send, work []byte, all bool) error {
	p, r := e.c.Size(), e.rank()
	if send == nil || sameStart(send, work) {
		send = slices.Clone(work)
	}
	srcs := make([][]byte, p)
	srcs[r] = send
	in := func(q int, b []byte) error {
		if len(b) != len(work) {
			return e.lengthMismatch(q, len(b), len(work))
		}
		srcs[q] = b
		return nil
	}
	if all {
		if err := e.exchange(ctx, func(int) []byte { return send }, in); err != nil {
			return err
		}
	} else if root := e.call.Root; r != root {
		return e.sent(ctx, []*outFrame{e.send(root, send)}, []int{root})
	} else {
		for q := range p {
			if q == r {
				continue
			}
			b, err := e.recv(ctx, q)
			if err != nil {
				return err
			}
			if err := in(q, b); err != nil {
				return err
			}
		}
	}
	if err := kernel.Reduce(dt, e.call.Reduce, work, srcs...); err != nil {
		return err
	}
	e.scale(dt, work)
	return nil
}
