package local

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// descriptor is what a member posts when it arrives at a collective: its
// fingerprint, its buffers (peers read them directly) and, when its own
// arguments were bad, why, so that every member fails the call together.
type descriptor struct {
	fp                     comm.Fingerprint
	invalid                error
	dtype                  comm.DType
	inPlace                bool
	send, recv, scratch    []byte
	sendCounts, recvCounts []int
	color, key             int
	// sharing marks a Share (a barrier that carries shared); a plain
	// barrier must not match one.
	sharing bool
	shared  any
}

// Comm is one rank's handle on an in-process communicator. It implements
// comm.Communicator.
type Comm struct {
	g     *group
	rank  int
	seq   uint64 // collectives issued so far
	rec   *comm.Recorder
	spin  time.Duration // wait phases, see spinFor
	yield time.Duration

	p2pSeq    atomic.Uint64
	scratch   []byte
	srcs      [][]byte // reused by execute
	dsts      [][]byte
	prescaled []byte // 16-bit Avg inputs divided by the group size
	wt        waiter
	plans     map[shapeKey]*schedule // this rank's lock-free front of the group cache

	tuneCalls map[tuneKey]int // calls this rank made of each size class being tuned
	// trial is the tuning trial the current call is, with when this rank
	// started moving its data and its count; recorded after departure.
	trial       *trial
	trialStart  time.Time
	trialN      int
	a2avOffsets []int // reused by AllToAllV: where each peer's block lands

	mu    sync.Mutex // guards queue and busy
	queue []*task
	busy  bool
}

var _ comm.SharedMemory = (*Comm)(nil)

func newComm(g *group, rank int) *Comm {
	spin, yield := time.Duration(0), yieldOversubscribed
	switch {
	case g.w.bound:
		spin, yield = spinFor+yieldFor, 0
	case g.size <= g.w.cores:
		spin, yield = spinFor, yieldFor
	}
	c := &Comm{
		g: g, rank: rank, spin: spin, yield: yield,
		rec:   comm.NewRecorder(g.name, rank, g.w.opts.RecorderSize),
		plans: map[shapeKey]*schedule{}, tuneCalls: map[tuneKey]int{},
	}
	g.slots[rank].rec.Store(c.rec)
	return c
}

// Rank implements comm.Communicator.
func (c *Comm) Rank() int { return c.rank }

// Size implements comm.Communicator.
func (c *Comm) Size() int { return c.g.size }

// Backend implements comm.Communicator.
func (c *Comm) Backend() string { return "local" }

// Recorder implements comm.Communicator.
func (c *Comm) Recorder() *comm.Recorder { return c.rec }

// Name identifies the communicator in errors and dumps ("world",
// "world/split3.c1").
func (c *Comm) Name() string { return c.g.name }

// Err implements comm.Communicator.
func (c *Comm) Err() error {
	if e := c.g.err(); e != nil {
		return e
	}
	return nil
}

// Abort implements comm.Communicator.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("aborted")
	}
	c.g.abort(&comm.AbortError{Rank: c.rank, Cause: cause})
}

// Do implements comm.Communicator.
func (c *Comm) Do(ctx context.Context, call comm.Call) error {
	call = call.ForRank(c.rank)
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		w, err := c.postP2P(ctx, call)
		if err != nil {
			return err
		}
		return w.Wait(ctx)
	}
	if call.Op == comm.OpSplit {
		return c.errorf(call.Op, c.seq, -1, "%w: use Split", comm.ErrInvalid)
	}
	c.seq++
	seq := c.seq
	c.fillAlgorithm(&call)
	id := c.rec.BeginLabeled(comm.LabelOf(ctx), seq, &call, call.Algorithm)
	if err := c.admit(ctx, call.Op, seq, -1); err != nil {
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	return c.issue(ctx, seq, call, id, nil)
}

// admit checks, as a call is issued or starts to run, that the
// communicator is usable and ctx has not ended. A call given an ended
// context aborts the communicator at once, whether this rank arrives
// before its peers or after them: waiting would notice the context only
// when a peer is missing, so the same program would fail or succeed by
// the order in which its ranks happen to arrive.
func (c *Comm) admit(ctx context.Context, op comm.Op, seq uint64, peer int) error {
	if e := c.g.err(); e != nil {
		return c.wrap(op, seq, peer, e)
	}
	if err := ctx.Err(); err != nil {
		return c.abortFor(c.errorf(op, seq, peer, "%w before the call started (context: %w)", errCancelled, err))
	}
	return nil
}

