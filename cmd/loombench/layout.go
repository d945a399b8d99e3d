package main

import (
	"context"
	"sort"

	"github.com/b7ea7098/loom/comm"
)

// Variants of a measurement, as nccl-tests names them.
const (
	outOfPlace = "out-of-place"
	inPlace    = "in-place"
)

// region is part of a buffer that holds a rank's input, starting at element
// first of that rank's input.
type region struct {
	buf   *comm.HostBuffer
	rank  int
	first int
}

// layout is one rank's call of one operation at one size and variant: the
// buffers, how to fill them, and what the output must hold.
type layout struct {
	op   benchOp
	call comm.Call
	// inputs are filled with input data before the first and the checked
	// iteration.
	inputs []region
	// out is the output this rank checks (nil: nothing to check); it is
	// filled with the sentinel before the checked iteration.
	out *comm.HostBuffer
	// src maps each element of out to the input it must equal.
	src source
	// next and prev are the peers of sendrecv.
	next, prev int
}

// bufferLens returns the lengths of rank r's send buffer and of its second
// buffer, which receives out of place and holds everything in place.
func bufferLens(op benchOp, sh shape, r int) (send, buf int) {
	send, recv := sh.sendCount, sh.recvCount
	if op.op == comm.OpAllToAllV {
		send, recv = sum(sh.sendCounts[r]), sum(sh.recvCounts[r])
	}
	return send, max(send, recv)
}

// layoutFor lays out rank r's call of op at shape sh over p ranks, out of
// place or in place, in the buffers send and buf (sized by bufferLens), as
// nccl-tests does: in place, AllGather sends from block r of the receive
// buffer and ReduceScatter receives into block r of the send buffer.
func layoutFor(op benchOp, sh shape, variant string, r, p, root int, send, buf *comm.HostBuffer) layout {
	l := layout{op: op, call: comm.Call{Op: op.op}}
	n := sh.paramCount
	in := variant == inPlace
	set := func(s, d *comm.HostBuffer) {
		l.call.Send, l.call.Recv, l.out = s, d, d
		if s != nil {
			l.inputs = []region{{buf: s, rank: r}}
		}
	}
	switch op.op {
	case comm.OpAllReduce:
		if in {
			set(buf.SliceHost(0, n), buf.SliceHost(0, n))
		} else {
			set(send.SliceHost(0, n), buf.SliceHost(0, n))
		}
		l.src = func(e int) (int, int) { return allRanks, e }
	case comm.OpAllGather:
		if in {
			set(buf.SliceHost(r*n, (r+1)*n), buf.SliceHost(0, p*n))
		} else {
			set(send.SliceHost(0, n), buf.SliceHost(0, p*n))
		}
		l.src = func(e int) (int, int) { return e / n, e % n }
	case comm.OpReduceScatter:
		if in {
			set(buf.SliceHost(0, p*n), buf.SliceHost(r*n, (r+1)*n))
		} else {
			set(send.SliceHost(0, p*n), buf.SliceHost(0, n))
		}
		l.src = func(e int) (int, int) { return allRanks, r*n + e }
	case comm.OpBroadcast:
		l.call.Root = root
		if in {
			set(buf.SliceHost(0, n), buf.SliceHost(0, n))
		} else {
			set(send.SliceHost(0, n), buf.SliceHost(0, n))
		}
		l.inputs[0].rank = root
		if r != root {
			// Only the root's data matter: in place the buffer is
			// all output, out of place the send buffer is ignored.
			l.inputs = nil
		}
		l.src = func(e int) (int, int) { return root, e }
	case comm.OpReduce:
		l.call.Root = root
		set(send.SliceHost(0, n), buf.SliceHost(0, n))
		if r != root {
			l.out = nil
		}
		l.src = func(e int) (int, int) { return allRanks, e }
	case comm.OpAllToAll:
		set(send.SliceHost(0, p*n), buf.SliceHost(0, p*n))
		l.src = func(e int) (int, int) { return e / n, r*n + e%n }
	case comm.OpAllToAllV:
		sc, rc := sh.sendCounts[r], sh.recvCounts[r]
		set(send.SliceHost(0, sum(sc)), buf.SliceHost(0, sum(rc)))
		l.call.SendCounts, l.call.RecvCounts = sc, rc
		recvOff := offsets(rc)
		sendOff := make([]int, p) // where rank j's block for r starts in j's send buffer
		for j := range p {
			sendOff[j] = offsets(sh.sendCounts[j])[r]
		}
		l.src = func(e int) (int, int) {
			j := sort.Search(p, func(j int) bool { return recvOff[j] > e }) - 1
			return j, sendOff[j] + e - recvOff[j]
		}
	case comm.OpSend: // sendrecv
		set(send.SliceHost(0, n), buf.SliceHost(0, n))
		l.next, l.prev = (r+1)%p, (r+p-1)%p
		l.src = func(e int) (int, int) { return l.prev, e }
	}
	return l
}

// prepare fills the inputs; before the checked iteration it first fills the
// output with the sentinel.
func (l *layout) prepare(prod, check bool) {
	if check && l.out != nil {
		fillSentinel(l.out)
	}
	for _, in := range l.inputs {
		fillInput(in.buf, prod, in.rank, in.first)
	}
}

// issue runs the call once on c.
func (l *layout) issue(ctx context.Context, c comm.Communicator) error {
	if l.op.op != comm.OpSend {
		return c.Do(ctx, l.call)
	}
	sw, err := comm.SendAsync(ctx, c, l.call.Send, l.next, 0)
	if err != nil {
		return err
	}
	rw, err := comm.RecvAsync(ctx, c, l.call.Recv, l.prev, 0)
	if err != nil {
		// Wait so that the send no longer uses its buffer; the receive's
		// failure is the one to report.
		_ = sw.Wait(ctx)
		return err
	}
	return comm.WaitAll(ctx, sw, rw)
}
