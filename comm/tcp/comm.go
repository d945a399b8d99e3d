package tcp

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Comm is one process's handle on a communicator over TCP. It implements
// comm.Communicator. Issue calls on it from one goroutine at a time (their
// order is the sequence every rank must follow); Wait, Done, Abort, Err
// and Recorder may be used from any goroutine.
type Comm struct {
	t       *transport
	cfg     config
	id      uint64
	name    string
	members []int // world rank of each member
	rank    int
	rec     *comm.Recorder

	// scratch is working memory of the ring reduce-scatter, kept from call
	// to call: collectives run one after another, each after the
	// previous one's writes finished, so one buffer serves them all.
	scratch []byte

	seq    uint64 // collectives issued, owned by the issuing goroutine
	last   *work  // the latest collective issued, owned likewise
	p2pSeq atomic.Uint64

	failure atomic.Pointer[comm.AbortError]
	failed  chan struct{}
	once    sync.Once
}

var _ comm.Communicator = (*Comm)(nil)

func newComm(t *transport, cfg config, id uint64, name string, members []int, rank int) *Comm {
	c := &Comm{
		t: t, cfg: cfg, id: id, name: name, members: members, rank: rank,
		rec: comm.NewRecorder("tcp "+name, rank, cfg.opts.RecorderSize), failed: make(chan struct{}),
	}
	t.register(c)
	return c
}

// scratchOf returns the communicator's scratch memory, at least n bytes,
// its contents undefined.
func (c *Comm) scratchOf(n int) []byte {
	if cap(c.scratch) < n {
		c.scratch = make([]byte, n)
	}
	return c.scratch[:n]
}

// Rank implements comm.Communicator.
func (c *Comm) Rank() int { return c.rank }

// Size implements comm.Communicator.
func (c *Comm) Size() int { return len(c.members) }

// Backend implements comm.Communicator; it returns "tcp".
func (c *Comm) Backend() string { return "tcp" }

// Recorder implements comm.Communicator.
func (c *Comm) Recorder() *comm.Recorder { return c.rec }

// Err implements comm.Communicator.
func (c *Comm) Err() error {
	if ae := c.failure.Load(); ae != nil {
		return ae
	}
	return nil
}

// Close closes the connections of the whole process (the world
// communicator and every one split from it), after the frames already
// queued. Peers see this rank leave without treating it as a failure, so
// call it once this rank's part is done; calls after Close fail.
func (c *Comm) Close() error {
	c.markAborted(&comm.AbortError{Rank: c.rank, Cause: errors.New("tcp: communicator closed")})
	c.t.close()
	return nil
}

// markAborted records ae as the communicator's failure, once.
func (c *Comm) markAborted(ae *comm.AbortError) bool {
	first := false
	c.once.Do(func() {
		c.failure.Store(ae)
		close(c.failed)
		first = true
	})
	return first
}

// Abort implements comm.Communicator: the abort notice goes to every
// member, whose pending and later calls then fail with it.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("aborted")
	}
	ae := &comm.AbortError{Rank: c.rank, Cause: cause}
	if !c.markAborted(ae) {
		return
	}
	note := encodeAbort(ae)
	for q, w := range c.members {
		if q != c.rank {
			c.t.post(w, kindAbort, c.id, 0, 0, note, true)
		}
	}
}

// failedErr returns the communicator's failure, taking the transport's
// when a connection was lost.
func (c *Comm) failedErr() *comm.AbortError {
	if ae := c.failure.Load(); ae != nil {
		return ae
	}
	if ae := c.t.err(); ae != nil {
		c.markAborted(ae)
		return c.failure.Load()
	}
	return nil
}

// work is an issued operation.
type work struct {
	c    *Comm
	done chan struct{}
	err  error
}

// Wait implements comm.Work. A ctx that ends first aborts the
// communicator, unless it was aborted already: then that abort is the
// error.
func (w *work) Wait(ctx context.Context) error {
	select {
	case <-w.done:
		return w.err
	case <-ctx.Done():
		select {
		case <-w.done:
			return w.err
		default:
		}
		if ae := w.c.failedErr(); ae != nil {
			return ae
		}
		w.c.Abort(ctx.Err())
		return w.c.failure.Load()
	}
}