// abortFor aborts the communicator because this rank's call failed with e
// (its context ended, it timed out, or a peer it waits for left) and
// returns what the call reports: e, unless another abort came first and e
// is a cancellation; then that abort, since a context cancelled after a
// peer's failure (as local.Run cancels it) is the failure's consequence,
// not its cause.
func (c *Comm) abortFor(e *comm.Error) error {
	if c.g.abort(&comm.AbortError{Rank: c.rank, Cause: e}) || !errors.Is(e, errCancelled) {
		return e
	}
	return c.wrap(e.Op, e.Seq, -1, c.g.err())
}

// issue runs one blocking collective: inline when the rank's stream is
// idle, else queued behind its async work.
func (c *Comm) issue(ctx context.Context, seq uint64, call comm.Call, id uint64, sh *sharing) error {
	if c.enterInline() {
		err := c.run(ctx, seq, &call, id, sh)
		c.leaveInline()
		return err
	}
	t := &task{c: c, ctx: ctx, call: call, seq: seq, id: id, done: make(chan struct{}), share: sh}
	c.push(t)
	return t.Wait(ctx)
}

// Start implements comm.Communicator.
func (c *Comm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	call = call.ForRank(c.rank)
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		o, err := c.postP2P(ctx, call)
		if err != nil {
			return nil, err // not a Work holding a nil *p2pOp
		}
		return o, nil
	}
	if call.Op == comm.OpSplit {
		return nil, c.errorf(call.Op, c.seq, -1, "%w: use Split", comm.ErrInvalid)
	}
	c.seq++
	c.fillAlgorithm(&call)
	t := &task{c: c, ctx: ctx, call: call, seq: c.seq, done: make(chan struct{})}
	t.id = c.rec.BeginLabeled(comm.LabelOf(ctx), t.seq, &t.call, call.Algorithm)
	if err := c.admit(ctx, call.Op, t.seq, -1); err != nil {
		c.rec.Update(t.id, comm.Failed, err)
		return nil, err
	}
	c.push(t)
	return t, nil
}

func (c *Comm) fillAlgorithm(call *comm.Call) {
	if call.Algorithm == comm.Auto {
		call.Algorithm = c.g.w.opts.Algorithms.For(call.Op, supports)
	}
}

// task is an async collective; it implements comm.Work.
type task struct {
	c    *Comm
	ctx  context.Context
	call comm.Call
	seq  uint64
	id   uint64
	done chan struct{}
	err  error
	// share is the Share this task runs, nil for a plain collective.
	share *sharing
}

// Done implements comm.Work.
func (t *task) Done() <-chan struct{} { return t.done }

// Wait implements comm.Work. A cancelled ctx aborts the communicator,
// unless it is aborted already: then the task's own outcome, which
// carries that abort, is the answer.
func (t *task) Wait(ctx context.Context) error {
	select {
	case <-t.done:
		return t.err
	default:
	}
	select {
	case <-t.done:
		return t.err
	case <-ctx.Done():
		// Both cases may be ready at once; so may an abort and the
		// cancellation that followed it, hence abortFor.
		err := t.c.abortFor(t.c.errorf(t.call.Op, t.seq, -1, "%w while waiting (context: %w)", errCancelled, ctx.Err()))
		<-t.done // the abort ends the task promptly
		if errors.Is(err, errCancelled) {
			return err // this rank's cancellation aborted the communicator
		}
		return t.err
	}
}

func (c *Comm) enterInline() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.busy {
		return false
	}
	c.busy = true
	return true
}

func (c *Comm) leaveInline() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.queue) > 0 {
		go c.drain()
		return
	}
	c.busy = false
}

func (c *Comm) push(t *task) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.queue = append(c.queue, t)
	if !c.busy {
		c.busy = true
		go c.drain()
	}
}

// drain runs queued tasks in issue order and exits when the queue is empty,
// so an idle communicator holds no goroutine.
func (c *Comm) drain() {
	for {
		c.mu.Lock()
		if len(c.queue) == 0 {
			c.busy = false
			c.mu.Unlock()
			return
		}
		t := c.queue[0]
		c.queue[0] = nil
		c.queue = c.queue[1:]
		c.mu.Unlock()
		t.err = c.runSafely(t.ctx, t.seq, &t.call, t.id, t.share)
		// Leave the stream idle before the waiter learns the task is done,
		// so that a call made right after Wait (Split, say) finds it idle.
		c.mu.Lock()
		last := len(c.queue) == 0
		if last {
			c.busy = false
		}
		c.mu.Unlock()
		close(t.done)
		if last {
			return
		}
	}
}

