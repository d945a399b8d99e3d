package commtest_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
)

// fake is the simplest correct Communicator: every collective snapshots
// each rank's input, meets at a barrier, lets every rank compute its own
// output from the snapshots with the shared reduction kernels, and meets
// again. It exists to test the suite itself, independently of any real
// backend.

type fakeWorld struct {
	p        int
	mu       sync.Mutex
	arrived  int
	gen      chan struct{}
	slots    []posted
	splits   map[[2]int]*fakeWorld // by (split number, color)
	mail     map[[3]int][][]byte   // by (from, to, tag), every message sent
	tickets  map[[3]int]int        // receives posted so far, by key
	changed  chan struct{}
	aborted  chan struct{}
	abortErr error
}

type posted struct {
	call       comm.Call
	send       []byte
	color, key int
}

func newFakeWorld(p int) *fakeWorld {
	return &fakeWorld{
		p: p, gen: make(chan struct{}), slots: make([]posted, p),
		splits: map[[2]int]*fakeWorld{}, mail: map[[3]int][][]byte{}, tickets: map[[3]int]int{},
		changed: make(chan struct{}), aborted: make(chan struct{}),
	}
}

func (w *fakeWorld) abort(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.abortErr == nil {
		w.abortErr = &comm.AbortError{Rank: -1, Cause: err}
		close(w.aborted)
	}
}

func (w *fakeWorld) err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.abortErr
}

func (w *fakeWorld) wait(ctx context.Context, ch <-chan struct{}) error {
	select {
	case <-ch:
		return nil
	case <-w.aborted:
		return w.err()
	case <-ctx.Done():
		w.abort(ctx.Err())
		return ctx.Err()
	}
}

func (w *fakeWorld) barrier(ctx context.Context) error {
	w.mu.Lock()
	ch := w.gen
	w.arrived++
	if w.arrived == w.p {
		w.arrived = 0
		close(w.gen)
		w.gen = make(chan struct{})
	}
	w.mu.Unlock()
	return w.wait(ctx, ch)
}

type fakeComm struct {
	w      *fakeWorld
	rank   int
	splits int
	rec    *comm.Recorder
}

