package local

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/kernel"
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

	p2pSeq  atomic.Uint64
	scratch []byte
	srcs    [][]byte
	wt      waiter
	plans   map[shapeKey]*schedule // this rank's lock-free front of the group cache

	mu    sync.Mutex // guards queue and busy
	queue []*task
	busy  bool
}

var _ comm.Communicator = (*Comm)(nil)

func newComm(g *group, rank int) *Comm {
	spin, yield := time.Duration(0), yieldOversubscribed
	if g.size <= g.w.cores {
		spin, yield = spinFor, yieldFor
	}
	return &Comm{
		g: g, rank: rank, spin: spin, yield: yield,
		rec:   comm.NewRecorder(g.name, rank, g.w.opts.RecorderSize),
		plans: map[shapeKey]*schedule{},
	}
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
	id := c.rec.Begin(seq, &call, call.Algorithm)
	if c.enterInline() {
		err := c.run(ctx, seq, &call, id)
		c.leaveInline()
		return err
	}
	t := &task{c: c, ctx: ctx, call: call, seq: seq, id: id, done: make(chan struct{})}
	c.push(t)
	return t.Wait(ctx)
}

// Start implements comm.Communicator.
func (c *Comm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		return c.postP2P(ctx, call)
	}
	if call.Op == comm.OpSplit {
		return nil, c.errorf(call.Op, c.seq, -1, "%w: use Split", comm.ErrInvalid)
	}
	if e := c.g.err(); e != nil {
		return nil, c.wrap(call.Op, c.seq+1, -1, e)
	}
	c.seq++
	c.fillAlgorithm(&call)
	t := &task{c: c, ctx: ctx, call: call, seq: c.seq, done: make(chan struct{})}
	t.id = c.rec.Begin(t.seq, &t.call, call.Algorithm)
	c.push(t)
	return t, nil
}

func (c *Comm) fillAlgorithm(call *comm.Call) {
	if call.Algorithm == comm.Auto {
		call.Algorithm = c.g.w.opts.Algorithms.For(call.Op)
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
}

// Done implements comm.Work.
func (t *task) Done() <-chan struct{} { return t.done }

// Wait implements comm.Work. A cancelled ctx aborts the communicator.
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
		err := fmt.Errorf("%w while waiting (context: %w)", errCancelled, ctx.Err())
		t.c.Abort(t.c.errorf(t.call.Op, t.seq, -1, "%w", err))
		<-t.done
		return t.c.wrap(t.call.Op, t.seq, -1, err)
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
		t.err = c.run(t.ctx, t.seq, &t.call, t.id)
		close(t.done)
	}
}

