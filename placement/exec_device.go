package placement

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/mesh"
)

// The device form of execute: the same steps as the host's (exec.go,
// cross.go), on buffers of the tensor's device. Local copies are
// Kernels.CopyBox, Copy and Fill on the device's compute stream;
// collectives take the device buffers themselves, ordered after compute
// by device.BeforeCollective and before later compute by
// device.AfterCollective. Buffers come from the device's caching
// allocator (an Execute Allocator hands out host slices, so it is not
// used here); every buffer but the result is freed on return, which the
// allocator orders after the work queued on them.

// devBlock is one rank's local data on a device: a row-major array of
// shape in buf, which may hold more elements than prod(shape) (a prefix
// of a padded receive buffer).
type devBlock struct {
	shape []int
	buf   device.Buffer
}

// devRun is one device Execute: the device, the input it must not
// overwrite unless reuse, and the buffers it allocated.
type devRun struct {
	ctx    context.Context
	d      device.Device
	k      device.Kernels
	dt     comm.DType
	orig   device.Buffer
	reuse  bool
	allocs []device.Buffer
}

// newDevRun checks that t's device can run a redistribution.
func newDevRun(ctx context.Context, op string, b device.Buffer, dt comm.DType, reuse bool) (*devRun, error) {
	d := b.Owner()
	if d == nil {
		return nil, invalidf(op, "a buffer on %s without a device", b.Device())
	}
	k := d.Kernels()
	if k == nil {
		return nil, invalidf(op, "device %s has no Kernels to copy the local block with", d.Name())
	}
	return &devRun{ctx: ctx, d: d, k: k, dt: dt, orig: b, reuse: reuse}, nil
}

// alloc returns n elements of the tensor's dtype on the device, with
// undefined contents; the run frees them unless they become the result.
func (r *devRun) alloc(n int) (device.Buffer, error) {
	b, err := r.d.Alloc(r.dt, n)
	if err != nil {
		return nil, err
	}
	r.allocs = append(r.allocs, b)
	return b, nil
}

// zeros is alloc with every element 0.
func (r *devRun) zeros(n int) (device.Buffer, error) {
	b, err := r.alloc(n)
	if err != nil || n == 0 {
		return b, err
	}
	return b, r.k.Fill(b, 0)
}

// slice is b's elements [lo, hi).
func slice(b device.Buffer, lo, hi int) device.Buffer {
	return b.Slice(lo, hi).(device.Buffer)
}

// box is kernels.CopyBox on the device: dst and src start at element dlo
// and slo of their buffers. An empty box queues nothing.
func (r *devRun) box(dst device.Buffer, dlo int, dshape, doff []int, src device.Buffer, slo int, sshape, soff, size []int) error {
	if prod(size) == 0 {
		return nil
	}
	return r.k.CopyBox(slice(dst, dlo, dst.Len()), dshape, doff, slice(src, slo, src.Len()), sshape, soff, size)
}

// copyTo copies src's first n elements into dst's.
func (r *devRun) copyTo(dst, src device.Buffer, n int) error {
	if n == 0 {
		return nil
	}
	return r.d.Copy(slice(dst, 0, n), slice(src, 0, n))
}

// collective runs a collective of c on device buffers: after the compute
// queued so far, and before the compute queued next. A communicator with
// its own stream gets the buffers recorded on it, so that their memory is
// reused only after the collective.
func (r *devRun) collective(c comm.Communicator, start func() (comm.Work, error), bufs ...device.Buffer) error {
	if err := device.BeforeCollective(c, r.d); err != nil {
		return err
	}
	if sc, ok := c.(device.StreamComm); ok {
		for _, b := range bufs {
			if b.Len() > 0 {
				if err := r.d.RecordStream(b, sc.CommStream()); err != nil {
					return err
				}
			}
		}
	}
	w, err := start()
	if err != nil {
		return err
	}
	return device.AfterCollective(r.ctx, w, r.d)
}

