package cp

import (
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
)

type float interface{ float32 | float64 }

// group is the ranks one method's transfers run over: a ring (or the
// all-gather's members) of n ranks, this rank at me, pos[i] the global
// positions of member i's rows, batch independent heads of dh and dv
// columns per row. maxRows pads every transfer alike on every member.
type group struct {
	c             comm.Communicator
	n, me         int
	pos           [][]int
	batch, dh, dv int
	maxRows       int
	scale         float64
	timeout       time.Duration
	stats         *Stats
}

func newGroup(c comm.Communicator, pos [][]int, me, batch, dh, dv int) group {
	g := group{c: c, n: len(pos), me: me, pos: pos, batch: batch, dh: dh, dv: dv}
	for _, p := range pos {
		g.maxRows = max(g.maxRows, len(p))
	}
	return g
}

// slot is the length of one packed K/V block: K [batch, maxRows, dh] then
// V [batch, maxRows, dv]; a member with t rows fills the first batch·t·dh
// and batch·t·dv values of each.
func (g group) slot() int { return g.batch * g.maxRows * (g.dh + g.dv) }

// kv returns the K and V blocks of member src in the packed slot buf.
func (g group) kv(buf comm.Buffer, src int) (k, v comm.Buffer) {
	t := len(g.pos[src])
	ko := g.batch * g.maxRows * g.dh
	return buf.Slice(0, g.batch*t*g.dh), buf.Slice(ko, ko+g.batch*t*g.dv)
}

// slotOf is slot i of a buffer of n slots.
func (g group) slotOf(buf comm.Buffer, i int) comm.Buffer {
	return buf.Slice(i*g.slot(), (i+1)*g.slot())
}

// pack copies k and v (this rank's rows) into a packed slot.
func (g group) pack(o ops, buf, k, v comm.Buffer) error {
	bk, bv := g.kv(buf, g.me)
	if err := o.copy(bk, k); err != nil {
		return err
	}
	return o.copy(bv, v)
}

// shape is the block shape of this rank's rows against member src's.
func (g group) shape(src int) kernels.BlockAttnShape {
	return kernels.BlockAttnShape{Batch: g.batch, TQ: len(g.pos[g.me]), TK: len(g.pos[src]), DH: g.dh, DV: g.dv,
		QPos: g.pos[g.me], KPos: g.pos[src], Scale: g.scale, Causal: true}
}

// sees reports whether some row of this rank sees some row of member src
// (a block wholly above the diagonal is skipped: its LSE is −Inf).
func (g group) sees(src int) bool {
	q, k := g.pos[g.me], g.pos[src]
	return len(q) > 0 && len(k) > 0 && slices.Min(k) <= slices.Max(q)
}

// rotate starts sending send to the next member of the ring and receiving
// recv from the previous one, once the kernels queued on the blocks are
// done.
func (g group) rotate(ctx context.Context, o ops, send, recv comm.Buffer, tag int) ([]comm.Work, error) {
	if err := o.sync(); err != nil {
		return nil, err
	}
	next, prev := (g.me+1)%g.n, (g.me-1+g.n)%g.n
	ws, err := comm.SendAsync(ctx, g.c, send, next, tag)
	if err != nil {
		return nil, fmt.Errorf("ring transfer %d: send to %d: %w", tag, next, err)
	}
	wr, err := comm.RecvAsync(ctx, g.c, recv, prev, tag)
	if err != nil {
		return nil, fmt.Errorf("ring transfer %d: receive from %d: %w", tag, prev, err)
	}
	return []comm.Work{ws, wr}, nil
}

// start allocates the forward's output and LSE (−Inf: nothing seen yet)
// and the partials of one block.
func (g group) start(o ops) (out, lse, o2, l2 comm.Buffer, err error) {
	tq := len(g.pos[g.me])
	bufs := make([]comm.Buffer, 4)
	for i, n := range []int{g.batch * tq * g.dv, g.batch * tq, g.batch * tq * g.dv, g.batch * tq} {
		if bufs[i], err = o.alloc(n); err != nil {
			return nil, nil, nil, nil, err
		}
	}
	return bufs[0], bufs[1], bufs[2], bufs[3], o.fill(bufs[1], math.Inf(-1))
}