func fakeLaunch(ctx context.Context, p int, fn func(context.Context, comm.Communicator) error) error {
	w := newFakeWorld(p)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := range p {
		wg.Go(func() { errs[r] = fn(ctx, newFakeComm(w, r)) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func newFakeComm(w *fakeWorld, r int) *fakeComm {
	return &fakeComm{w: w, rank: r, rec: comm.NewRecorder("fake", r, 16)}
}

func (c *fakeComm) Rank() int                   { return c.rank }
func (c *fakeComm) Size() int                   { return c.w.p }
func (c *fakeComm) Abort(cause error)           { c.w.abort(cause) }
func (c *fakeComm) Err() error                  { return c.w.err() }
func (c *fakeComm) Recorder() *comm.Recorder    { return c.rec }
func (c *fakeComm) Backend() string             { return "fake" }
func bytesOf(b comm.Buffer) []byte              { return b.(*comm.HostBuffer).Bytes() }
func block(b []byte, i, size int) []byte        { return b[i*size : (i+1)*size] }
func (c *fakeComm) fail(err error) error        { c.w.abort(err); return err }
func (c *fakeComm) check(call *comm.Call) error { return call.Validate(c.rank, c.w.p) }

type doneWork struct {
	done chan struct{}
	err  error
}

func (w *doneWork) Wait(ctx context.Context) error {
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (w *doneWork) Done() <-chan struct{} { return w.done }

func (c *fakeComm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	if err := c.check(&call); err != nil {
		return nil, err
	}
	w := &doneWork{done: make(chan struct{})}
	if call.Op == comm.OpRecv {
		// Take the receive's place in the matching order now.
		ticket := c.ticket(call.Peer, call.Tag)
		go func() { w.err = c.recv(ctx, call, ticket); close(w.done) }()
		return w, nil
	}
	// Sends are eager and collectives run in issue order, so running
	// them now is a valid schedule.
	w.err = c.Do(ctx, call)
	close(w.done)
	return w, nil
}

func (c *fakeComm) Do(ctx context.Context, call comm.Call) error {
	if err := c.check(&call); err != nil {
		return err
	}
	if err := c.w.err(); err != nil {
		return err
	}
	w := c.w
	switch call.Op {
	case comm.OpSend:
		msg := slices.Clone(bytesOf(call.Send))
		w.mu.Lock()
		key := [3]int{c.rank, call.Peer, call.Tag}
		w.mail[key] = append(w.mail[key], msg)
		close(w.changed)
		w.changed = make(chan struct{})
		w.mu.Unlock()
		return nil
	case comm.OpRecv:
		return c.recv(ctx, call, c.ticket(call.Peer, call.Tag))
	}
	var send []byte
	if call.Send != nil {
		send = slices.Clone(bytesOf(call.Send))
	}
	w.slots[c.rank] = posted{call: call, send: send}
	if err := w.barrier(ctx); err != nil {
		return err
	}
	err := c.compute(&call)
	if err2 := w.barrier(ctx); err == nil {
		err = err2
	}
	return err
}

func (c *fakeComm) compute(call *comm.Call) error {
	w, p, r := c.w, c.w.p, c.rank
	for _, s := range w.slots {
		if s.call.Op != call.Op {
			return c.fail(fmt.Errorf("rank issued %v while another issued %v", call.Op, s.call.Op))
		}
	}
	var dt comm.DType
	if call.Send != nil {
		dt = call.Send.DType()
	} else if call.Recv != nil {
		dt = call.Recv.DType()
	}
	reduce := func(dst []byte, srcs [][]byte) error {
		if err := kernel.Reduce(dt, call.Reduce, dst, srcs...); err != nil {
			return err
		}
		if call.Reduce == comm.Avg {
			kernel.Scale(dt, dst, p)
		}
		return nil
	}
	sends := func() [][]byte {
		out := make([][]byte, p)
		for j, s := range w.slots {
			out[j] = s.send
		}
		return out
	}
	switch call.Op {
	case comm.OpAllReduce:
		return reduce(bytesOf(call.Recv), sends())
	case comm.OpReduce:
		if r == call.Root {
			return reduce(bytesOf(call.Recv), sends())
		}
	case comm.OpBroadcast:
		copy(bytesOf(call.Recv), w.slots[call.Root].send)
	case comm.OpAllGather, comm.OpGather:
		if call.Op == comm.OpGather && r != call.Root {
			return nil
		}
		dst := bytesOf(call.Recv)
		for j, s := range w.slots {
			copy(block(dst, j, len(s.send)), s.send)
		}
	case comm.OpReduceScatter:
		dst := bytesOf(call.Recv)
		srcs := sends()
		for j := range srcs {
			srcs[j] = block(srcs[j], r, len(dst))
		}
		return reduce(dst, srcs)
	case comm.OpScatter:
		dst := bytesOf(call.Recv)
		copy(dst, block(w.slots[call.Root].send, r, len(dst)))
	case comm.OpAllToAll:
		dst := bytesOf(call.Recv)
		n := len(dst) / p
		for j, s := range w.slots {
			copy(block(dst, j, n), block(s.send, r, n))
		}
	case comm.OpAllToAllV:
		size := call.Recv.DType().Size()
		dst := bytesOf(call.Recv)
		off := 0
		for j, s := range w.slots {
			displ := 0
			for _, n := range s.call.SendCounts[:r] {
				displ += n
			}
			n := s.call.SendCounts[r]
			if n != call.RecvCounts[j] {
				return c.fail(fmt.Errorf("rank %d sends %d, rank %d expects %d", j, n, r, call.RecvCounts[j]))
			}
			copy(dst[off*size:(off+n)*size], s.send[displ*size:(displ+n)*size])
			off += n
		}
	}
	return nil
}

func (c *fakeComm) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	w := c.w
	w.slots[c.rank] = posted{call: comm.Call{Op: comm.OpSplit}, color: color, key: key}
	if err := w.barrier(ctx); err != nil {
		return nil, err
	}
	var members []int
	for j, s := range w.slots {
		if s.color == color {
			members = append(members, j)
		}
	}
	slices.SortStableFunc(members, func(a, b int) int { return w.slots[a].key - w.slots[b].key })
	var sub *fakeComm
	if color >= 0 {
		w.mu.Lock()
		id := [2]int{c.splits, color}
		nw := w.splits[id]
		if nw == nil {
			nw = newFakeWorld(len(members))
			w.splits[id] = nw
		}
		w.mu.Unlock()
		sub = newFakeComm(nw, slices.Index(members, c.rank))
	}
	c.splits++
	if err := w.barrier(ctx); err != nil {
		return nil, err
	}
	if sub == nil {
		return nil, nil
	}
	return sub, nil
}

// ticket numbers the receives from peer with tag in posting order.
func (c *fakeComm) ticket(peer, tag int) int {
	c.w.mu.Lock()
	defer c.w.mu.Unlock()
	key := [3]int{peer, c.rank, tag}
	t := c.w.tickets[key]
	c.w.tickets[key]++
	return t
}

// recv waits for the ticket-th message from the peer with the tag.
func (c *fakeComm) recv(ctx context.Context, call comm.Call, ticket int) error {
	w := c.w
	key := [3]int{call.Peer, c.rank, call.Tag}
	for {
		w.mu.Lock()
		if q := w.mail[key]; len(q) > ticket {
			msg := q[ticket]
			w.mu.Unlock()
			dst := bytesOf(call.Recv)
			if len(msg) != len(dst) {
				return c.fail(fmt.Errorf("recv of %d bytes matched a send of %d", len(dst), len(msg)))
			}
			copy(dst, msg)
			return nil
		}
		ch := w.changed
		w.mu.Unlock()
		if err := w.wait(ctx, ch); err != nil {
			return err
		}
	}
}