// owned reports whether b is a buffer the run allocated (not a slice of
// one).
func (r *devRun) owned(b device.Buffer) bool {
	for _, a := range r.allocs {
		if a == b {
			return true
		}
	}
	return false
}

// finish makes x the result: a buffer of exactly prod(x.shape) elements
// that the result owns (never the input unless reuse), and frees every
// other buffer the run allocated. On err it frees them all and returns
// err.
func (r *devRun) finish(x devBlock, err error) (device.Buffer, error) {
	var out device.Buffer
	if err == nil {
		out = x.buf
		n := prod(x.shape)
		fresh := r.owned(out) && out.Len() == n
		if !fresh && !(r.reuse && out == r.orig) {
			if out, err = r.alloc(n); err == nil {
				err = r.copyTo(out, x.buf, n)
			}
		}
	}
	var errs []error
	for _, b := range r.allocs {
		if err != nil || b != out {
			errs = append(errs, b.Free())
		}
	}
	if err != nil {
		return nil, err
	}
	if ferr := errors.Join(errs...); ferr != nil {
		return nil, fmt.Errorf("placement: freeing temporaries on %s: %w", r.d.Name(), ferr)
	}
	return out, nil
}

// executeDevice is execute on t's device buffer b.
func executeDevice(ctx context.Context, pl *Plan, src, dst *mesh.Mesh, shape []int, b device.Buffer, reuse bool) (devBlock, error) {
	r, err := newDevRun(ctx, "Execute", b, pl.src.dtype, reuse)
	if err != nil {
		return devBlock{}, err
	}
	m := src
	x := devBlock{shape: shape, buf: b}
	for i := range pl.steps {
		st := &pl.steps[i]
		switch st.Kind {
		case StepDirect:
			x, err = r.crossExec(pl, src, dst, x)
			m = dst
		case StepPermute:
			x, err = r.permuteExec(st, x)
		default:
			x, err = r.stepExec(st, pl.src.shape, m, x)
		}
		if err != nil {
			_, err = r.finish(x, fmt.Errorf("placement: step %d (%s) on %s: %w", i+1, st, r.d.Name(), err))
			return devBlock{}, err
		}
	}
	out, err := r.finish(x, nil)
	if err != nil {
		return devBlock{}, err
	}
	return devBlock{shape: x.shape, buf: out}, nil
}