func isDone(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// Done implements comm.Work.
func (w *work) Done() <-chan struct{} { return w.done }

// issue validates call and builds its execution.
func (c *Comm) issue(ctx context.Context, call comm.Call) (*exec, error) {
	call = call.ForRank(c.rank)
	if err := call.Validate(c.rank, c.Size()); err != nil {
		return nil, c.wrap(&call, 0, -1, err)
	}
	for _, b := range []comm.Buffer{call.Send, call.Recv} {
		if b != nil {
			if _, ok := b.(*comm.HostBuffer); !ok {
				return nil, c.wrap(&call, 0, -1, fmt.Errorf("%w: %s buffer: the tcp backend moves host memory only", comm.ErrUnsupported, b.Device()))
			}
		}
	}
	e := &exec{c: c, call: call, peer: -1}
	if call.Op.Collective() {
		algo, err := c.choose(&call)
		if err != nil {
			return nil, c.wrap(&call, 0, -1, err)
		}
		e.algo = algo
		e.seq = c.seq
		c.seq++
		f := comm.FingerprintOf(e.seq, &call)
		f.Algorithm = algo
		e.finger = f
		e.fp = fingerprintHash(f)
	} else {
		e.seq = c.p2pSeq.Add(1) - 1
		e.peer = call.Peer
		if call.Op == comm.OpRecv {
			e.ticket = c.t.ticket(mkey{comm: c.id, kind: kindP2P, key: uint64(int64(call.Tag)), src: c.members[call.Peer]})
		}
	}
	e.label = comm.LabelOf(ctx)
	e.recID = c.rec.BeginLabeled(e.label, e.seq, &call, e.algo)
	if err := ctx.Err(); err != nil {
		return e, e.finish(e.cancelled(err))
	}
	if ae := c.failedErr(); ae != nil {
		return e, e.finish(ae)
	}
	return e, nil
}

// Do implements comm.Communicator. A collective issued when the previous
// one has finished (and every point-to-point operation) runs on the
// calling goroutine: no handoff to a goroutine of its own and back.
func (c *Comm) Do(ctx context.Context, call comm.Call) error {
	if !call.Op.Collective() || c.last == nil || isDone(c.last.done) {
		e, err := c.issue(ctx, call)
		if err != nil {
			return err
		}
		if call.Op.Collective() {
			c.last = nil
		}
		e.deadline = time.Now().Add(c.cfg.opts.Timeout)
		if call.Op == comm.OpSend {
			e.posted = e.send(e.call.Peer, bytesOf(e.call.Send))
		}
		c.rec.Update(e.recID, comm.Started, nil)
		return e.finish(e.run(ctx))
	}
	w, err := c.Start(ctx, call)
	if err != nil {
		return err
	}
	return w.Wait(context.WithoutCancel(ctx))
}

// Start implements comm.Communicator. Collectives run in issue order, each
// after the previous one; point-to-point operations start at once.
func (c *Comm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	e, err := c.issue(ctx, call)
	if err != nil {
		return nil, err
	}
	w := &work{c: c, done: make(chan struct{})}
	var prev *work
	if call.Op.Collective() {
		prev, c.last = c.last, w
	}
	e.deadline = time.Now().Add(c.cfg.opts.Timeout)
	if call.Op == comm.OpSend {
		// Queued now, so that sends to one peer go out in issue order.
		e.posted = e.send(e.call.Peer, bytesOf(e.call.Send))
	}
	go func() {
		if prev != nil {
			<-prev.done
		}
		c.rec.Update(e.recID, comm.Started, nil)
		w.err = e.finish(e.run(ctx))
		close(w.done)
	}()
	return w, nil
}

// exec is one operation as it runs.
type exec struct {
	c        *Comm
	call     comm.Call
	algo     comm.Algorithm
	seq      uint64
	fp       uint64
	label    string
	peer     int
	ticket   int
	recID    uint64
	deadline time.Time
	posted   *outFrame // a Send's frame, queued at issue
	finger   comm.Fingerprint
	checking bool // exchanging fingerprints: frames on their own key, unhashed
}

// finish records the outcome and wraps an error with the call's identity.
func (e *exec) finish(err error) error {
	if err == nil {
		e.c.rec.Update(e.recID, comm.Completed, nil)
		return nil
	}
	e.c.rec.Update(e.recID, comm.Failed, err)
	var ce *comm.Error
	if errors.As(err, &ce) {
		return err
	}
	return e.c.wrapLabel(&e.call, e.seq, e.peer, e.label, err)
}

func (c *Comm) wrap(call *comm.Call, seq uint64, peer int, err error) error {
	return c.wrapLabel(call, seq, peer, "", err)
}

func (c *Comm) wrapLabel(call *comm.Call, seq uint64, peer int, label string, err error) error {
	e := &comm.Error{Backend: "tcp", Rank: c.rank, WorldRank: c.members[c.rank], Op: call.Op, Seq: seq, Label: label, Peer: peer, Err: err}
	if c.id != 0 {
		e.Comm = c.name
	}
	return e
}

// cancelled aborts the communicator because the caller's context ended;
// the result matches both the context's error and comm.ErrAborted.
func (e *exec) cancelled(err error) error {
	e.c.Abort(err)
	return e.c.failure.Load()
}

// timedOut aborts the communicator, blaming src (a rank of this
// communicator, -1 when unknown).
func (e *exec) timedOut(src int) error {
	te := &comm.TimeoutError{After: e.c.cfg.opts.Timeout}
	if src >= 0 {
		te.Late = []int{e.c.members[src]}
		te.Detail = fmt.Sprintf("waiting for rank %d", src)
		if w := e.c.members[src]; w != src {
			// A split's rank alone does not say which process to look at.
			te.Detail = fmt.Sprintf("waiting for rank %d (world rank %d)", src, w)
		}
	}
	e.c.Abort(te)
	return e.c.failure.Load()
}

// wait blocks until ch delivers, or the call fails.
func (e *exec) wait(ctx context.Context, ch <-chan struct{}, src int) error {
	select {
	case <-ch:
		return nil
	default:
	}
	if ae := e.c.failedErr(); ae != nil {
		return ae
	}
	timer := time.NewTimer(time.Until(e.deadline))
	defer timer.Stop()
	select {
	case <-ch:
		return nil
	case <-e.c.failed:
		return e.c.failure.Load()
	case <-e.c.t.dead:
		return e.c.failedErr()
	case <-ctx.Done():
		if ae := e.c.failedErr(); ae != nil {
			return ae
		}
		return e.cancelled(ctx.Err())
	case <-timer.C:
		return e.timedOut(src)
	}
}

// send queues data for rank dst of this communicator.
func (e *exec) send(dst int, data []byte) *outFrame {
	return e.sendSeg(dst, data, false)
}

// sendSeg is send for a segment of a message, more saying that more of
// it follows (collectives only).
func (e *exec) sendSeg(dst int, data []byte, more bool) *outFrame {
	kind, key := uint8(kindColl), e.seq
	if more {
		kind |= kindMore
	}
	if e.call.Op == comm.OpSend {
		kind, key = kindP2P, uint64(int64(e.call.Tag))
	}
	fp := e.fp
	if e.checking {
		key, fp = key|checkKey, 0
	}
	return e.c.t.post(e.c.members[dst], kind, e.c.id, key, fp, data, false)
}

// sent waits for the frames queued by send to be written; dst names the
// peer of each, for a timeout's blame.
func (e *exec) sent(ctx context.Context, fs []*outFrame, dsts []int) error {
	for i, f := range fs {
		if err := e.wait(ctx, f.done, dsts[i]); err != nil {
			return err
		}
		if f.err != nil {
			return e.c.failedErr()
		}
	}
	return nil
}

// pending is a receive whose place in its stream is reserved, and whose
// destination may be posted for the reader to fill in place.
type pending struct {
	k   mkey
	n   int
	src int // rank of this communicator
	ps  *recvPost
	dst []byte
	// more: the segment expected has more of its message after it
	// (kindMore).
	more bool
}

// expect reserves the next message of this operation from rank src of
// this communicator; with dst, the message is read straight into it when
// it arrives after this call (a receive posted before its frame comes:
// no pooled buffer, no copy). Receives from one rank are matched in the
// order expect is called.
func (e *exec) expect(src int, dst []byte) pending {
	k := mkey{comm: e.c.id, kind: kindColl, key: e.seq, src: e.c.members[src]}
	if e.checking {
		k.key |= checkKey
	}
	pd := pending{k: k, src: src, dst: dst}
	if e.call.Op == comm.OpRecv {
		pd.k.kind, pd.k.key, pd.n = kindP2P, uint64(int64(e.call.Tag)), e.ticket
		pd.ps = e.c.t.postAt(pd.k, pd.n, dst)
		return pd
	}
	pd.n, pd.ps = e.c.t.expect(pd.k, dst)
	return pd
}

// await returns the message pd reserved. When it landed in place, the
// returned slice is pd's destination (inPlace), not a pooled buffer. A
// message that is a segment with more to follow where pd expects none,
// or the reverse, is a length mismatch.
func (e *exec) await(ctx context.Context, pd pending) (b []byte, inPlace bool, err error) {
	for {
		m, ok, ch := e.c.t.poll(pd.k, pd.n)
		if ok {
			if m.fp != e.fp && !e.checking {
				err := fmt.Errorf("%w: rank %d issued a different collective at #%d (this rank issued %v)", comm.ErrMismatch, pd.src, e.seq, e.call.Op)
				e.c.Abort(err)
				return nil, false, e.c.failure.Load()
			}
			if m.more != pd.more {
				if !m.inPlace {
					e.c.t.release(m.data)
				}
				what := "longer" // a segment with more to follow where pd expects the last
				if pd.more {
					what = "shorter"
				}
				err := fmt.Errorf("%w: rank %d sent a %s message than this rank expects at #%d", comm.ErrMismatch, pd.src, what, e.seq)
				e.c.Abort(err)
				return nil, false, e.c.failure.Load()
			}
			return m.data, m.inPlace, nil
		}
		if err := e.wait(ctx, ch, pd.src); err != nil {
			if pd.ps != nil {
				// The caller's memory must be its own once this returns.
				e.c.t.unpost(pd.k, pd.n, pd.ps)
			}
			return nil, false, err
		}
	}
}

// recv returns the next message of this operation from rank src of this
// communicator, in a pooled buffer.
func (e *exec) recv(ctx context.Context, src int) ([]byte, error) {
	b, _, err := e.await(ctx, e.expect(src, nil))
	return b, err
}

// awaitInto waits for pd's message, which must be exactly len(pd.dst)
// bytes, and leaves it in pd.dst.
func (e *exec) awaitInto(ctx context.Context, pd pending) error {
	b, inPlace, err := e.await(ctx, pd)
	if err != nil {
		return err
	}
	if inPlace {
		return nil
	}
	return e.fill(pd.src, pd.dst, b)
}

// recvInto receives a message of exactly len(dst) bytes into dst.
func (e *exec) recvInto(ctx context.Context, src int, dst []byte) error {
	return e.awaitInto(ctx, e.expect(src, dst))
}

// fingerprintHash condenses what every rank must agree on into 8 bytes,
// carried by every collective frame.
func fingerprintHash(f comm.Fingerprint) uint64 {
	h := fnv.New64a()
	h.Write(encodeFingerprint(f))
	return h.Sum64() | 1 // p2p frames carry 0
}

// Split implements comm.Communicator. The members exchange (color, key)
// with an all-gather on this communicator; each part gets an id derived
// from this communicator's id, the split's sequence number and the color,
// the same on every member.
func (c *Comm) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	p := c.Size()
	mine := binary.LittleEndian.AppendUint64(nil, uint64(int64(color)))
	mine = binary.LittleEndian.AppendUint64(mine, uint64(int64(key)))
	all := make([]byte, 16*p)
	send, _ := comm.HostBytes(comm.Uint8, mine)
	recv, _ := comm.HostBytes(comm.Uint8, all)
	seq := c.seq
	w, err := c.startInternal(ctx, comm.Call{Op: comm.OpAllGather, Send: send, Recv: recv}, comm.OpSplit)
	if err != nil {
		return nil, err
	}
	if err := w.Wait(context.WithoutCancel(ctx)); err != nil {
		return nil, err
	}
	if color < 0 {
		return nil, nil
	}
	type m struct{ key, rank int }
	var part []m
	for r := range p {
		if int(int64(binary.LittleEndian.Uint64(all[16*r:]))) == color {
			part = append(part, m{int(int64(binary.LittleEndian.Uint64(all[16*r+8:]))), r})
		}
	}
	slices.SortFunc(part, func(a, b m) int {
		if a.key != b.key {
			return a.key - b.key
		}
		return a.rank - b.rank
	})
	members := make([]int, len(part))
	rank := -1
	for i, x := range part {
		members[i] = c.members[x.rank]
		if x.rank == c.rank {
			rank = i
		}
	}
	h := fnv.New64a()
	h.Write(binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, c.id), seq), uint64(int64(color))))
	id := h.Sum64() | 1 // the world is 0
	name := fmt.Sprintf("%s/split%d.c%d", c.name, seq, color)
	return newComm(c.t, c.cfg, id, name, members, rank), nil
}

