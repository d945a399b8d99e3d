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
	workers       kernels.Workers
	scale         float64
	timeout       time.Duration
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
func kv[T float](g group, buf []T, src int) (k, v []T) {
	t := len(g.pos[src])
	ko := g.batch * g.maxRows * g.dh
	return buf[:g.batch*t*g.dh], buf[ko : ko+g.batch*t*g.dv]
}

// pack copies k and v (this rank's rows) into a packed slot.
func pack[T float](g group, buf, k, v []T) {
	bk, bv := kv(g, buf, g.me)
	copy(bk, k)
	copy(bv, v)
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
// recv from the previous one.
func rotate[T float](ctx context.Context, g group, send, recv []T, tag int) ([]comm.Work, error) {
	next, prev := (g.me+1)%g.n, (g.me-1+g.n)%g.n
	ws, err := comm.SendAsync(ctx, g.c, comm.Host(send), next, tag)
	if err != nil {
		return nil, fmt.Errorf("ring step %d: send to %d: %w", tag, next, err)
	}
	wr, err := comm.RecvAsync(ctx, g.c, comm.Host(recv), prev, tag)
	if err != nil {
		return nil, fmt.Errorf("ring step %d: receive from %d: %w", tag, prev, err)
	}
	return []comm.Work{ws, wr}, nil
}

// ringForward is ring attention: at step s this rank holds the K/V block
// of member me−s, starts passing it on and receiving the next, attends
// its Q rows to the block it holds and merges by log-sum-exp.
func ringForward[T float](ctx context.Context, g group, q, k, v []T) (out, lse []T, err error) {
	tq := len(g.pos[g.me])
	out = make([]T, g.batch*tq*g.dv)
	lse = make([]T, g.batch*tq)
	kernels.Fill(lse, T(math.Inf(-1)))
	o2, l2 := make([]T, len(out)), make([]T, len(lse))
	cur, nxt := make([]T, g.slot()), make([]T, g.slot())
	pack(g, cur, k, v)
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	for s := range g.n {
		src := (g.me - s + g.n) % g.n
		var ws []comm.Work
		if s < g.n-1 {
			if ws, err = rotate(ctx, g, cur, nxt, s); err != nil {
				return nil, nil, err
			}
		}
		if g.sees(src) {
			bk, bv := kv(g, cur, src)
			if err := kernels.BlockAttentionForward(g.workers, o2, l2, q, bk, bv, g.shape(src)); err != nil {
				return nil, nil, fmt.Errorf("ring step %d: %w", s, err)
			}
			if err := kernels.MergeAttention(out, lse, o2, l2, g.dv); err != nil {
				return nil, nil, fmt.Errorf("ring step %d: %w", s, err)
			}
		}
		if err := comm.WaitAll(ctx, ws...); err != nil {
			return nil, nil, fmt.Errorf("ring step %d: %w", s, err)
		}
		cur, nxt = nxt, cur
	}
	return out, lse, nil
}

// ringBackward is the ring's backward: Q, dO, the LSE and D stay; the K/V
// blocks travel as in the forward, and the gradients dK, dV of each block
// travel with it, each rank adding its block's share, until after n steps
// they reach the block's owner. Each step uses the K/V block it received
// for that step.
func ringBackward[T float](ctx context.Context, g group, q, k, v, out, lse, dout []T) (dq, dk, dv []T, err error) {
	tq := len(g.pos[g.me])
	delta := make([]T, len(lse))
	if err := kernels.AttentionRowDots(delta, dout, out, g.dv); err != nil {
		return nil, nil, nil, err
	}
	dq = make([]T, g.batch*tq*g.dh)
	cur, nxt := make([]T, g.slot()), make([]T, g.slot())
	dcur, dnxt := make([]T, g.slot()), make([]T, g.slot())
	pack(g, cur, k, v)
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	for s := range g.n {
		src := (g.me - s + g.n) % g.n
		var ws []comm.Work
		if s < g.n-1 {
			if ws, err = rotate(ctx, g, cur, nxt, 2*s); err != nil {
				return nil, nil, nil, err
			}
		}
		if g.sees(src) {
			bk, bv := kv(g, cur, src)
			gk, gv := kv(g, dcur, src)
			if err := kernels.BlockAttentionBackward(g.workers, dq, gk, gv, dout, q, bk, bv, lse, delta, g.shape(src)); err != nil {
				return nil, nil, nil, fmt.Errorf("ring backward step %d: %w", s, err)
			}
		}
		if g.n > 1 {
			wd, err := rotate(ctx, g, dcur, dnxt, 2*s+1)
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
	gk, gv := kv(g, dcur, g.me)
	return dq, slices.Clone(gk), slices.Clone(gv), nil
}

// gatherForward gathers every member's K/V block once and attends this
// rank's Q rows to each, merging by log-sum-exp. It returns the gathered
// blocks for the backward.
func gatherForward[T float](ctx context.Context, g group, q, k, v []T) (out, lse, all []T, err error) {
	tq := len(g.pos[g.me])
	out = make([]T, g.batch*tq*g.dv)
	lse = make([]T, g.batch*tq)
	kernels.Fill(lse, T(math.Inf(-1)))
	o2, l2 := make([]T, len(out)), make([]T, len(lse))
	mine := make([]T, g.slot())
	pack(g, mine, k, v)
	all = make([]T, g.n*g.slot())
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	if err := comm.AllGather(ctx, g.c, comm.Host(mine), comm.Host(all)); err != nil {
		return nil, nil, nil, fmt.Errorf("all-gather of K and V: %w", err)
	}
	for src := range g.n {
		if !g.sees(src) {
			continue
		}
		bk, bv := kv(g, all[src*g.slot():(src+1)*g.slot()], src)
		if err := kernels.BlockAttentionForward(g.workers, o2, l2, q, bk, bv, g.shape(src)); err != nil {
			return nil, nil, nil, err
		}
		if err := kernels.MergeAttention(out, lse, o2, l2, g.dv); err != nil {
			return nil, nil, nil, err
		}
	}
	return out, lse, all, nil
}

// gatherBackward computes every block's gradients against the gathered
// K/V and reduce-scatters dK and dV to their owners.
func gatherBackward[T float](ctx context.Context, g group, q, all, out, lse, dout []T) (dq, dk, dv []T, err error) {
	tq := len(g.pos[g.me])
	delta := make([]T, len(lse))
	if err := kernels.AttentionRowDots(delta, dout, out, g.dv); err != nil {
		return nil, nil, nil, err
	}
	dq = make([]T, g.batch*tq*g.dh)
	dall := make([]T, len(all))
	for src := range g.n {
		if !g.sees(src) {
			continue
		}
		sl := all[src*g.slot() : (src+1)*g.slot()]
		bk, bv := kv(g, sl, src)
		gk, gv := kv(g, dall[src*g.slot():(src+1)*g.slot()], src)
		if err := kernels.BlockAttentionBackward(g.workers, dq, gk, gv, dout, q, bk, bv, lse, delta, g.shape(src)); err != nil {
			return nil, nil, nil, err
		}
	}
	mine := make([]T, g.slot())
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	if err := comm.ReduceScatter(ctx, g.c, comm.Host(dall), comm.Host(mine), comm.Sum); err != nil {
		return nil, nil, nil, fmt.Errorf("reduce-scatter of dK and dV: %w", err)
	}
	gk, gv := kv(g, mine, g.me)
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
	x := heads{c: c, n: len(rows), me: me, rows: rows, lead: lead, h: h, maxR: slices.Max(rows), timeout: timeout}
	return x
}

// total is the group's rows.
func (x heads) total() int {
	t := 0
	for _, r := range x.rows {
		t += r
	}
	return t
}

// toHeads maps this rank's [lead, h, rows[me], d] block to
// [lead, h/n, total, d].
func toHeads[T float](ctx context.Context, x heads, in []T, d int) ([]T, error) {
	if x.n == 1 {
		return in, nil
	}
	hn, t := x.h/x.n, x.rows[x.me]
	blk := x.lead * hn * x.maxR * d
	send, recv := make([]T, x.n*blk), make([]T, x.n*blk)
	for j := range x.n {
		for l := range x.lead {
			for h := range hn {
				src := in[((l*x.h+j*hn+h)*t)*d : ((l*x.h+j*hn+h)*t+t)*d]
				copy(send[j*blk+((l*hn+h)*x.maxR)*d:], src)
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, x.timeout)
	defer cancel()
	if err := comm.AllToAll(ctx, x.c, comm.Host(send), comm.Host(recv)); err != nil {
		return nil, fmt.Errorf("all-to-all to heads: %w", err)
	}
	tot := x.total()
	out := make([]T, x.lead*hn*tot*d)
	off := 0
	for i, ti := range x.rows {
		for l := range x.lead {
			for h := range hn {
				src := recv[i*blk+((l*hn+h)*x.maxR)*d:]
				copy(out[((l*hn+h)*tot+off)*d:((l*hn+h)*tot+off+ti)*d], src[:ti*d])
			}
		}
		off += ti
	}
	return out, nil
}

// fromHeads is toHeads' inverse: [lead, h/n, total, d] to this rank's
// [lead, h, rows[me], d].
func fromHeads[T float](ctx context.Context, x heads, in []T, d int) ([]T, error) {
	if x.n == 1 {
		return in, nil
	}
	hn, t, tot := x.h/x.n, x.rows[x.me], x.total()
	blk := x.lead * hn * x.maxR * d
	send, recv := make([]T, x.n*blk), make([]T, x.n*blk)
	off := 0
	for i, ti := range x.rows {
		for l := range x.lead {
			for h := range hn {
				copy(send[i*blk+((l*hn+h)*x.maxR)*d:], in[((l*hn+h)*tot+off)*d:((l*hn+h)*tot+off+ti)*d])
			}
		}
		off += ti
	}
	ctx, cancel := context.WithTimeout(ctx, x.timeout)
	defer cancel()
	if err := comm.AllToAll(ctx, x.c, comm.Host(send), comm.Host(recv)); err != nil {
		return nil, fmt.Errorf("all-to-all from heads: %w", err)
	}
	out := make([]T, x.lead*x.h*t*d)
	for j := range x.n {
		for l := range x.lead {
			for h := range hn {
				src := recv[j*blk+((l*hn+h)*x.maxR)*d:]
				copy(out[((l*x.h+j*hn+h)*t)*d:((l*x.h+j*hn+h)*t+t)*d], src[:t*d])
			}
		}
	}
	return out, nil
}

// state is one recorded call: the layout and what the forward keeps for
// the backward.
type state[T float] struct {
	l       *layout
	timeout time.Duration
	scale   float64
	workers kernels.Workers

	g                group // the attention group
	hx               heads // the Ulysses all-to-all (n = 1: none)
	q, k, v, out, ls []T   // in the attention group's layout
	all              []T   // AllGather: the gathered K/V
}

// setup builds the attention group and the all-to-all of the method.
func (s *state[T]) setup() {
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
	s.g.scale, s.g.timeout, s.g.workers = s.scale, s.timeout, s.workers
}

// forward runs the method's forward on this rank's blocks.
func (s *state[T]) forward(ctx context.Context, q, k, v []T) ([]T, error) {
	s.setup()
	var err error
	if s.q, err = toHeads(ctx, s.hx, q, s.l.dh); err != nil {
		return nil, err
	}
	if s.k, err = toHeads(ctx, s.hx, k, s.l.dh); err != nil {
		return nil, err
	}
	if s.v, err = toHeads(ctx, s.hx, v, s.l.dv); err != nil {
		return nil, err
	}
	if s.l.method == AllGather {
		s.out, s.ls, s.all, err = gatherForward(ctx, s.g, s.q, s.k, s.v)
	} else {
		s.out, s.ls, err = ringForward(ctx, s.g, s.q, s.k, s.v)
	}
	if err != nil {
		return nil, err
	}
	return fromHeads(ctx, s.hx, s.out, s.l.dv)
}

// backward maps the gradient of the result (laid out like it) to dq, dk
// and dv, laid out like q, k and v.
func (s *state[T]) backward(ctx context.Context, dout []T) (dq, dk, dv []T, err error) {
	if s.out == nil {
		return nil, nil, nil, fmt.Errorf("backward before forward")
	}
	gh, err := toHeads(ctx, s.hx, dout, s.l.dv)
	if err != nil {
		return nil, nil, nil, err
	}
	if s.l.method == AllGather {
		dq, dk, dv, err = gatherBackward(ctx, s.g, s.q, s.all, s.out, s.ls, gh)
	} else {
		dq, dk, dv, err = ringBackward(ctx, s.g, s.q, s.k, s.v, s.out, s.ls, gh)
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if dq, err = fromHeads(ctx, s.hx, dq, s.l.dh); err != nil {
		return nil, nil, nil, err
	}
	if dk, err = fromHeads(ctx, s.hx, dk, s.l.dh); err != nil {
		return nil, nil, nil, err
	}
	if dv, err = fromHeads(ctx, s.hx, dv, s.l.dv); err != nil {
		return nil, nil, nil, err
	}
	return dq, dk, dv, nil
}
