package placement

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
)

// elem is the set of element types a DTensor can hold.
type elem interface{ float32 | float64 }

// block is one rank's local data: a row-major array of shape.
type block[T elem] struct {
	shape []int
	data  []T
}

// with returns a copy of s with s[d] = v.
func with(s []int, d, v int) []int {
	c := slices.Clone(s)
	c[d] = v
	return c
}

// at returns a zero offset of length n with position d set to v.
func at(n, d, v int) []int {
	o := make([]int, n)
	o[d] = v
	return o
}

// execute runs steps on this rank. Steps up to the cross-mesh step (if
// any) run on src, the rest on dst. The last step writes its output to a
// result buffer of al, the others to temporaries. With reuse, x's memory
// may hold the result (an all-reduce then runs in place).
func execute[T elem](ctx context.Context, pl *Plan, src, dst *mesh.Mesh, x block[T], al Allocator, reuse bool) (block[T], error) {
	m := src
	shape := pl.src.shape
	orig := x.data
	var short error // an allocator's short buffer, reported after the step
	for i := range pl.steps {
		st := &pl.steps[i]
		buf := bufs[T]{al: al, last: i == len(pl.steps)-1, orig: orig, reuse: reuse, short: &short}
		var err error
		switch st.Kind {
		case StepDirect:
			x, err = crossExec(ctx, pl, src, dst, x)
			m = dst
		case StepPermute:
			x = permuteExec(st, x)
		default:
			x, err = stepExec(ctx, st, shape, m, x, buf)
		}
		if err == nil {
			err = short
		}
		if err != nil {
			return x, fmt.Errorf("placement: step %d (%s): %w", i+1, st, err)
		}
	}
	if !reuse && sameStart(x.data, orig) {
		out := bufs[T]{al: al, last: true, short: &short}.out(len(x.data))
		if short != nil {
			return x, fmt.Errorf("placement: %w", short)
		}
		copy(out, x.data)
		x.data = out
	}
	return x, nil
}

// sameStart reports whether a and b are non-empty and start at the same
// element.
func sameStart[T any](a, b []T) bool {
	return len(a) > 0 && len(b) > 0 && &a[0] == &b[0]
}

// bufs hands out one step's buffers: its output is a result buffer when
// the step is the plan's last, a temporary otherwise; buffers the step
// only uses inside itself are temporaries.
type bufs[T elem] struct {
	al    Allocator
	last  bool
	orig  []T    // the tensor Execute was given
	reuse bool   // orig's memory may hold the result
	short *error // set when al returns fewer elements than asked for
}

// overwritable reports whether the step may write its output over data,
// its input: data is empty, the caller gave up the input's memory, or
// data is a temporary of an earlier step and the output is a temporary
// too.
func (b bufs[T]) overwritable(data []T) bool {
	switch {
	case len(data) == 0:
		return true // nothing to write
	case sameStart(data, b.orig):
		return b.reuse
	}
	return !b.last
}

// out returns n elements, with arbitrary contents, for the step's output.
func (b bufs[T]) out(n int) []T { return b.take(n, b.last) }

// temp returns n elements, with arbitrary contents, used only inside the
// step.
func (b bufs[T]) temp(n int) []T { return b.take(n, false) }

// take is n elements of b.al. An allocator that returns fewer is a bug of
// the caller's: the step goes on in fresh memory (the collective must still
// match its peers') and Execute then fails with b.short.
func (b bufs[T]) take(n int, result bool) []T {
	buf := alloc[T](b.al, n, result)
	if len(buf) < n {
		if *b.short == nil {
			*b.short = fmt.Errorf("%w: the Allocator returned %d elements for %d", ErrInvalid, len(buf), n)
		}
		return make([]T, n)
	}
	return buf[:n]
}

// zeroOut is out with every element 0.
func (b bufs[T]) zeroOut(n int) []T {
	o := b.out(n)
	clear(o)
	return o
}

// alloc asks al for n elements (it may return fewer: see bufs.take), or
// makes them when al is nil.
func alloc[T elem](al Allocator, n int, result bool) []T {
	if al == nil {
		return make([]T, n)
	}
	var z T
	switch any(z).(type) {
	case float32:
		return any(al.Float32(n, result)).([]T)
	default:
		return any(al.Float64(n, result)).([]T)
	}
}