// stepExec runs one per-axis step: stepExec of exec.go on the device.
func (r *devRun) stepExec(st *Step, shape []int, m *mesh.Mesh, x devBlock) (devBlock, error) {
	coord := m.Coord()
	pre := st.pre
	a := st.Axis
	k := pre.mshape[a]
	me := coord[a]
	ls := x.shape
	nd := len(ls)
	n := prod(ls)
	zero := make([]int, nd)
	var c comm.Communicator
	if st.Collective != 0 {
		var err error
		if c, err = m.Comm(r.ctx, st.AxisName); err != nil {
			return x, err
		}
	}
	switch st.Kind {
	case StepAllGather:
		d := st.Dim
		par := parentLen(shape, pre, d, coord)
		_, maxp := chunk(par, k, 0)
		rest := restOf(ls, d)
		blk := maxp * rest
		send := slice(x.buf, 0, n)
		if n != blk {
			var err error
			if send, err = r.alloc(blk); err != nil { // the padding past x is never read back
				return x, err
			}
			if err := r.copyTo(send, x.buf, n); err != nil {
				return x, err
			}
		}
		out := devBlock{shape: with(ls, d, par)}
		recv, err := r.alloc(k * blk)
		if err != nil {
			return x, err
		}
		if err := r.collective(c, func() (comm.Work, error) { return comm.AllGatherAsync(r.ctx, c, send, recv) }, send, recv); err != nil {
			return x, err
		}
		if blk == 0 || (d == firstNonUnit(out.shape) && par == k*maxp) {
			out.buf = recv
			return out, nil
		}
		if out.buf, err = r.alloc(prod(out.shape)); err != nil {
			return x, err
		}
		for q := range k {
			off, sz := chunk(par, k, q)
			ps := with(ls, d, sz)
			if err := r.box(out.buf, 0, out.shape, at(nd, d, off), recv, q*blk, ps, zero, ps); err != nil {
				return x, err
			}
		}
		return out, nil

	case StepReduceScatter:
		d := st.Dim
		par := ls[d]
		_, maxp := chunk(par, k, 0)
		rest := restOf(ls, d)
		blk := maxp * rest
		send, err := r.alloc(k * blk) // the padding of short chunks is never read back
		if err != nil {
			return x, err
		}
		for q := range k {
			off, sz := chunk(par, k, q)
			ps := with(ls, d, sz)
			if err := r.box(send, q*blk, ps, zero, x.buf, 0, ls, at(nd, d, off), ps); err != nil {
				return x, err
			}
		}
		recv, err := r.alloc(blk)
		if err != nil {
			return x, err
		}
		if err := r.collective(c, func() (comm.Work, error) { return comm.ReduceScatterAsync(r.ctx, c, send, recv, st.Reduce) }, send, recv); err != nil {
			return x, err
		}
		_, sz := chunk(par, k, me)
		return devBlock{shape: with(ls, d, sz), buf: recv}, nil

	case StepAllReduce:
		in := x.buf
		if in.Len() != n {
			in = slice(in, 0, n)
		}
		out := devBlock{shape: ls, buf: in}
		if x.buf == r.orig && !r.reuse {
			var err error
			if out.buf, err = r.alloc(n); err != nil {
				return x, err
			}
		}
		if err := r.collective(c, func() (comm.Work, error) { return comm.AllReduceAsync(r.ctx, c, in, out.buf, st.Reduce) }, in, out.buf); err != nil {
			return x, err
		}
		return out, nil

	case StepAllToAll:
		i, j := st.Dim, st.ToDim
		parI := parentLen(shape, pre, i, coord)
		parJ := ls[j]
		sendCounts := make([]int, k)
		recvCounts := make([]int, k)
		_, myJ := chunk(parJ, k, me)
		for q := range k {
			_, szJ := chunk(parJ, k, q)
			sendCounts[q] = prod(with(ls, j, szJ))
			_, szI := chunk(parI, k, q)
			recvCounts[q] = prod(with(with(ls, i, szI), j, myJ))
		}
		send, err := r.alloc(n)
		if err != nil {
			return x, err
		}
		pos := 0
		for q := range k {
			offJ, szJ := chunk(parJ, k, q)
			bs := with(ls, j, szJ)
			if err := r.box(send, pos, bs, zero, x.buf, 0, ls, at(nd, j, offJ), bs); err != nil {
				return x, err
			}
			pos += sendCounts[q]
		}
		recv, err := r.alloc(sum(recvCounts))
		if err != nil {
			return x, err
		}
		even := parI%k == 0 && parJ%k == 0
		if err := r.collective(c, func() (comm.Work, error) {
			if even {
				return comm.AllToAllAsync(r.ctx, c, send, recv)
			}
			return comm.AllToAllVAsync(r.ctx, c, send, recv, sendCounts, recvCounts)
		}, send, recv); err != nil {
			return x, err
		}
		out := devBlock{shape: with(with(ls, i, parI), j, myJ)}
		if out.buf, err = r.alloc(prod(out.shape)); err != nil {
			return x, err
		}
		pos = 0
		for q := range k {
			offI, szI := chunk(parI, k, q)
			bs := with(with(ls, i, szI), j, myJ)
			if err := r.box(out.buf, 0, out.shape, at(nd, i, offI), recv, pos, bs, zero, bs); err != nil {
				return x, err
			}
			pos += recvCounts[q]
		}
		return out, nil

	case StepChunk:
		d := st.Dim
		off, sz := chunk(ls[d], k, me)
		out := devBlock{shape: with(ls, d, sz)}
		var err error
		if out.buf, err = r.alloc(prod(out.shape)); err != nil {
			return x, err
		}
		return out, r.box(out.buf, 0, out.shape, zero, x.buf, 0, ls, at(nd, d, off), out.shape)

	case StepToPartial:
		if st.To.op == comm.Sum && me != 0 {
			b, err := r.zeros(n)
			return devBlock{shape: ls, buf: b}, err
		}
		return x, nil // finish copies it if it is the input

	case StepShardToPartial:
		d := st.Dim
		par := parentLen(shape, pre, d, coord)
		off, _ := chunk(par, k, me)
		out := devBlock{shape: with(ls, d, par)}
		var err error
		if out.buf, err = r.zeros(prod(out.shape)); err != nil {
			return x, err
		}
		return out, r.box(out.buf, 0, out.shape, at(nd, d, off), x.buf, 0, ls, zero, ls)
	}
	return x, fmt.Errorf("unknown step kind %v", st.Kind)
}