// attend merges this rank's attention to member src's K/V block (in the
// packed slot buf) into (out, lse).
func (g group) attend(o ops, q, buf comm.Buffer, src int, out, lse, o2, l2 comm.Buffer) error {
	if !g.sees(src) {
		return nil
	}
	defer g.computed(time.Now())
	bk, bv := g.kv(buf, src)
	if err := o.forward(o2, l2, q, bk, bv, g.shape(src)); err != nil {
		return err
	}
	return o.merge(out, lse, o2, l2, g.dv)
}

// computed adds the time since start to the stats' compute.
func (g group) computed(start time.Time) {
	if g.stats != nil {
		g.stats.Compute += time.Since(start)
		g.stats.Blocks++
	}
}

// wait waits for a ring step's transfers, adding to the stats the time
// from their start to their completion and the part of it this rank
// waited for after its block's compute.
func (g group) wait(ctx context.Context, ws []comm.Work, start time.Time) error {
	if g.stats == nil || len(ws) == 0 {
		return comm.WaitAll(ctx, ws...)
	}
	done := make(chan time.Time, 1) // buffered: an early error return leaks nothing
	go func() {
		for _, w := range ws {
			<-w.Done()
		}
		done <- time.Now()
	}()
	t0 := time.Now()
	if err := comm.WaitAll(ctx, ws...); err != nil {
		return err
	}
	g.stats.Exposed += time.Since(t0)
	g.stats.Transfer += (<-done).Sub(start)
	return nil
}

// ringForward is ring attention: at step s this rank holds the K/V block
// of member me−s, starts passing it on and receiving the next, attends
// its Q rows to the block it holds and merges by log-sum-exp.
func ringForward(ctx context.Context, o ops, g group, q, k, v comm.Buffer) (out, lse comm.Buffer, err error) {
	out, lse, o2, l2, err := g.start(o)
	if err != nil {
		return nil, nil, err
	}
	cur, err := o.alloc(g.slot())
	if err != nil {
		return nil, nil, err
	}
	nxt, err := o.alloc(g.slot())
	if err != nil {
		return nil, nil, err
	}
	if err := g.pack(o, cur, k, v); err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	for s := range g.n {
		src := (g.me - s + g.n) % g.n
		var ws []comm.Work
		t0 := time.Now()
		if s < g.n-1 {
			if ws, err = g.rotate(ctx, o, cur, nxt, s); err != nil {
				return nil, nil, err
			}
		}
		if err := g.attend(o, q, cur, src, out, lse, o2, l2); err != nil {
			return nil, nil, fmt.Errorf("ring step %d: %w", s, err)
		}
		if err := g.wait(ctx, ws, t0); err != nil {
			return nil, nil, fmt.Errorf("ring step %d: %w", s, err)
		}
		cur, nxt = nxt, cur
	}
	return out, lse, nil
}

// backStart allocates dq and computes D = rowsum(dO∘O).
func (g group) backStart(o ops, out, dout comm.Buffer) (dq, delta comm.Buffer, err error) {
	tq := len(g.pos[g.me])
	if delta, err = o.alloc(g.batch * tq); err != nil {
		return nil, nil, err
	}
	if err := o.rowDots(delta, dout, out, g.dv); err != nil {
		return nil, nil, err
	}
	dq, err = o.alloc(g.batch * tq * g.dh)
	return dq, delta, err
}

// ringBackward is the ring's backward: Q, dO, the LSE and D stay; the K/V
// blocks travel as in the forward, and the gradients dK, dV of each block
// travel with it, each rank adding its block's share, until after n steps
// they reach the block's owner. Each step uses the K/V block it received
// for that step.
func ringBackward(ctx context.Context, o ops, g group, q, k, v, out, lse, dout comm.Buffer) (dq, dk, dv comm.Buffer, err error) {
	dq, delta, err := g.backStart(o, out, dout)
	if err != nil {
		return nil, nil, nil, err
	}
	b := make([]comm.Buffer, 4) // cur, nxt, dcur, dnxt
	for i := range b {
		if b[i], err = o.alloc(g.slot()); err != nil {
			return nil, nil, nil, err
		}
	}
	cur, nxt, dcur, dnxt := b[0], b[1], b[2], b[3]
	if err := g.pack(o, cur, k, v); err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	for s := range g.n {
		src := (g.me - s + g.n) % g.n
		var ws []comm.Work
		if s < g.n-1 {
			if ws, err = g.rotate(ctx, o, cur, nxt, 2*s); err != nil {
				return nil, nil, nil, err
			}
		}
		if g.sees(src) {
			t := time.Now()
			bk, bv := g.kv(cur, src)
			gk, gv := g.kv(dcur, src)
			if err := o.backward(dq, gk, gv, dout, q, bk, bv, lse, delta, g.shape(src)); err != nil {
				return nil, nil, nil, fmt.Errorf("ring backward step %d: %w", s, err)
			}
			g.computed(t)
		}
		if g.n > 1 {
			wd, err := g.rotate(ctx, o, dcur, dnxt, 2*s+1)
			if err != nil {
				return nil, nil, nil, err
			}
			ws = append(ws, wd...)
		}
		if err := comm.WaitAll(ctx, ws...); err != nil {
			return nil, nil, nil, fmt.Errorf("ring backward step %d: %w", s, err)
		}
		if g.n > 1 {
			cur, nxt = nxt, cur
			dcur, dnxt = dnxt, dcur
		}
	}
	gk, gv := g.kv(dcur, g.me)
	return dq, gk, gv, nil
}

