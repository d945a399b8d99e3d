package trace

import (
	"context"
	"fmt"
	"slices"
	"sort"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// Comm wraps c so that its calls are recorded in tl as events of rank (the
// trace's process id: normally the world rank; a negative rank means
// c.Rank()). c is normally this rank's world communicator: wrap it before
// building the mesh on it, and the mesh's sub-communicators, which it
// creates with Split, are traced too. Each rank of the world wraps its own
// handle with the same tl, so that groups are labelled by their ranks.
//
// Every method delegates to c; Do, Start, Split and Wait on the returned
// Work also record events (see the package documentation for what they
// mean). Calls must go through the wrapper only: the groups of children
// are identified by the number of Splits made through it. With a nil tl,
// Comm returns c itself.
func Comm(c comm.Communicator, tl *Timeline, rank int) comm.Communicator {
	if tl == nil || c == nil {
		return c
	}
	if t := tracedOf(c); t != nil && t.tl == tl {
		return c
	}
	if rank < 0 {
		rank = c.Rank()
	}
	key := fmt.Sprintf("root%d", c.Size())
	g := tl.joinGroup(key, c.Size(), member{pos: c.Rank(), rank: rank}, backendName(c))
	return wrap(&traced{inner: c, tl: tl, rec: c.Recorder(), rank: int32(rank), group: g, key: key})
}

// wrap returns t, with Share and CommStream where the wrapped
// communicator has them, so that wrapping hides no capability
// (comm.SharedMemory: MoE dispatch's fused path; device.StreamComm: NCCL's
// stream, which device.BeforeCollective orders after compute on the device
// instead of synchronising).
func wrap(t *traced) comm.Communicator {
	_, shared := t.inner.(comm.SharedMemory)
	_, stream := t.inner.(device.StreamComm)
	switch {
	case shared && stream:
		return &tracedSharedStream{&tracedShared{t}}
	case shared:
		return &tracedShared{t}
	case stream:
		return &tracedStream{t}
	}
	return t
}

// tracedOf returns the wrapper c is, or nil.
func tracedOf(c comm.Communicator) *traced {
	switch t := c.(type) {
	case *traced:
		return t
	case *tracedShared:
		return t.traced
	case *tracedStream:
		return t.traced
	case *tracedSharedStream:
		return t.traced
	}
	return nil
}

// tracedStream is the wrapper of a device.StreamComm.
type tracedStream struct{ *traced }

// CommStream implements device.StreamComm: the wrapped communicator's.
func (t *tracedStream) CommStream() device.Stream { return t.inner.(device.StreamComm).CommStream() }

// tracedSharedStream is the wrapper of a communicator that is both a
// comm.SharedMemory and a device.StreamComm.
type tracedSharedStream struct{ *tracedShared }

// CommStream implements device.StreamComm: the wrapped communicator's.
func (t *tracedSharedStream) CommStream() device.Stream {
	return t.inner.(device.StreamComm).CommStream()
}

// streams returns the rank's stream recorder and the communicator's
// stream when both exist (a device.StreamComm of a rank with Streams).
func (t *traced) streams() (*Streams, device.Stream) {
	sc, ok := t.inner.(device.StreamComm)
	if !ok {
		return nil, nil
	}
	s := t.tl.streamsOf(t.rank)
	if s == nil {
		return nil, nil
	}
	return s, sc.CommStream()
}

// onStream runs call, a collective queued on the communicator's stream,
// between two of the rank's stream events (when it has Streams).
func (t *traced) onStream(c *comm.Call, call func() error) error {
	s, st := t.streams()
	if s == nil {
		return call()
	}
	start := s.commStart(st)
	t0 := t.tl.clock()
	err := call()
	e := t.template(LaneStreamComm, c, t0)
	if err != nil {
		e.flags |= flagFailed
	}
	s.commEnd(st, start, e)
	return err
}

// tracedShared is the wrapper of a communicator that implements
// comm.SharedMemory.
type tracedShared struct{ *traced }

var _ comm.SharedMemory = (*tracedShared)(nil)

// Share implements comm.SharedMemory. It is recorded as the barrier it
// runs as, a comm event with the caller blocked throughout (a wait event),
// use's work included.
func (t *tracedShared) Share(ctx context.Context, v any, use func(peers []any) error) error {
	return t.blocking(comm.Call{Op: comm.OpBarrier}, func() error {
		return t.inner.(comm.SharedMemory).Share(ctx, v, use)
	})
}

// backendName returns the communicator's own name when the backend gives
// one (comm/local's Name).
func backendName(c comm.Communicator) string {
	if n, ok := c.(interface{ Name() string }); ok {
		return n.Name()
	}
	return ""
}

// traced is the wrapper Comm returns; it implements comm.Communicator.
type traced struct {
	inner  comm.Communicator
	tl     *Timeline
	rec    *comm.Recorder
	rank   int32
	group  int32
	key    string // the group's key: root, then one step per Split
	splits int    // Splits made through this wrapper
}

var _ comm.Communicator = (*traced)(nil)

// Unwrap returns the wrapped communicator.
func (t *traced) Unwrap() comm.Communicator { return t.inner }

// Rank implements comm.Communicator.
func (t *traced) Rank() int { return t.inner.Rank() }

// Size implements comm.Communicator.
func (t *traced) Size() int { return t.inner.Size() }

// Abort implements comm.Communicator.
func (t *traced) Abort(cause error) { t.inner.Abort(cause) }

// Err implements comm.Communicator.
func (t *traced) Err() error { return t.inner.Err() }

// Recorder implements comm.Communicator.
func (t *traced) Recorder() *comm.Recorder { return t.inner.Recorder() }

// Backend implements comm.Communicator.
func (t *traced) Backend() string { return t.inner.Backend() }

// Name returns the wrapped communicator's name where its backend gives one
// (comm/local's "world/split3.c1"), and "" otherwise.
func (t *traced) Name() string { return backendName(t.inner) }

// template describes call c as an event of this communicator.
func (t *traced) template(lane Lane, c *comm.Call, start int64) event {
	e := event{start: start, issued: start, rank: t.rank, group: t.group, peer: -1, lane: lane, op: c.Op}
	b := c.Send
	if comm.IsNil(b) {
		b = c.Recv
	}
	if !comm.IsNil(b) {
		e.dtype = b.DType()
		e.bytes = int64(c.Count()) * int64(b.DType().Size())
	}
	switch {
	case c.Op == comm.OpSend || c.Op == comm.OpRecv:
		e.peer = int32(c.Peer)
	case c.Op.Rooted():
		e.peer = int32(c.Root)
	}
	return e
}

// Do implements comm.Communicator. The caller is blocked for the whole
// call (a wait event); the execution is a comm event.
func (t *traced) Do(ctx context.Context, c comm.Call) error {
	return t.blocking(c, func() error { return t.onStream(&c, func() error { return t.inner.Do(ctx, c) }) })
}

// blocking runs call, which blocks its caller throughout, and records it
// as a comm event and a wait event over the same span.
func (t *traced) blocking(c comm.Call, call func() error) error {
	t0 := t.tl.clock()
	err := call()
	t1 := t.tl.clock()
	e := t.template(LaneComm, &c, t0)
	w := e
	w.lane, w.end = LaneWait, t1
	if err != nil {
		e.flags |= flagFailed
		w.flags |= flagFailed
	}
	t.tl.issue(t.rec, e, t1, t1, true, &w)
	return err
}

// Start implements comm.Communicator. The returned Work records the time
// its caller blocks in Wait.
func (t *traced) Start(ctx context.Context, c comm.Call) (comm.Work, error) {
	t0 := t.tl.clock()
	var w comm.Work
	err := t.onStream(&c, func() (err error) {
		w, err = t.inner.Start(ctx, c)
		return err
	})
	t1 := t.tl.clock()
	e := t.template(LaneComm, &c, t0)
	if err != nil || w == nil {
		e.flags |= flagFailed
		t.tl.issue(t.rec, e, t1, t1, true, nil)
		return w, err
	}
	id := t.tl.issue(t.rec, e, t1, -1, false, nil)
	tw := &work{inner: w, tl: t.tl, id: id, ev: e}
	if _, ok := w.(device.EventWork); ok {
		return &eventWork{tw}, nil
	}
	return tw, nil
}

// Split implements comm.Communicator. The child is wrapped: its calls are
// recorded under the same rank, labelled by the child's group.
func (t *traced) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	var child comm.Communicator
	err := t.blocking(comm.Call{Op: comm.OpSplit}, func() (err error) {
		child, err = t.inner.Split(ctx, color, key)
		return err
	})
	n := t.splits
	t.splits++
	if err != nil || child == nil {
		return child, err
	}
	ck := fmt.Sprintf("%s/%d.%d", t.key, n, color)
	g := t.tl.joinGroup(ck, child.Size(), member{key: key, pos: t.inner.Rank(), rank: int(t.rank)}, backendName(child))
	return wrap(&traced{inner: child, tl: t.tl, rec: child.Recorder(), rank: t.rank, group: g, key: ck}), nil
}