// crossExec runs a cross-mesh step: crossExec of cross.go on the device.
func (r *devRun) crossExec(pl *Plan, src, dst *mesh.Mesh, x devBlock) (devBlock, error) {
	st := &pl.steps[pl.cross]
	cd := st.cross
	s, d := pl.src, pl.dst
	me := src.WorldRank()
	srcOff, _ := boxOf(s.shape, s.mshape, s.order, src.Coord())
	dstOff, dstSize := boxOf(d.shape, d.mshape, d.order, dst.Coord())
	out := devBlock{shape: dstSize}
	var err error
	if out.buf, err = r.alloc(prod(dstSize)); err != nil {
		return x, err
	}
	zero := make([]int, len(dstSize))
	for _, x2 := range cd.xfers {
		if x2.from == me && x2.to == me {
			if err := r.box(out.buf, 0, out.shape, sub(x2.off, dstOff), x.buf, 0, x.shape, sub(x2.off, srcOff), x2.size); err != nil {
				return x, err
			}
		}
	}
	if st.Collective == 0 {
		return out, nil
	}
	var c comm.Communicator
	pos := func(w int) int { return w }
	if len(s.ranks) == src.World().Size() {
		c = src.World()
	} else {
		if c, err = src.Group(r.ctx); err != nil {
			return x, err
		}
		idx := map[int]int{}
		for p, w := range s.ranks {
			idx[w] = p
		}
		pos = func(w int) int { return idx[w] }
	}
	p := c.Size()
	sendCounts := make([]int, p)
	recvCounts := make([]int, p)
	for _, x2 := range cd.xfers {
		if x2.from == x2.to {
			continue
		}
		n := prod(x2.size)
		if x2.from == me {
			sendCounts[pos(x2.to)] += n
		}
		if x2.to == me {
			recvCounts[pos(x2.from)] += n
		}
	}
	sendOff := prefix(sendCounts)
	recvOff := prefix(recvCounts)
	send, err := r.alloc(sum(sendCounts))
	if err != nil {
		return x, err
	}
	recv, err := r.alloc(sum(recvCounts))
	if err != nil {
		return x, err
	}
	for _, x2 := range cd.xfers {
		if x2.from == me && x2.to != me {
			q := pos(x2.to)
			if err := r.box(send, sendOff[q], x2.size, zero, x.buf, 0, x.shape, sub(x2.off, srcOff), x2.size); err != nil {
				return x, err
			}
			sendOff[q] += prod(x2.size)
		}
	}
	if err := r.collective(c, func() (comm.Work, error) {
		return comm.AllToAllVAsync(r.ctx, c, send, recv, sendCounts, recvCounts)
	}, send, recv); err != nil {
		return x, err
	}
	for _, x2 := range cd.xfers {
		if x2.to == me && x2.from != me {
			q := pos(x2.from)
			if err := r.box(out.buf, 0, out.shape, sub(x2.off, dstOff), recv, recvOff[q], x2.size, zero, x2.size); err != nil {
				return x, err
			}
			recvOff[q] += prod(x2.size)
		}
	}
	return out, nil
}