// startInternal starts call but records and reports it as op.
func (c *Comm) startInternal(ctx context.Context, call comm.Call, op comm.Op) (comm.Work, error) {
	call.Algorithm = comm.Direct
	e, err := c.issue(ctx, call)
	if err != nil {
		return nil, err
	}
	e.call.Op = op
	w := &work{c: c, done: make(chan struct{})}
	prev := c.last
	c.last = w
	e.deadline = time.Now().Add(c.cfg.opts.Timeout)
	go func() {
		if prev != nil {
			<-prev.done
		}
		e.call.Op = comm.OpAllGather
		err := e.run(ctx)
		e.call.Op = op
		w.err = e.finish(err)
		close(w.done)
	}()
	return w, nil
}

// checkKey marks the frames of the fingerprint exchange, so that they
// never match a collective's data.
const checkKey = 1 << 63

// checkConsistency exchanges fingerprints with every member before data
// moves (comm.Options.ConsistencyCheck): every rank then sees the same
// calls and returns the same MismatchError when they differ.
func (e *exec) checkConsistency(ctx context.Context) error {
	p := e.c.Size()
	mine := encodeFingerprint(e.finger)
	calls := make([]comm.Fingerprint, p)
	calls[e.c.rank] = e.finger
	e.checking = true
	err := e.exchange(ctx, func(int) []byte { return mine }, func(q int, b []byte) error {
		f, ok := decodeFingerprint(b)
		if !ok {
			return e.lengthMismatch(q, len(b), len(mine))
		}
		calls[q] = f
		return nil
	})
	e.checking = false
	if err != nil {
		return err
	}
	for _, f := range calls {
		if !f.Matches(calls[0]) {
			me := &comm.MismatchError{Calls: calls}
			e.c.markAborted(&comm.AbortError{Rank: e.c.rank, Cause: me})
			return me
		}
	}
	return nil
}

func encodeFingerprint(f comm.Fingerprint) []byte {
	var b []byte
	for _, v := range []uint64{f.Seq, uint64(f.Op), uint64(f.DType), uint64(int64(f.Count)), uint64(int64(f.Root)), uint64(f.Reduce), uint64(f.Algorithm)} {
		b = binary.LittleEndian.AppendUint64(b, v)
	}
	return b
}

func decodeFingerprint(b []byte) (comm.Fingerprint, bool) {
	if len(b) != 56 {
		return comm.Fingerprint{}, false
	}
	u := func(i int) uint64 { return binary.LittleEndian.Uint64(b[8*i:]) }
	return comm.Fingerprint{
		Seq: u(0), Op: comm.Op(u(1)), DType: comm.DType(u(2)), Count: int(int64(u(3))),
		Root: int(int64(u(4))), Reduce: comm.ReduceOp(u(5)), Algorithm: comm.Algorithm(u(6)),
	}, true
}