// work wraps an async operation's Work.
type work struct {
	inner comm.Work
	tl    *Timeline
	id    uint64
	ev    event // the comm event's template, for the wait event
}

// eventWork wraps a device.EventWork, keeping its event visible so that
// device.AfterCollective makes compute wait on the device.
type eventWork struct{ *work }

// Event implements device.EventWork: the wrapped work's.
func (w *eventWork) Event() device.Event { return w.inner.(device.EventWork).Event() }

// Done implements comm.Work.
func (w *work) Done() <-chan struct{} { return w.inner.Done() }

// Wait implements comm.Work. When the operation is still running it
// records a wait event for the time the caller blocks.
func (w *work) Wait(ctx context.Context) error {
	select {
	case <-w.inner.Done():
		err := w.inner.Wait(ctx)
		w.tl.completed(w.id, w.tl.clock(), false, nil)
		return err
	default:
	}
	t0 := w.tl.clock()
	err := w.inner.Wait(ctx)
	t1 := w.tl.clock()
	we := w.ev
	we.lane, we.start, we.issued, we.end = LaneWait, t0, t0, t1
	if err != nil {
		we.flags |= flagFailed
	}
	w.tl.completed(w.id, t1, true, &we)
	return err
}

// pending is a communication call whose comm event awaits its flight
// recorder entry.
type pending struct {
	id     uint64
	rec    *comm.Recorder
	ev     event // start = issue; the rest of the template
	t1     int64 // when the call returned: the entry was begun in [ev.issued, t1]
	doneBy int64 // completion seen at or before this time; -1 unknown
	exact  bool  // doneBy is when a blocking call or Wait returned
}