// run executes one collective end to end on this rank.
func (c *Comm) run(ctx context.Context, seq uint64, call *comm.Call, id uint64) error {
	if e := c.g.err(); e != nil {
		err := c.wrap(call.Op, seq, -1, e)
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	c.rec.Update(id, comm.Started, nil)
	err := c.collective(c.waiter(ctx), seq, call, id)
	if err != nil {
		c.rec.Update(id, comm.Failed, err)
		return err
	}
	c.rec.Update(id, comm.Completed, nil)
	return nil
}

func (c *Comm) collective(wt *waiter, seq uint64, call *comm.Call, id uint64) error {
	d := &c.g.slots[c.rank].desc
	c.post(d, seq, call)
	c.g.publish(c.rank, progressWord(seq, 0))
	if err := c.arrive(wt, seq, call.Op); err != nil {
		return err
	}
	if err := c.agree(seq, call); err != nil {
		if derr := c.depart(wt, seq, call.Op); derr != nil {
			return derr
		}
		return err
	}
	if err := c.move(wt, seq, call, id); err != nil {
		return err
	}
	return c.depart(wt, seq, call.Op)
}

// waiter prepares this rank's waiter for one blocking call.
func (c *Comm) waiter(ctx context.Context) *waiter {
	c.wt = waiter{
		g: c.g, rank: c.rank, ctx: ctx, deadline: time.Now().Add(c.g.w.opts.Timeout),
		spin: c.spin, yield: c.yield, timer: c.wt.timer,
	}
	return &c.wt
}

// post fills this rank's descriptor. Validation failures are posted, not
// returned, so that every member learns of them before any data moves.
func (c *Comm) post(d *descriptor, seq uint64, call *comm.Call) {
	*d = descriptor{fp: comm.FingerprintOf(seq, call), scratch: d.scratch[:0]}
	if c.g.w.opts.ConsistencyCheck {
		d.fp.Site = callerSite()
	}
	d.invalid = c.validate(call)
	if d.invalid != nil {
		return
	}
	if b := hostOf(call.Send); b != nil {
		d.send, d.dtype = b.Bytes(), b.DType()
	}
	if b := hostOf(call.Recv); b != nil {
		d.recv, d.dtype = b.Bytes(), b.DType()
	}
	d.sendCounts, d.recvCounts = call.SendCounts, call.RecvCounts
	d.inPlace = isInPlace(call, c.rank)
}

func hostOf(b comm.Buffer) *comm.HostBuffer {
	if b == nil {
		return nil
	}
	h, _ := b.(*comm.HostBuffer)
	return h
}

// validate checks what one rank can check alone.
func (c *Comm) validate(call *comm.Call) error {
	if err := call.Validate(c.rank, c.g.size); err != nil {
		return err
	}
	for _, b := range []comm.Buffer{call.Send, call.Recv} {
		if b != nil && hostOf(b) == nil {
			return fmt.Errorf("%w: the local backend needs host buffers, got %T on %s", comm.ErrUnsupported, b, b.Device())
		}
	}
	if call.Algorithm != comm.Auto && !supports(call.Op, call.Algorithm) {
		return fmt.Errorf("%w: algorithm %v does not apply to %v (local supports %v)", comm.ErrUnsupported, call.Algorithm, call.Op, Algorithms(call.Op))
	}
	s, r := hostOf(call.Send), hostOf(call.Recv)
	if s == nil || r == nil || comm.HostOverlap(s, r) == comm.Disjoint {
		return nil
	}
	if !isInPlace(call, c.rank) {
		return fmt.Errorf("%w: %v: send and recv overlap but not as the in-place form (%s)", comm.ErrInvalid, call.Op, inPlaceRule(call.Op))
	}
	return nil
}

func inPlaceRule(op comm.Op) string {
	switch op {
	case comm.OpAllReduce, comm.OpBroadcast, comm.OpReduce:
		return "send == recv"
	case comm.OpAllGather:
		return "send is recv's block at rank·n"
	case comm.OpReduceScatter:
		return "recv is send's block at rank·n"
	}
	return "this op has no in-place form"
}

// isInPlace reports whether the call uses NCCL's in-place form on rank.
func isInPlace(call *comm.Call, rank int) bool {
	s, r := hostOf(call.Send), hostOf(call.Recv)
	if s == nil || r == nil || len(s.Bytes()) == 0 {
		return call.Op == comm.OpBroadcast
	}
	switch call.Op {
	case comm.OpAllReduce, comm.OpBroadcast, comm.OpReduce:
		return comm.HostOverlap(s, r) == comm.Same
	case comm.OpAllGather:
		off, ok := comm.ByteOffset(r, s)
		return ok && off == rank*len(s.Bytes())
	case comm.OpReduceScatter:
		off, ok := comm.ByteOffset(s, r)
		return ok && off == rank*len(r.Bytes())
	}
	return false
}

// arrive waits until every member has posted its descriptor for seq.
func (c *Comm) arrive(wt *waiter, seq uint64, op comm.Op) error {
	for q := 0; q < c.g.size; q++ {
		if q == c.rank {
			continue
		}
		if err := wt.until(q, progressWord(seq, 0)); err != nil {
			return c.waitFailed(op, seq, err)
		}
	}
	return nil
}

// depart publishes that this rank has finished reading its peers and waits
// until all have, so that no buffer is reused while a peer still reads it.
func (c *Comm) depart(wt *waiter, seq uint64, op comm.Op) error {
	c.g.publish(c.rank, progressWord(seq, departMark))
	for q := 0; q < c.g.size; q++ {
		if q == c.rank {
			continue
		}
		if err := wt.until(q, progressWord(seq, departMark)); err != nil {
			return c.waitFailed(op, seq, err)
		}
	}
	return nil
}

// agree checks, identically on every member, that all posted valid and
// matching calls. Every member reads the same descriptors, so all reach the
// same verdict and the communicator stays usable after a rejected call.
func (c *Comm) agree(seq uint64, call *comm.Call) error {
	slots := c.g.slots
	var bad []string
	for q := range slots {
		if err := slots[q].desc.invalid; err != nil {
			bad = append(bad, fmt.Sprintf("rank %d: %v", q, err))
		}
	}
	if bad != nil {
		return c.errorf(call.Op, seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
	}
	mismatch := false
	for q := range slots {
		if !slots[q].desc.fp.Matches(slots[0].desc.fp) {
			mismatch = true
		}
	}
	if !mismatch && call.Op != comm.OpBarrier && call.Op != comm.OpSplit {
		// Same dtype is part of the fingerprint; buffers that a peer reads
		// must also be large enough, which the counts guarantee.
		for q := range slots {
			if slots[q].desc.dtype != slots[0].desc.dtype {
				mismatch = true
			}
		}
	}
	if mismatch {
		fps := make([]comm.Fingerprint, len(slots))
		for q := range slots {
			fps[q] = slots[q].desc.fp
			fps[q].SendCounts = slices.Clone(fps[q].SendCounts) // the caller's slice
		}
		return c.wrap(call.Op, seq, -1, &comm.MismatchError{Calls: fps})
	}
	if call.Op == comm.OpAllToAllV {
		send := make([][]int, len(slots))
		recv := make([][]int, len(slots))
		for q := range slots {
			send[q], recv[q] = slots[q].desc.sendCounts, slots[q].desc.recvCounts
		}
		if err := comm.CheckCounts(send, recv); err != nil {
			return c.wrap(call.Op, seq, -1, err)
		}
	}
	return nil
}

// move performs the data movement of a validated, agreed call.
func (c *Comm) move(wt *waiter, seq uint64, call *comm.Call, id uint64) error {
	slots := c.g.slots
	me := &slots[c.rank].desc
	es := me.dtype.Size()
	p := c.g.size
	switch call.Op {
	case comm.OpBarrier:
		return nil
	case comm.OpAllToAll:
		n := len(me.send) / p
		for q := 0; q < p; q++ {
			copy(me.recv[q*n:(q+1)*n], slots[q].desc.send[c.rank*n:(c.rank+1)*n])
		}
		return nil
	case comm.OpAllToAllV:
		at := 0
		for q := 0; q < p; q++ {
			peer := &slots[q].desc
			off := 0
			for j := 0; j < c.rank; j++ {
				off += peer.sendCounts[j]
			}
			n := me.recvCounts[q] * es
			copy(me.recv[at:at+n], peer.send[off*es:off*es+n])
			at += n
		}
		return nil
	case comm.OpGather:
		if c.rank == call.Root {
			n := len(me.send)
			for q := 0; q < p; q++ {
				copy(me.recv[q*n:(q+1)*n], slots[q].desc.send)
			}
		}
		return nil
	case comm.OpScatter:
		n := len(me.recv)
		copy(me.recv, slots[call.Root].desc.send[c.rank*n:(c.rank+1)*n])
		return nil
	}
	s, err := c.schedule(call, me)
	if err != nil {
		return c.wrap(call.Op, seq, -1, err)
	}
	if call.Algorithm == comm.Auto {
		c.rec.SetAlgorithm(id, s.algo)
	}
	if need := s.scratch[c.rank] * es; need > 0 {
		if cap(c.scratch) < need {
			c.scratch = make([]byte, need, need+need/4)
		}
		me.scratch = c.scratch[:need]
	}
	return c.execute(wt, seq, call, s, me.dtype)
}

// schedule returns the compiled schedule for call, choosing the algorithm
// if the call left it to the backend.
func (c *Comm) schedule(call *comm.Call, me *descriptor) (*schedule, error) {
	p := c.g.size
	key := shapeKey{op: call.Op, algo: call.Algorithm, n: call.Count(), root: call.Root, dtype: me.dtype, reduce: call.Reduce}
	cacheable := p <= 64
	if cacheable {
		for q := 0; q < p; q++ {
			if c.g.slots[q].desc.inPlace {
				key.inPlace |= 1 << q
			}
		}
		if s, ok := c.plans[key]; ok {
			return s, nil
		}
	}
	inPlace := make([]byte, p)
	for q := range inPlace {
		if c.g.slots[q].desc.inPlace {
			inPlace[q] = 1
		}
	}
	n := call.Count()
	if call.Op == comm.OpReduceScatter {
		n = len(me.recv) / me.dtype.Size()
	}
	pl := plan{
		op: call.Op, algo: call.Algorithm, p: p, n: n, root: call.Root,
		avg:    call.Op.Reduces() && call.Reduce == comm.Avg,
		stream: c.footprint() > c.g.w.model.CacheBytes,
	}
	pl.piece = pieceElems(me.dtype, pl.stream)
	if !call.Op.Rooted() {
		pl.root = 0
	}
	if pl.algo == comm.Auto {
		pl.algo = c.g.choose(pl, inPlace, me.dtype)
	}
	s, err := c.g.compiled(pl, inPlace)
	if err == nil && cacheable {
		if len(c.plans) >= maxCachedSchedules {
			clear(c.plans)
		}
		c.plans[key] = s
	}
	return s, err
}

// shapeKey identifies a call's shape for this rank's schedule cache.
type shapeKey struct {
	op      comm.Op
	algo    comm.Algorithm
	n, root int
	dtype   comm.DType
	reduce  comm.ReduceOp
	inPlace uint64 // bit q: rank q called in place
}

// footprint is the bytes every member's buffers of the current call span:
// beyond the last-level cache the call runs at memory speed.
func (c *Comm) footprint() int64 {
	var n int64
	for q := range c.g.slots {
		d := &c.g.slots[q].desc
		n += int64(len(d.send) + len(d.recv))
	}
	return n
}

// The pipeline granularity of tree and chain algorithms: large enough to
// amortise a handoff, small enough to fill the pipeline; from memory,
// large enough for the streaming stores of kernel.ReduceStream.
const (
	pieceBytes       = 256 << 10
	pieceBytesStream = kernel.StreamBytes
)

func pieceElems(dt comm.DType, stream bool) int {
	if stream {
		return max(1, pieceBytesStream/dt.Size())
	}
	return max(1, pieceBytes/dt.Size())
}

// compiled returns the cached schedule for pl, generating it on first use.
func (g *group) compiled(pl plan, inPlace []byte) (*schedule, error) {
	key := schedKey{op: pl.op, algo: pl.algo, n: pl.n, root: pl.root, piece: pl.piece, avg: pl.avg, stream: pl.stream, inPlace: string(inPlace)}
	g.schedMu.Lock()
	defer g.schedMu.Unlock()
	if s, ok := g.schedules[key]; ok {
		return s, nil
	}
	pl.inPlace = make([]bool, len(inPlace))
	for i, b := range inPlace {
		pl.inPlace[i] = b == 1
	}
	s, err := generate(pl)
	if err != nil {
		return nil, err
	}
	if len(g.schedules) >= maxCachedSchedules {
		clear(g.schedules)
	}
	g.schedules[key] = s
	return s, nil
}

// maxCachedSchedules bounds the schedule cache of one communicator; a
// training loop uses a handful of sizes, so eviction is rare.
const maxCachedSchedules = 512

// execute runs this rank's steps of s.
func (c *Comm) execute(wt *waiter, seq uint64, call *comm.Call, s *schedule, dt comm.DType) error {
	es := dt.Size()
	steps := s.steps[c.rank]
	for i := range steps {
		st := &steps[i]
		for _, d := range st.deps {
			if err := wt.until(d.rank, progressWord(seq, d.mark)); err != nil {
				return c.waitFailed(call.Op, seq, err)
			}
		}
		dst := c.bytesOf(st.dst, es)
		switch st.kind {
		case stepCopy:
			copy(dst, c.bytesOf(st.srcs[0], es))
		case stepReduce:
			srcs := c.srcs[:0]
			for _, r := range st.srcs {
				srcs = append(srcs, c.bytesOf(r, es))
			}
			reduce := kernel.Reduce
			if s.stream {
				reduce = kernel.ReduceStream
			}
			if err := reduce(dt, call.Reduce, dst, srcs...); err != nil {
				return c.wrap(call.Op, seq, -1, err)
			}
			clear(srcs)
			c.srcs = srcs
		case stepScale:
			kernel.Scale(dt, dst, c.g.size)
		}
		if st.signal {
			c.g.publish(c.rank, progressWord(seq, i+1))
		}
	}
	return nil
}

func (c *Comm) bytesOf(r ref, es int) []byte {
	d := &c.g.slots[r.rank].desc
	var b []byte
	switch r.buf {
	case bufSend:
		b = d.send
	case bufRecv:
		b = d.recv
	case bufScratch:
		b = d.scratch
	}
	return b[r.off*es : (r.off+r.n)*es]
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
		e.Err = fmt.Errorf("%w%s", ew.cause, c.dump(seq))
	}
	c.g.abort(&comm.AbortError{Rank: c.rank, Cause: e})
	return e
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

func (c *Comm) wrap(op comm.Op, seq uint64, peer int, err error) *comm.Error {
	return &comm.Error{Backend: "local", Rank: c.rank, Op: op, Seq: seq, Peer: peer, Err: err}
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

// sortedMembers lists the ranks of a split part ordered by (key, rank).
func sortedMembers(ranks, keys []int) []int {
	out := slices.Clone(ranks)
	slices.SortStableFunc(out, func(a, b int) int {
		if keys[a] != keys[b] {
			return keys[a] - keys[b]
		}
		return a - b
	})
	return out
}
