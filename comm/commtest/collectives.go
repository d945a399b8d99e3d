package commtest

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/b7ea7098/loom/comm"
)

// inputs generates the ranks' inputs of a case lazily, once per process:
// ranks of one process share them, and a rank of a multi-process run
// generates only what it needs.
type inputs struct {
	dt     comm.DType
	seed   uint64
	kind   ValueKind
	length func(r int) int
	once   []sync.Once
	bufs   []*comm.HostBuffer
}

func newInputs(dt comm.DType, seed uint64, kind ValueKind, p int, length func(r int) int) *inputs {
	return &inputs{dt: dt, seed: seed, kind: kind, length: length, once: make([]sync.Once, p), bufs: make([]*comm.HostBuffer, p)}
}

// fixed is a length function for inputs of n elements on every rank.
func fixed(n int) func(int) int { return func(int) int { return n } }

// get returns rank r's input. Callers must not modify it.
func (in *inputs) get(r int) *comm.HostBuffer {
	in.once[r].Do(func() { in.bufs[r] = Fill(in.dt, in.length(r), in.seed, r, in.kind) })
	return in.bufs[r]
}

// lazy computes a value once per process, on first use.
type lazy[T any] struct {
	once sync.Once
	v    T
}

func (l *lazy[T]) get(f func() T) T {
	l.once.Do(func() { l.v = f() })
	return l.v
}

// sharedInputs returns the inputs of k's data group, made by newInputs on
// first use.
func sharedInputs(k *kase, kind ValueKind, length func(r int) int) *inputs {
	return shared(k, "in", func() *inputs { return newInputs(k.dt, k.seed, kind, k.p, length) })
}

// sharedWant returns the lazily computed reference of k's data group.
func sharedWant(k *kase) *lazy[*reduction] {
	return shared(k, "want", func() *lazy[*reduction] { return new(lazy[*reduction]) })
}

// kindFor picks input values that keep a reduction in range.
func kindFor(op comm.ReduceOp) ValueKind {
	if op == comm.Prod {
		return NearOne
	}
	return Mixed
}

// issue runs call to completion: through the typed helper when no
// algorithm is forced (so the helpers are covered too), else through Do.
func issue(ctx context.Context, c comm.Communicator, call comm.Call) error {
	if call.Algorithm != comm.Auto {
		return c.Do(ctx, call)
	}
	switch call.Op {
	case comm.OpAllReduce:
		return comm.AllReduce(ctx, c, call.Send, call.Recv, call.Reduce)
	case comm.OpBroadcast:
		return comm.Broadcast(ctx, c, call.Recv, call.Root)
	case comm.OpReduce:
		return comm.Reduce(ctx, c, call.Send, call.Recv, call.Reduce, call.Root)
	case comm.OpAllGather:
		return comm.AllGather(ctx, c, call.Send, call.Recv)
	case comm.OpReduceScatter:
		return comm.ReduceScatter(ctx, c, call.Send, call.Recv, call.Reduce)
	case comm.OpGather:
		return comm.Gather(ctx, c, call.Send, call.Recv, call.Root)
	case comm.OpScatter:
		return comm.Scatter(ctx, c, call.Send, call.Recv, call.Root)
	case comm.OpAllToAll:
		return comm.AllToAll(ctx, c, call.Send, call.Recv)
	case comm.OpAllToAllV:
		return comm.AllToAllV(ctx, c, call.Send, call.Recv, call.SendCounts, call.RecvCounts)
	case comm.OpSend:
		return comm.Send(ctx, c, call.Send, call.Peer, call.Tag)
	case comm.OpRecv:
		return comm.Recv(ctx, c, call.Recv, call.Peer, call.Tag)
	case comm.OpBarrier:
		return comm.Barrier(ctx, c)
	}
	return c.Do(ctx, call)
}

// failed aborts the communicators, so that the other ranks fail at once
// instead of waiting for this one, and returns err with the rank and step.
func failed(c comm.Communicator, step string, err error, also ...comm.Communicator) error {
	err = fmt.Errorf("rank %d: %s: %w", c.Rank(), step, err)
	for _, o := range also {
		if o != nil {
			o.Abort(err)
		}
	}
	c.Abort(err)
	return err
}

// host returns b as a Buffer, or an untyped nil when b is nil: a nil
// *HostBuffer in an interface would not be nil.
func host(b *comm.HostBuffer) comm.Buffer {
	if b == nil {
		return nil
	}
	return b
}

func allReduceCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, kindFor(k.rop), fixed(k.n))
	want := sharedWant(k)
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		send, recv := in.get(r), garbage(k.dt, k.n)
		call := comm.Call{Op: comm.OpAllReduce, Send: send, Recv: recv, Reduce: k.rop, Algorithm: k.algo}
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "out-of-place", err)
		}
		buf := clone(send)
		call.Send, call.Recv = buf, buf
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "in-place", err)
		}
		w := want.get(func() *reduction { return reduceRange(k.dt, k.rop, k.p, in.get, 0, k.n) })
		out, inPlace := newChecker("rank %d: out-of-place", r), newChecker("rank %d: in-place", r)
		out.reduced(recv, 0, w, 0, k.n)
		inPlace.reduced(buf, 0, w, 0, k.n)
		return errors.Join(out.err(k.n), inPlace.err(k.n))
	}, nil
}

func broadcastCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, Mixed, fixed(k.n))
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		var errs []error
		for _, root := range k.roots {
			buf := garbage(k.dt, k.n)
			if r == root {
				buf = clone(in.get(root))
			}
			call := comm.Call{Op: comm.OpBroadcast, Send: buf, Recv: buf, Root: root, Algorithm: k.algo}
			if err := issue(ctx, c, call); err != nil {
				return failed(c, fmt.Sprintf("root %d", root), err)
			}
			ck := newChecker("rank %d: root %d", r, root)
			ck.copied(buf, 0, in.get(root), 0, k.n, fmt.Sprintf("root %d", root))
			errs = append(errs, ck.err(k.n))
		}
		return errors.Join(errs...)
	}, nil
}

func reduceCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, kindFor(k.rop), fixed(k.n))
	want := sharedWant(k)
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		var errs []error
		for _, root := range k.roots {
			var recv *comm.HostBuffer
			if r == root {
				recv = garbage(k.dt, k.n)
			}
			call := comm.Call{Op: comm.OpReduce, Send: in.get(r), Recv: host(recv), Reduce: k.rop, Root: root, Algorithm: k.algo}
			if err := issue(ctx, c, call); err != nil {
				return failed(c, fmt.Sprintf("root %d", root), err)
			}
			if r == root {
				w := want.get(func() *reduction { return reduceRange(k.dt, k.rop, k.p, in.get, 0, k.n) })
				ck := newChecker("rank %d: root %d", r, root)
				ck.reduced(recv, 0, w, 0, k.n)
				errs = append(errs, ck.err(k.n))
			}
		}
		return errors.Join(errs...)
	}, nil
}

func allGatherCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, Mixed, fixed(k.n))
	return func(ctx context.Context, c comm.Communicator) error {
		r, n, p := c.Rank(), k.n, k.p
		recv := garbage(k.dt, p*n)
		call := comm.Call{Op: comm.OpAllGather, Send: in.get(r), Recv: recv, Algorithm: k.algo}
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "out-of-place", err)
		}
		inPlace := garbage(k.dt, p*n)
		copy(inPlace.SliceHost(r*n, (r+1)*n).Bytes(), in.get(r).Bytes())
		call.Send, call.Recv = inPlace.Slice(r*n, (r+1)*n), inPlace
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "in-place", err)
		}
		var errs []error
		for _, v := range []struct {
			name string
			buf  *comm.HostBuffer
		}{{"out-of-place", recv}, {"in-place", inPlace}} {
			ck := newChecker("rank %d: %s", r, v.name)
			for j := range p {
				ck.copied(v.buf, j*n, in.get(j), 0, n, fmt.Sprintf("rank %d's", j))
			}
			errs = append(errs, ck.err(p*n))
		}
		return errors.Join(errs...)
	}, nil
}

func reduceScatterCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, kindFor(k.rop), fixed(k.p*k.n))
	wants := shared(k, "want", func() []lazy[*reduction] { return make([]lazy[*reduction], k.p) })
	return func(ctx context.Context, c comm.Communicator) error {
		r, n := c.Rank(), k.n
		send, recv := in.get(r), garbage(k.dt, n)
		call := comm.Call{Op: comm.OpReduceScatter, Send: send, Recv: recv, Reduce: k.rop, Algorithm: k.algo}
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "out-of-place", err)
		}
		buf := clone(send)
		inPlace := buf.SliceHost(r*n, (r+1)*n)
		call.Send, call.Recv = buf, inPlace
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "in-place", err)
		}
		// Each rank needs only its own block of the reference.
		w := wants[r].get(func() *reduction { return reduceRange(k.dt, k.rop, k.p, in.get, r*n, (r+1)*n) })
		out, ip := newChecker("rank %d: out-of-place", r), newChecker("rank %d: in-place", r)
		out.reduced(recv, 0, w, 0, n)
		ip.reduced(inPlace, 0, w, 0, n)
		return errors.Join(out.err(n), ip.err(n))
	}, nil
}

func gatherCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, Mixed, fixed(k.n))
	return func(ctx context.Context, c comm.Communicator) error {
		r, n, p := c.Rank(), k.n, k.p
		var errs []error
		for _, root := range k.roots {
			var recv *comm.HostBuffer
			if r == root {
				recv = garbage(k.dt, p*n)
			}
			call := comm.Call{Op: comm.OpGather, Send: in.get(r), Recv: host(recv), Root: root, Algorithm: k.algo}
			if err := issue(ctx, c, call); err != nil {
				return failed(c, fmt.Sprintf("root %d", root), err)
			}
			if r == root {
				ck := newChecker("rank %d: root %d", r, root)
				for j := range p {
					ck.copied(recv, j*n, in.get(j), 0, n, fmt.Sprintf("rank %d's", j))
				}
				errs = append(errs, ck.err(p*n))
			}
		}
		return errors.Join(errs...)
	}, nil
}

func scatterCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, Mixed, fixed(k.p*k.n))
	return func(ctx context.Context, c comm.Communicator) error {
		r, n := c.Rank(), k.n
		var errs []error
		for _, root := range k.roots {
			var send *comm.HostBuffer
			if r == root {
				send = in.get(root)
			}
			recv := garbage(k.dt, n)
			call := comm.Call{Op: comm.OpScatter, Send: host(send), Recv: recv, Root: root, Algorithm: k.algo}
			if err := issue(ctx, c, call); err != nil {
				return failed(c, fmt.Sprintf("root %d", root), err)
			}
			ck := newChecker("rank %d: root %d", r, root)
			ck.copied(recv, 0, in.get(root), r*n, n, fmt.Sprintf("root %d's", root))
			errs = append(errs, ck.err(n))
		}
		return errors.Join(errs...)
	}, nil
}

func allToAllCase(k *kase) (rankFunc, func(int) error) {
	in := sharedInputs(k, Mixed, fixed(k.p*k.n))
	return func(ctx context.Context, c comm.Communicator) error {
		r, n, p := c.Rank(), k.n, k.p
		recv := garbage(k.dt, p*n)
		call := comm.Call{Op: comm.OpAllToAll, Send: in.get(r), Recv: recv, Algorithm: k.algo}
		if err := issue(ctx, c, call); err != nil {
			return failed(c, "alltoall", err)
		}
		ck := newChecker("rank %d", r)
		for j := range p {
			ck.copied(recv, j*n, in.get(j), r*n, n, fmt.Sprintf("rank %d's", j))
		}
		return ck.err(p * n)
	}, nil
}

// countPattern gives AllToAllV's counts: element [i][j] is what rank i
// sends to rank j.
type countPattern struct {
	name   string
	counts func(p, n, i, j int) int
}

// countPatterns are AllToAllV's count matrices for per-peer size n.
var countPatterns = []countPattern{
	// Every block n: AllToAll through the ragged path.
	{"uniform", func(p, n, i, j int) int { return n }},
	// Uneven blocks of 0, n/2, n and 3n/2 elements, zeros included.
	{"skewed", func(p, n, i, j int) int { return (i*7 + j*3) % 4 * n / 2 }},
	// Rank p/2 receives nothing and rank p-1 sends nothing; the other
	// blocks are n to n+2 elements, so even n = 0 moves data.
	{"empty_ranks", func(p, n, i, j int) int {
		if j == p/2 || i == p-1 {
			return 0
		}
		return n + (i+j)%3
	}},
}

// allToAllVSlack is the number of spare elements at the end of AllToAllV's
// buffers: the counts need not fill them, and the backend must leave the
// spare receive elements alone.
const allToAllVSlack = 3

// allToAllVSetup is one count pattern of an AllToAllV case.
type allToAllVSetup struct {
	name   string
	counts [][]int // counts[i][j]: from i to j
	displ  [][]int // displ[i][j]: offset of i's block for j in i's send buffer
	in     *inputs
}

// allToAllVSetups builds the count matrices and inputs of every pattern.
func allToAllVSetups(k *kase) []allToAllVSetup {
	p := k.p
	setups := make([]allToAllVSetup, len(countPatterns))
	for pi, cp := range countPatterns {
		s := allToAllVSetup{name: cp.name, counts: make([][]int, p), displ: make([][]int, p)}
		for i := range p {
			s.counts[i], s.displ[i] = make([]int, p), make([]int, p)
			off := 0
			for j := range p {
				s.counts[i][j] = cp.counts(p, k.n, i, j)
				s.displ[i][j] = off
				off += s.counts[i][j]
			}
		}
		counts := s.counts
		s.in = newInputs(k.dt, k.seed+uint64(pi), Mixed, p, func(r int) int {
			total := allToAllVSlack
			for _, c := range counts[r] {
				total += c
			}
			return total
		})
		setups[pi] = s
	}
	return setups
}

func allToAllVCase(k *kase) (rankFunc, func(int) error) {
	p := k.p
	setups := shared(k, "setups", func() []allToAllVSetup { return allToAllVSetups(k) })
	return func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		var errs []error
		for _, s := range setups {
			sendCounts := append([]int(nil), s.counts[r]...)
			recvCounts := make([]int, p)
			total := 0
			for j := range p {
				recvCounts[j] = s.counts[j][r]
				total += recvCounts[j]
			}
			recv := garbage(k.dt, total+allToAllVSlack)
			call := comm.Call{Op: comm.OpAllToAllV, Send: s.in.get(r), Recv: recv, SendCounts: sendCounts, RecvCounts: recvCounts, Algorithm: k.algo}
			if err := issue(ctx, c, call); err != nil {
				return failed(c, s.name, err)
			}
			ck := newChecker("rank %d: %s counts", r, s.name)
			off := 0
			for j := range p {
				ck.copied(recv, off, s.in.get(j), s.displ[j][r], recvCounts[j], fmt.Sprintf("rank %d's", j))
				off += recvCounts[j]
			}
			ck.untouched(recv, total, allToAllVSlack)
			errs = append(errs, ck.err(total))
		}
		return errors.Join(errs...)
	}, nil
}