// issue registers the comm event e of a call made in [e.issued, t1] on
// the communicator with recorder rec, plus an optional wait event, and
// returns the call's id.
func (tl *Timeline) issue(rec *comm.Recorder, e event, t1, doneBy int64, exact bool, wait *event) uint64 {
	tl.mu.Lock()
	if wait != nil {
		tl.addLocked(*wait)
	}
	tl.nextID++
	id := tl.nextID
	if len(tl.pending) >= tl.capacity {
		tl.dropped++
		tl.mu.Unlock()
		return id
	}
	tl.pending = append(tl.pending, pending{id: id, rec: rec, ev: e, t1: t1, doneBy: doneBy, exact: exact})
	auto := len(tl.pending) >= tl.resolveAt
	tl.mu.Unlock()
	if auto {
		tl.resolve(false)
	}
	return id
}

// completed notes that call id was seen complete at time at (exactly when
// a blocking Wait returned, or at most then), and adds its wait event.
func (tl *Timeline) completed(id uint64, at int64, exact bool, wait *event) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if wait != nil {
		tl.addLocked(*wait)
	}
	i, ok := slices.BinarySearchFunc(tl.pending, id, func(p pending, id uint64) int {
		switch {
		case p.id < id:
			return -1
		case p.id > id:
			return 1
		}
		return 0
	})
	if !ok {
		return
	}
	p := &tl.pending[i]
	if p.doneBy < 0 || at < p.doneBy {
		p.doneBy, p.exact = at, exact
	}
}