// gatherForward gathers every member's K/V block once and attends this
// rank's Q rows to each, merging by log-sum-exp. It returns the gathered
// blocks for the backward.
func gatherForward(ctx context.Context, o ops, g group, q, k, v comm.Buffer) (out, lse, all comm.Buffer, err error) {
	out, lse, o2, l2, err := g.start(o)
	if err != nil {
		return nil, nil, nil, err
	}
	mine, err := o.alloc(g.slot())
	if err != nil {
		return nil, nil, nil, err
	}
	if all, err = o.alloc(g.n * g.slot()); err != nil {
		return nil, nil, nil, err
	}
	if err := g.pack(o, mine, k, v); err != nil {
		return nil, nil, nil, err
	}
	if err := o.sync(); err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	if err := comm.AllGather(ctx, g.c, mine, all); err != nil {
		return nil, nil, nil, fmt.Errorf("all-gather of K and V: %w", err)
	}
	for src := range g.n {
		if err := g.attend(o, q, g.slotOf(all, src), src, out, lse, o2, l2); err != nil {
			return nil, nil, nil, err
		}
	}
	return out, lse, all, nil
}

// gatherBackward computes every block's gradients against the gathered
// K/V and reduce-scatters dK and dV to their owners.
func gatherBackward(ctx context.Context, o ops, g group, q, all, out, lse, dout comm.Buffer) (dq, dk, dv comm.Buffer, err error) {
	dq, delta, err := g.backStart(o, out, dout)
	if err != nil {
		return nil, nil, nil, err
	}
	dall, err := o.alloc(all.Len())
	if err != nil {
		return nil, nil, nil, err
	}
	for src := range g.n {
		if !g.sees(src) {
			continue
		}
		t := time.Now()
		bk, bv := g.kv(g.slotOf(all, src), src)
		gk, gv := g.kv(g.slotOf(dall, src), src)
		if err := o.backward(dq, gk, gv, dout, q, bk, bv, lse, delta, g.shape(src)); err != nil {
			return nil, nil, nil, err
		}
		g.computed(t)
	}
	mine, err := o.alloc(g.slot())
	if err != nil {
		return nil, nil, nil, err
	}
	if err := o.sync(); err != nil {
		return nil, nil, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	if err := comm.ReduceScatter(ctx, g.c, dall, mine, comm.Sum); err != nil {
		return nil, nil, nil, fmt.Errorf("reduce-scatter of dK and dV: %w", err)
	}
	gk, gv := g.kv(mine, g.me)
	return dq, gk, gv, nil
}

// heads is an all-to-all between sequence-sharded and head-sharded blocks
// over a group of n members: member i holds rows[i] rows of the sequence
// for all heads, or all the group's rows (in member order) for heads
// [me·heads/n, (me+1)·heads/n).
type heads struct {
	c             comm.Communicator
	n, me         int
	rows          []int
	lead, h, maxR int
	timeout       time.Duration
}

func newHeads(c comm.Communicator, rows []int, me, lead, h int, timeout time.Duration) heads {
	return heads{c: c, n: len(rows), me: me, rows: rows, lead: lead, h: h, maxR: slices.Max(rows), timeout: timeout}
}

// total is the group's rows.
func (x heads) total() int {
	t := 0
	for _, r := range x.rows {
		t += r
	}
	return t
}

// exchange runs the all-to-all of send into recv once the kernels are
// done.
func (x heads) exchange(ctx context.Context, o ops, send, recv comm.Buffer, what string) error {
	if err := o.sync(); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, x.timeout)
	defer cancel()
	if err := comm.AllToAll(ctx, x.c, send, recv); err != nil {
		return fmt.Errorf("all-to-all %s heads: %w", what, err)
	}
	return nil
}