// runSafely is run for the background stream, where a panic would end the
// process: it becomes the task's error and aborts the communicator.
func (c *Comm) runSafely(ctx context.Context, seq uint64, call *comm.Call, id uint64, sh *sharing) (err error) {
	defer func() {
		if v := recover(); v != nil {
			e := c.errorf(call.Op, seq, -1, "panic: %v", v)
			c.g.abort(&comm.AbortError{Rank: c.rank, Cause: e})
			c.rec.Update(id, comm.Failed, e)
			err = e
		}
	}()
	return c.run(ctx, seq, call, id, sh)
}

// quiesce waits until no async work is queued or running and claims the
// stream for an inline call, which leaveInline releases.
func (c *Comm) quiesce(ctx context.Context) error {
	for {
		c.mu.Lock()
		if !c.busy {
			c.busy = true
			c.mu.Unlock()
			return nil
		}
		var last *task
		if n := len(c.queue); n > 0 {
			last = c.queue[n-1]
		}
		c.mu.Unlock()
		if last == nil { // the task running now is the last: poll briefly
			time.Sleep(10 * time.Microsecond)
			continue
		}
		select {
		case <-last.done:
		case <-ctx.Done():
			if c.g.err() != nil {
				<-last.done // the abort ends it at once; Split reports the abort
				continue
			}
			return ctx.Err()
		}
	}
}

// waitFailed turns a failed wait into the call's error. A timeout or a
// cancelled context aborts the communicator, because the members can no
// longer agree on where they are; the abort names this rank and the cause.
func (c *Comm) waitFailed(op comm.Op, seq uint64, err error) error {
	var ew *errWait
	if !errors.As(err, &ew) {
		return c.wrap(op, seq, -1, err)
	}
	var ab *comm.AbortError
	if errors.As(ew.cause, &ab) {
		return c.wrap(op, seq, -1, ew.cause)
	}
	e := c.wrap(op, seq, ew.peer, ew.cause)
	if errors.Is(ew.cause, comm.ErrTimeout) {
		te, peer := c.blameCollective(seq, ew.peer)
		te.Detail += c.dump(seq)
		e.Peer, e.Err = peer, te
	}
	return c.abortFor(e)
}

// dump writes the flight recorder where the options say and returns a note
// for the error message.
func (c *Comm) dump(seq uint64) string {
	dir := c.g.w.opts.DumpDir
	if dir == "" {
		return " (flight recorder: Communicator.Recorder, or set " + comm.DumpDirEnv + ")"
	}
	prefix := fmt.Sprintf("loom_fr_%s_rank%d_seq%d", strings.ReplaceAll(c.g.name, "/", "_"), c.rank, seq)
	paths, err := c.rec.WriteFiles(dir, prefix)
	if err != nil {
		return fmt.Sprintf(" (flight recorder dump failed: %v)", err)
	}
	return fmt.Sprintf(" (flight recorder dumped to %s)", strings.Join(paths, ", "))
}

// wrap makes err the error of this rank's call op #seq, with the label
// the flight recorder holds for it.
func (c *Comm) wrap(op comm.Op, seq uint64, peer int, err error) *comm.Error {
	e := &comm.Error{Backend: "local", Rank: c.rank, WorldRank: c.g.worldRanks[c.rank], Op: op, Seq: seq, Peer: peer, Err: err}
	if c.g.name != worldName {
		e.Comm = c.g.name
	}
	if en, ok := c.rec.Find(seq, !op.Collective()); ok && en.Op == op.String() {
		e.Label = en.Label
	}
	return e
}

func (c *Comm) errorf(op comm.Op, seq uint64, peer int, format string, args ...any) *comm.Error {
	return c.wrap(op, seq, peer, fmt.Errorf(format, args...))
}

// callerSite returns file:line of the first caller outside loom's comm
// packages, for consistency-check reports.
func callerSite() string {
	pcs := make([]uintptr, 16)
	n := runtime.Callers(3, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	for {
		f, more := frames.Next()
		if !strings.Contains(f.Function, "loom/comm.") && !strings.Contains(f.Function, "loom/comm/local.") {
			return fmt.Sprintf("%s:%d", f.File, f.Line)
		}
		if !more {
			return ""
		}
	}
}