// resolve turns pending calls into comm events where their recorder
// entries are complete. A read (Events, WriteChrome, Overlap) also gives up
// on calls the recorders do not know and nobody saw complete, recording
// them as zero-length events marked "end unknown"; an automatic resolve
// keeps them.
func (tl *Timeline) resolve(read bool) {
	if read {
		tl.resolveMu.Lock()
	} else if !tl.resolveMu.TryLock() {
		return // another goroutine is resolving
	}
	defer tl.resolveMu.Unlock()
	tl.mu.Lock()
	gen := tl.gen
	n := len(tl.pending)
	var recs []*comm.Recorder
	for i := range n {
		if r := tl.pending[i].rec; r != nil && !slices.Contains(recs, r) {
			recs = append(recs, r)
		}
	}
	tl.mu.Unlock()

	// Every call among the first n was begun before this point, so its
	// entry is in the snapshot unless the ring overwrote it.
	snaps := make([][]comm.Entry, len(recs))
	for i, r := range recs {
		snaps[i] = r.Entries()
	}

	tl.mu.Lock()
	defer tl.mu.Unlock()
	if gen != tl.gen { // Reset ran meanwhile: the snapshots may miss calls
		return
	}
	keep := tl.pending[:0]
	for i := range n {
		p := tl.pending[i]
		var es []comm.Entry
		if k := slices.Index(recs, p.rec); k >= 0 {
			es = snaps[k]
		}
		e, found := tl.match(es, &p)
		ev := p.ev
		switch {
		case found && !e.End.IsZero():
			ev.start, ev.end = tl.since(e.Start), tl.since(e.End)
			if e.Start.IsZero() {
				ev.start = tl.since(e.Issued)
			}
			ev.start = max(ev.start, ev.issued)
			ev.end = max(ev.end, ev.start)
			ev.seq = e.Seq
			ev.flags |= flagSeq
			if e.State == comm.Failed {
				ev.flags |= flagFailed
			}
		case found:
			keep = append(keep, p) // still running
			continue
		case p.doneBy >= 0:
			ev.end = max(p.doneBy, ev.start)
			ev.flags |= flagObserved
			if !p.exact {
				ev.flags |= flagEndBound
			}
		case read:
			ev.end = ev.start
			ev.flags |= flagEndUnknown
		default:
			keep = append(keep, p)
			continue
		}
		tl.addLocked(ev)
	}
	keep = append(keep, tl.pending[n:]...)
	clear(tl.pending[len(keep):])
	tl.pending = keep
	tl.resolveAt = len(tl.pending) + resolveEvery
}

// match finds the entry of call p among a recorder's entries (oldest
// first): the first with p's op begun while the call was being made.
func (tl *Timeline) match(es []comm.Entry, p *pending) (comm.Entry, bool) {
	if len(es) == 0 {
		return comm.Entry{}, false
	}
	op := p.ev.op.String()
	i := sort.Search(len(es), func(i int) bool { return tl.since(es[i].Issued) >= p.ev.issued })
	for ; i < len(es) && tl.since(es[i].Issued) <= p.t1; i++ {
		if es[i].Op == op {
			return es[i], true
		}
	}
	return comm.Entry{}, false
}