// toHeads maps this rank's [lead, h, rows[me], d] block to
// [lead, h/n, total, d].
func (x heads) toHeads(ctx context.Context, o ops, in comm.Buffer, d int) (comm.Buffer, error) {
	if x.n == 1 {
		return in, nil
	}
	hn, t := x.h/x.n, x.rows[x.me]
	blk := x.lead * hn * x.maxR * d
	send, err := o.alloc(x.n * blk)
	if err != nil {
		return nil, err
	}
	recv, err := o.alloc(x.n * blk)
	if err != nil {
		return nil, err
	}
	for j := range x.n {
		for l := range x.lead {
			for h := range hn {
				src := ((l*x.h + j*hn + h) * t) * d
				dst := j*blk + ((l*hn+h)*x.maxR)*d
				if err := o.copy(send.Slice(dst, dst+t*d), in.Slice(src, src+t*d)); err != nil {
					return nil, err
				}
			}
		}
	}
	if err := x.exchange(ctx, o, send, recv, "to"); err != nil {
		return nil, err
	}
	tot := x.total()
	out, err := o.alloc(x.lead * hn * tot * d)
	if err != nil {
		return nil, err
	}
	off := 0
	for i, ti := range x.rows {
		for l := range x.lead {
			for h := range hn {
				src := i*blk + ((l*hn+h)*x.maxR)*d
				dst := ((l*hn+h)*tot + off) * d
				if err := o.copy(out.Slice(dst, dst+ti*d), recv.Slice(src, src+ti*d)); err != nil {
					return nil, err
				}
			}
		}
		off += ti
	}
	return out, nil
}

// fromHeads is toHeads' inverse: [lead, h/n, total, d] to this rank's
// [lead, h, rows[me], d].
func (x heads) fromHeads(ctx context.Context, o ops, in comm.Buffer, d int) (comm.Buffer, error) {
	if x.n == 1 {
		return in, nil
	}
	hn, t, tot := x.h/x.n, x.rows[x.me], x.total()
	blk := x.lead * hn * x.maxR * d
	send, err := o.alloc(x.n * blk)
	if err != nil {
		return nil, err
	}
	recv, err := o.alloc(x.n * blk)
	if err != nil {
		return nil, err
	}
	off := 0
	for i, ti := range x.rows {
		for l := range x.lead {
			for h := range hn {
				src := ((l*hn+h)*tot + off) * d
				dst := i*blk + ((l*hn+h)*x.maxR)*d
				if err := o.copy(send.Slice(dst, dst+ti*d), in.Slice(src, src+ti*d)); err != nil {
					return nil, err
				}
			}
		}
		off += ti
	}
	if err := x.exchange(ctx, o, send, recv, "from"); err != nil {
		return nil, err
	}
	out, err := o.alloc(x.lead * x.h * t * d)
	if err != nil {
		return nil, err
	}
	for j := range x.n {
		for l := range x.lead {
			for h := range hn {
				src := j*blk + ((l*hn+h)*x.maxR)*d
				dst := ((l*x.h + j*hn + h) * t) * d
				if err := o.copy(out.Slice(dst, dst+t*d), recv.Slice(src, src+t*d)); err != nil {
					return nil, err
				}
			}
		}
	}
	return out, nil
}

// state is one recorded call: the layout and what the forward keeps for
// the backward.
type state struct {
	l       *layout
	timeout time.Duration
	scale   float64
	o       ops
	stats   *Stats

	g                group // the attention group
	hx               heads // the Ulysses all-to-all (n = 1: none)
	q, k, v, out, ls comm.Buffer
	all              comm.Buffer // AllGather: the gathered K/V
}