// stepExec runs one per-axis step.
func stepExec[T elem](ctx context.Context, st *Step, shape []int, m *mesh.Mesh, x block[T], buf bufs[T]) (block[T], error) {
	coord := m.Coord()
	pre := st.pre
	a := st.Axis
	k := pre.mshape[a]
	me := coord[a]
	ls := x.shape
	nd := len(ls)
	var c comm.Communicator
	if st.Collective != 0 {
		var err error
		if c, err = m.Comm(ctx, st.AxisName); err != nil {
			return x, err
		}
	}
	switch st.Kind {
	case StepAllGather:
		d := st.Dim
		par := parentLen(shape, pre, d, coord)
		_, maxp := chunk(par, k, 0) // ceil(par/k)
		rest := restOf(ls, d)
		// price checked k·maxp·rest elements (and their bytes) when planning.
		blk := maxp * rest
		send := x.data
		if len(send) != blk {
			send = buf.temp(blk) // the padding past x is never read back
			copy(send, x.data)
		}
		out := block[T]{shape: with(ls, d, par)}
		direct := blk == 0 || (d == firstNonUnit(out.shape) && par == k*maxp)
		var recv []T
		if direct {
			recv = buf.out(k * blk)
		} else {
			recv = buf.temp(k * blk)
		}
		if err := comm.AllGather(ctx, c, comm.Host(send), comm.Host(recv)); err != nil {
			return x, err
		}
		if direct {
			out.data = recv[:prod(out.shape)]
			return out, nil
		}
		out.data = buf.out(prod(out.shape))
		for r := range k {
			off, sz := chunk(par, k, r)
			ps := with(ls, d, sz)
			kernels.CopyBox(out.data, out.shape, at(nd, d, off), recv[r*blk:], ps, make([]int, nd), ps)
		}
		return out, nil

	case StepReduceScatter:
		d := st.Dim
		par := ls[d]
		_, maxp := chunk(par, k, 0) // ceil(par/k)
		rest := restOf(ls, d)
		// price checked k·maxp·rest elements (and their bytes) when planning.
		blk := maxp * rest
		send := buf.temp(k * blk) // the padding of short chunks is never read back
		for r := range k {
			off, sz := chunk(par, k, r)
			ps := with(ls, d, sz)
			kernels.CopyBox(send[r*blk:], ps, make([]int, nd), x.data, ls, at(nd, d, off), ps)
		}
		recv := buf.out(blk)
		if err := comm.ReduceScatter(ctx, c, comm.Host(send), comm.Host(recv), st.Reduce); err != nil {
			return x, err
		}
		_, sz := chunk(par, k, me)
		out := block[T]{shape: with(ls, d, sz)}
		out.data = recv[:prod(out.shape)]
		return out, nil

	case StepAllReduce:
		out := block[T]{shape: ls, data: x.data}
		if !buf.overwritable(x.data) {
			out.data = buf.out(len(x.data))
		}
		if err := comm.AllReduce(ctx, c, comm.Host(x.data), comm.Host(out.data), st.Reduce); err != nil {
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
		for r := range k {
			_, szJ := chunk(parJ, k, r)
			sendCounts[r] = prod(with(ls, j, szJ))
			_, szI := chunk(parI, k, r)
			recvCounts[r] = prod(with(with(ls, i, szI), j, myJ))
		}
		send := buf.temp(len(x.data))
		pos := 0
		for r := range k {
			offJ, szJ := chunk(parJ, k, r)
			bs := with(ls, j, szJ)
			kernels.CopyBox(send[pos:], bs, make([]int, nd), x.data, ls, at(nd, j, offJ), bs)
			pos += sendCounts[r]
		}
		recv := buf.temp(sum(recvCounts))
		var err error
		if parI%k == 0 && parJ%k == 0 {
			err = comm.AllToAll(ctx, c, comm.Host(send), comm.Host(recv))
		} else {
			err = comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sendCounts, recvCounts)
		}
		if err != nil {
			return x, err
		}
		out := block[T]{shape: with(with(ls, i, parI), j, myJ)}
		out.data = buf.out(prod(out.shape))
		pos = 0
		for r := range k {
			offI, szI := chunk(parI, k, r)
			bs := with(with(ls, i, szI), j, myJ)
			kernels.CopyBox(out.data, out.shape, at(nd, i, offI), recv[pos:], bs, make([]int, nd), bs)
			pos += recvCounts[r]
		}
		return out, nil

	case StepChunk:
		d := st.Dim
		off, sz := chunk(ls[d], k, me)
		out := block[T]{shape: with(ls, d, sz)}
		out.data = buf.out(prod(out.shape))
		kernels.CopyBox(out.data, out.shape, make([]int, nd), x.data, ls, at(nd, d, off), out.shape)
		return out, nil

	case StepToPartial:
		if st.To.op == comm.Sum && me != 0 {
			return block[T]{shape: ls, data: buf.zeroOut(len(x.data))}, nil
		}
		if buf.last && !(buf.reuse && sameStart(x.data, buf.orig)) { // x may be a temporary of an earlier step
			out := buf.out(len(x.data))
			copy(out, x.data)
			return block[T]{shape: ls, data: out}, nil
		}
		return x, nil

	case StepShardToPartial:
		d := st.Dim
		par := parentLen(shape, pre, d, coord)
		off, _ := chunk(par, k, me)
		out := block[T]{shape: with(ls, d, par)}
		out.data = buf.zeroOut(prod(out.shape))
		kernels.CopyBox(out.data, out.shape, at(nd, d, off), x.data, ls, make([]int, nd), ls)
		return out, nil
	}
	return x, fmt.Errorf("unknown step kind %v", st.Kind)
}

// firstNonUnit returns the first dim whose size is not 1, or 0.
func firstNonUnit(shape []int) int {
	for i, v := range shape {
		if v != 1 {
			return i
		}
	}
	return 0
}

func sum(v []int) int {
	n := 0
	for _, x := range v {
		n += x
	}
	return n
}