// setup builds the attention group and the all-to-all of the method.
func (s *state) setup() {
	l := s.l
	switch l.method {
	case Ulysses:
		rows := make([]int, l.n)
		var all []int
		for i := range l.n {
			rows[i] = len(l.pos[i][0])
			all = append(all, l.pos[i][0]...)
		}
		s.hx = newHeads(l.c, rows, l.me, l.lead, l.heads, s.timeout)
		s.g = newGroup(nil, [][]int{all}, 0, l.lead*l.heads/l.n, l.dh, l.dv)
	case Hybrid:
		rows := make([]int, l.nInner)
		for j := range l.nInner {
			rows[j] = len(l.pos[l.me][j])
		}
		s.hx = newHeads(l.ci, rows, l.mi, l.lead, l.heads, s.timeout)
		pos := make([][]int, l.n)
		for i := range l.n {
			pos[i] = l.rows(i)
		}
		s.g = newGroup(l.c, pos, l.me, l.lead*l.heads/l.nInner, l.dh, l.dv)
	default:
		pos := make([][]int, l.n)
		for i := range l.n {
			pos[i] = l.pos[i][0]
		}
		s.hx = heads{n: 1}
		s.g = newGroup(l.c, pos, l.me, l.batch, l.dh, l.dv)
	}
	s.g.scale, s.g.timeout, s.g.stats = s.scale, s.timeout, s.stats
}

// forward runs the method's forward on this rank's blocks and returns the
// result in a buffer of the op's own.
func (s *state) forward(ctx context.Context, q, k, v comm.Buffer) (comm.Buffer, error) {
	s.setup()
	o := s.o
	var err error
	if s.q, err = s.hx.toHeads(ctx, o, q, s.l.dh); err != nil {
		return nil, err
	}
	if s.k, err = s.hx.toHeads(ctx, o, k, s.l.dh); err != nil {
		return nil, err
	}
	if s.v, err = s.hx.toHeads(ctx, o, v, s.l.dv); err != nil {
		return nil, err
	}
	if s.l.method == AllGather {
		s.out, s.ls, s.all, err = gatherForward(ctx, o, s.g, s.q, s.k, s.v)
	} else {
		s.out, s.ls, err = ringForward(ctx, o, s.g, s.q, s.k, s.v)
	}
	if err != nil {
		return nil, err
	}
	if s.stats != nil {
		n := s.out.Len() + s.ls.Len()
		if s.all != nil {
			n += s.all.Len()
		}
		if s.hx.n > 1 {
			n += s.q.Len() + s.k.Len() + s.v.Len()
		}
		s.stats.Kept += int64(n) * int64(s.l.dtype.Size())
	}
	y, err := s.hx.fromHeads(ctx, o, s.out, s.l.dv)
	if err != nil {
		return nil, err
	}
	res, err := o.result(y.Len())
	if err != nil {
		return nil, err
	}
	return res, o.copy(res, y)
}

// backward maps the gradient of the result (laid out like it) to dq, dk
// and dv, laid out like q, k and v.
func (s *state) backward(ctx context.Context, dout comm.Buffer) (dq, dk, dv comm.Buffer, err error) {
	if s.out == nil {
		return nil, nil, nil, fmt.Errorf("backward before forward")
	}
	o := s.o
	gh, err := s.hx.toHeads(ctx, o, dout, s.l.dv)
	if err != nil {
		return nil, nil, nil, err
	}
	if s.l.method == AllGather {
		dq, dk, dv, err = gatherBackward(ctx, o, s.g, s.q, s.all, s.out, s.ls, gh)
	} else {
		dq, dk, dv, err = ringBackward(ctx, o, s.g, s.q, s.k, s.v, s.out, s.ls, gh)
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if dq, err = s.hx.fromHeads(ctx, o, dq, s.l.dh); err != nil {
		return nil, nil, nil, err
	}
	if dk, err = s.hx.fromHeads(ctx, o, dk, s.l.dh); err != nil {
		return nil, nil, nil, err
	}
	if dv, err = s.hx.fromHeads(ctx, o, dv, s.l.dv); err != nil {
		return nil, nil, nil, err
	}
	// Each gradient in memory of its own (the ring's are views of a
	// travelling buffer), which autograd may free once consumed.
	out := []comm.Buffer{dq, dk, dv}
	for i, b := range out {
		if out[i], err = o.alloc(b.Len()); err != nil {
			return nil, nil, nil, err
		}
		if err := o.copy(out[i], b); err != nil {
			return nil, nil, nil, err
		}
	}
	return out[0], out[1], out[2], o.sync()
}
