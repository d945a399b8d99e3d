package tcp

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// Frame kinds.
const (
	kindColl  = 1 // a collective's data: key is the sequence number
	kindP2P   = 2 // a Send's data: key is the tag
	kindAbort = 3 // an abort notice for the communicator
	kindBye   = 4 // the peer closes: its end of the stream is no failure

	// kindMore, or'ed into a collective's kind, says that the frame is a
	// segment of a message and more of it follows, so that a receiver
	// expecting another length learns so instead of taking a prefix.
	kindMore = 0x80
)

// headerBytes: kind (1), communicator id (8), key (8), fingerprint hash
// (8), payload length (8).
const headerBytes = 33

// maxPayload bounds a frame's payload; a longer one is garbage, not a
// reason to allocate.
const maxPayload = 1 << 40

// mkey addresses a stream of messages: one communicator, one kind, one key
// (sequence number or tag), from one world rank.
type mkey struct {
	comm uint64
	kind uint8
	key  uint64
	src  int
}

type message struct {
	fp   uint64
	data []byte
	// inPlace: data is the destination a receiver posted, filled by the
	// reader; it is the caller's memory, never released to the pool.
	inPlace bool
	more    bool // a segment with more of its message to follow (kindMore)
}

// queue holds the messages of one stream by arrival index; a receiver takes
// a ticket (the index it will consume) when it is issued, so that
// receives issued in order match sends in order.
type queue struct {
	arrived, tickets int
	msgs             map[int]message
	ch               chan struct{} // closed and replaced on each arrival
	// posts are the destinations receivers posted by ticket, for the
	// reader to fill in place instead of a pooled buffer.
	posts map[int]*recvPost
}

// recvPost is a receiver's destination for one message. The reader claims it
// (removing it from its queue's posts, under transport.mu) when it reads
// the frame's header, fills dst, delivers the message and closes done.
type recvPost struct {
	dst     []byte
	claimed bool          // under transport.mu
	done    chan struct{} // closed once the reader is done with dst
}

// outFrame is a frame waiting for its peer's writer.
type outFrame struct {
	hdr  [headerBytes]byte
	data []byte
	off  int           // bytes of hdr and data written already
	done chan struct{} // closed once written or failed
	err  error
}

func (f *outFrame) complete(err error) {
	f.err = err
	close(f.done)
}

// peer is the connection to one world rank. One goroutine at a time
// writes to conn (the one that set busy): the peer's writer, or a sender
// trying the direct path.
type peer struct {
	rank  int
	conn  net.Conn
	raw   syscall.RawConn // conn's descriptor for the direct path; nil: none
	mu    sync.Mutex
	queue []*outFrame
	busy  bool // a goroutine writes to conn
	wake  chan struct{}
}

// transport is the full mesh of one process, shared by the world
// communicator and every communicator split from it.
type transport struct {
	rank, size int
	peers      []*peer // by world rank; nil at rank

	mu      sync.Mutex
	queues  map[mkey]*queue
	comms   map[uint64]*Comm
	pending map[uint64]*comm.AbortError // aborts for communicators not yet made
	dead    chan struct{}
	deadErr *comm.AbortError
	closed  bool

	stopped  chan struct{} // closed when the connections are
	stopOnce sync.Once

	// counts of the fast paths taken, for tests: frames written whole by
	// their sender (direct), begun by it and finished by the writer
	// (partial), and received in place.
	direct, partial, inPlace atomic.Int64

	// bufs recycles the payload buffers of received frames by size class
	// (bufs[k] holds buffers of minPooled<<k bytes), so that a ring's
	// segments reuse memory instead of each costing an allocation and
	// its clearing.
	bufs [poolClasses]sync.Pool
}

// Payload buffers from minPooled to maxPooled bytes are pooled.
const (
	minPooled   = 4 << 10
	poolClasses = 7 // 4 KiB … 256 KiB
	maxPooled   = minPooled << (poolClasses - 1)
)

// poolClass returns the class of a payload of n bytes, -1 when such
// payloads are not pooled.
func poolClass(n int) int {
	if n <= 0 || n > maxPooled {
		return -1
	}
	k := 0
	for minPooled<<k < n {
		k++
	}
	return k
}

// getBuf returns a payload buffer of n bytes, recycled where one is free.
func (t *transport) getBuf(n int) []byte {
	k := poolClass(n)
	if k < 0 {
		return make([]byte, n)
	}
	if b, ok := t.bufs[k].Get().(*[]byte); ok {
		return (*b)[:n]
	}
	return make([]byte, n, minPooled<<k)
}

// release hands back a payload buffer the receiver is done with; only a
// message's data, once, and never while anything still reads it.
func (t *transport) release(b []byte) {
	k := poolClass(cap(b))
	if k < 0 || cap(b) != minPooled<<k {
		return
	}
	b = b[:cap(b)]
	t.bufs[k].Put(&b)
}

// directRead: a payload rest at least this long is read from the
// connection straight into its buffer, not through the bufio.Reader,
// which would copy every byte once more.
const directRead = 32 << 10

// readPayload fills data: first from what br holds already, then from
// conn directly when much is left.
func readPayload(br *bufio.Reader, conn io.Reader, data []byte) error {
	k := min(br.Buffered(), len(data))
	if k > 0 {
		// Served from br's buffer alone: it cannot fail.
		br.Read(data[:k])
	}
	rest := data[k:]
	if len(rest) < directRead {
		_, err := io.ReadFull(br, rest)
		return err
	}
	_, err := io.ReadFull(conn, rest)
	return err
}

func newTransport(rank, size int) *transport {
	return &transport{
		rank: rank, size: size, peers: make([]*peer, size),
		queues: map[mkey]*queue{}, comms: map[uint64]*Comm{},
		pending: map[uint64]*comm.AbortError{}, dead: make(chan struct{}), stopped: make(chan struct{}),
	}
}

// start runs the reader and writer of every connection.
func (t *transport) start() {
	for _, p := range t.peers {
		if p == nil {
			continue
		}
		p.wake = make(chan struct{}, 1)
		if sc, ok := p.conn.(syscall.Conn); ok && haveTryWrite {
			p.raw, _ = sc.SyscallConn()
		}
		go t.readLoop(p)
		go t.writeLoop(p)
	}
}

// fail aborts every communicator of the process: a connection is lost or
// carried garbage, so no collective can complete any more.
func (t *transport) fail(peerRank int, err error) {
	t.failWith(peerRank, peerFailure(peerRank, err))
}

// failGarbage is fail for a peer whose frames are garbage: its connection
// still reads, so it is told too. Otherwise it would see only the closed
// connection, and its notice to the others ("rank R: connection closed")
// could reach them before this rank's and blame the wrong rank.
func (t *transport) failGarbage(peerRank int, err error) {
	t.failWith(-1, peerFailure(peerRank, err))
}

func peerFailure(peerRank int, err error) *comm.AbortError {
	return &comm.AbortError{Rank: peerRank, Cause: fmt.Errorf("%w: rank %d: %w", ErrPeer, peerRank, err)}
}

// failWith records ae as the process's failure, tells every other peer
// (so that every rank names the peer at fault, not the rank that saw it),
// and closes the connections once the notices are out or closeGrace has
// passed. faulty is the peer not told, -1 for none.
func (t *transport) failWith(faulty int, ae *comm.AbortError) {
	t.mu.Lock()
	if t.deadErr != nil || t.closed {
		t.mu.Unlock()
		return
	}
	var fs []*outFrame
	note := encodeAbort(ae)
	for _, p := range t.peers {
		if p != nil && p.rank != faulty {
			fs = append(fs, t.postLocked(p, kindAbort, allComms, 0, 0, note, true))
		}
	}
	t.deadErr = ae
	close(t.dead)
	t.mu.Unlock()
	go func() {
		timeout := time.After(closeGrace)
		for _, f := range fs {
			select {
			case <-f.done:
			case <-timeout:
			}
		}
		t.shut()
	}()
}

// allComms, as the communicator id of an abort notice, means the whole
// process: the sender lost a peer.
const allComms = ^uint64(0)

// shut closes every connection, which ends the readers and writers.
func (t *transport) shut() {
	t.stopOnce.Do(func() { close(t.stopped) })
	for _, p := range t.peers {
		if p != nil {
			p.conn.Close()
		}
	}
}

// err returns the transport's failure, or nil.
func (t *transport) err() *comm.AbortError {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.deadErr
}

// close says goodbye to every peer after the frames already queued, then
// shuts the connections without reporting a failure.
func (t *transport) close() {
	var fs []*outFrame
	for _, p := range t.peers {
		if p != nil {
			fs = append(fs, t.post(p.rank, kindBye, 0, 0, 0, nil, false))
		}
	}
	for _, f := range fs {
		select {
		case <-f.done:
		case <-time.After(closeGrace):
		}
	}
	t.mu.Lock()
	t.closed = true
	t.mu.Unlock()
	t.shut()
}

// writeFailGrace bounds how long a failed write waits for a peer's
// notice before reporting the connection as lost.
const writeFailGrace = 250 * time.Millisecond

// closeGrace bounds how long close waits for a peer to take its goodbye.
const closeGrace = 5 * time.Second

func (t *transport) queueLocked(k mkey) *queue {
	q := t.queues[k]
	if q == nil {
		q = &queue{msgs: map[int]message{}, ch: make(chan struct{})}
		t.queues[k] = q
	}
	return q
}

// ticket reserves the next message of stream k for one receiver.
func (t *transport) ticket(k mkey) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.queueLocked(k)
	q.tickets++
	return q.tickets - 1
}

// poll returns message n of stream k if it has arrived, and otherwise a
// channel closed at the next arrival.
func (t *transport) poll(k mkey, n int) (message, bool, <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.queueLocked(k)
	if m, ok := q.msgs[n]; ok {
		delete(q.msgs, n)
		// A post the reader did not take (posted too late, or of another
		// length) is stale now.
		delete(q.posts, n)
		if len(q.msgs) == 0 && len(q.posts) == 0 && q.arrived == q.tickets && n == q.arrived-1 {
			delete(t.queues, k) // drained: keep the map small
		}
		return m, true, nil
	}
	return message{}, false, q.ch
}

// expect reserves the next message of stream k, like ticket, and when dst
// is not empty and the message has not begun to arrive posts dst for the
// reader to fill in place; the post is nil otherwise.
func (t *transport) expect(k mkey, dst []byte) (int, *recvPost) {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.queueLocked(k)
	q.tickets++
	n := q.tickets - 1
	return n, t.postRecvLocked(q, n, dst)
}

// postAt posts dst for message n of stream k, whose ticket was taken
// before (a Recv's, at issue).
func (t *transport) postAt(k mkey, n int, dst []byte) *recvPost {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.postRecvLocked(t.queueLocked(k), n, dst)
}

func (t *transport) postRecvLocked(q *queue, n int, dst []byte) *recvPost {
	// Message q.arrived may be on its way into a pooled buffer already:
	// a post for it is simply not claimed, and the receiver copies.
	if len(dst) == 0 || n < q.arrived {
		return nil
	}
	if q.posts == nil {
		q.posts = map[int]*recvPost{}
	}
	ps := &recvPost{dst: dst, done: make(chan struct{})}
	q.posts[n] = ps
	return ps
}

// claim takes the post of the next message of stream k for the reader,
// when one of n bytes is posted.
func (t *transport) claim(k mkey, n uint64) *recvPost {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.queueLocked(k)
	ps := q.posts[q.arrived]
	if ps == nil || uint64(len(ps.dst)) != n {
		return nil
	}
	delete(q.posts, q.arrived)
	ps.claimed = true
	return ps
}

// unpost withdraws a receiver's post after its receive failed. It
// returns once the reader no longer touches ps.dst, so that the caller's
// memory is its own again: at once when the reader never claimed it, and
// otherwise when the reader's frame is complete, or, after
// writeFailGrace, when the connection's reads are cut short (the stream
// is mid-frame and cannot go on; the transport fails).
func (t *transport) unpost(k mkey, n int, ps *recvPost) {
	t.mu.Lock()
	claimed := ps.claimed
	if q := t.queues[k]; q != nil && q.posts[n] == ps {
		delete(q.posts, n)
	}
	t.mu.Unlock()
	if !claimed {
		return
	}
	select {
	case <-ps.done:
		return
	case <-time.After(writeFailGrace):
	}
	t.peers[k.src].conn.SetReadDeadline(time.Now())
	<-ps.done
}

func (t *transport) deliver(k mkey, m message) {
	t.mu.Lock()
	defer t.mu.Unlock()
	q := t.queueLocked(k)
	q.msgs[q.arrived] = m
	q.arrived++
	close(q.ch)
	q.ch = make(chan struct{})
}

func (t *transport) readLoop(p *peer) {
	br := bufio.NewReaderSize(p.conn, 64<<10)
	var hdr [headerBytes]byte
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			t.fail(p.rank, connErr(err))
			return
		}
		kind, id := hdr[0], binary.LittleEndian.Uint64(hdr[1:])
		more := kind == kindColl|kindMore
		if more {
			kind = kindColl
		}
		key, fp := binary.LittleEndian.Uint64(hdr[9:]), binary.LittleEndian.Uint64(hdr[17:])
		n := binary.LittleEndian.Uint64(hdr[25:])
		if kind < kindColl || kind > kindBye || n > maxPayload {
			t.failGarbage(p.rank, fmt.Errorf("garbage frame (kind %d, length %d)", kind, n))
			// Keep reading (and dropping) until shut closes the connection:
			// unread bytes at close would reset it, and the reset could
			// destroy the notice before the peer reads it.
			io.Copy(io.Discard, br)
			return
		}
		k := mkey{comm: id, kind: kind, key: key, src: p.rank}
		var ps *recvPost
		var data []byte
		if kind == kindColl || kind == kindP2P {
			ps = t.claim(k, n)
		}
		if ps != nil {
			data = ps.dst
		} else {
			data = t.getBuf(int(n))
		}
		if err := readPayload(br, p.conn, data); err != nil {
			if ps != nil {
				close(ps.done)
			}
			t.fail(p.rank, connErr(err))
			return
		}
		if ps != nil {
			t.inPlace.Add(1)
			t.deliver(k, message{fp: fp, data: data, inPlace: true, more: more})
			close(ps.done)
			continue
		}
		if kind == kindBye {
			return
		}
		if kind == kindAbort {
			ae, err := decodeAbort(data)
			if err != nil {
				t.failGarbage(p.rank, fmt.Errorf("garbage abort frame: %w", err))
				return
			}
			if id == allComms {
				t.failWith(p.rank, ae)
				continue
			}
			t.remoteAbort(id, ae)
			continue
		}
		t.deliver(k, message{fp: fp, data: data, more: more})
	}
}

// connErr says "connection closed" for every way a peer's end can vanish,
// so that a killed peer reads the same whether its end was seen by a read
// or by a write.
func connErr(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return errors.New("connection closed")
	}
	if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
		return fmt.Errorf("connection closed: %w", err)
	}
	return err
}

func (t *transport) remoteAbort(id uint64, ae *comm.AbortError) {
	t.mu.Lock()
	c := t.comms[id]
	if c == nil {
		if t.pending[id] == nil {
			t.pending[id] = ae
		}
	}
	t.mu.Unlock()
	if c != nil {
		c.markAborted(ae)
	}
}

// register makes c reachable by abort notices, and applies one that came
// before it.
func (t *transport) register(c *Comm) {
	t.mu.Lock()
	t.comms[c.id] = c
	ae := t.pending[c.id]
	delete(t.pending, c.id)
	t.mu.Unlock()
	if ae != nil {
		c.markAborted(ae)
	}
}

func (t *transport) writeLoop(p *peer) {
	for {
		p.mu.Lock()
		for len(p.queue) == 0 || p.busy {
			p.mu.Unlock()
			select {
			case <-p.wake:
			case <-t.stopped:
				t.drain(p)
				return
			}
			p.mu.Lock()
		}
		f := p.queue[0]
		p.queue[0] = nil
		p.queue = p.queue[1:]
		p.busy = true
		p.mu.Unlock()
		err := f.writeRest(p.conn)
		p.mu.Lock()
		p.busy = false
		p.mu.Unlock()
		if err != nil {
			// A peer that failed closes its connections right after its
			// notices are out, and a write racing that close fails first:
			// give this rank's readers a moment to take the notice, which
			// names the rank at fault, before blaming this peer.
			select {
			case <-t.dead:
			case <-time.After(writeFailGrace):
			}
			t.fail(p.rank, connErr(err))
			f.complete(t.err())
			t.drain(p)
			return
		}
		f.complete(nil)
	}
}

// drain fails every frame still queued for p.
func (t *transport) drain(p *peer) {
	p.mu.Lock()
	q := p.queue
	p.queue = nil
	p.mu.Unlock()
	for _, f := range q {
		f.complete(t.err())
	}
}

// writeRest writes what is left of f to conn, blocking until it is all
// written or the write fails.
func (f *outFrame) writeRest(conn net.Conn) error {
	var bufs net.Buffers
	if f.off < headerBytes {
		bufs = net.Buffers{f.hdr[f.off:], f.data}
	} else {
		bufs = net.Buffers{f.data[f.off-headerBytes:]}
	}
	n, err := bufs.WriteTo(conn)
	f.off += int(n)
	return err
}

// post queues a frame for world rank dst; its done channel is closed once
// it is written. Frames to one peer are written in the order posted;
// urgent frames (abort notices) jump the queue. A frame that finds its
// peer's queue empty and no write in progress is written by the calling
// goroutine as far as the socket takes it without blocking (the direct
// path: one system call, no handoff to the writer and back); the writer
// finishes what the socket did not take.
func (t *transport) post(dst int, kind uint8, id, key, fp uint64, data []byte, urgent bool) *outFrame {
	t.mu.Lock()
	if ae := t.deadErr; ae != nil {
		t.mu.Unlock()
		f := &outFrame{done: make(chan struct{})}
		f.complete(ae)
		return f
	}
	p := t.peers[dst]
	if urgent || p.raw == nil {
		defer t.mu.Unlock()
		return t.postLocked(p, kind, id, key, fp, data, urgent)
	}
	t.mu.Unlock()
	f := newFrame(kind, id, key, fp, data)
	p.mu.Lock()
	if len(p.queue) > 0 || p.busy {
		p.queue = append(p.queue, f)
		p.mu.Unlock()
		p.kick()
		return f
	}
	p.busy = true
	p.mu.Unlock()
	done := f.tryWrite(p.raw)
	p.mu.Lock()
	p.busy = false
	if !done {
		// The rest goes first: frames are not interleaved.
		p.queue = append([]*outFrame{f}, p.queue...)
	}
	more := len(p.queue) > 0
	p.mu.Unlock()
	if done {
		t.direct.Add(1)
		f.complete(nil)
	} else {
		t.partial.Add(1)
	}
	if more {
		p.kick()
	}
	return f
}

func newFrame(kind uint8, id, key, fp uint64, data []byte) *outFrame {
	f := &outFrame{data: data, done: make(chan struct{})}
	f.hdr[0] = kind
	binary.LittleEndian.PutUint64(f.hdr[1:], id)
	binary.LittleEndian.PutUint64(f.hdr[9:], key)
	binary.LittleEndian.PutUint64(f.hdr[17:], fp)
	binary.LittleEndian.PutUint64(f.hdr[25:], uint64(len(data)))
	return f
}

// kick wakes p's writer.
func (p *peer) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (t *transport) postLocked(p *peer, kind uint8, id, key, fp uint64, data []byte, urgent bool) *outFrame {
	f := newFrame(kind, id, key, fp, data)
	p.mu.Lock()
	switch {
	case !urgent:
		p.queue = append(p.queue, f)
	case len(p.queue) > 0 && p.queue[0].off > 0:
		// The head is partly written: its rest must come first.
		p.queue = slices.Insert(p.queue, 1, f)
	default:
		p.queue = append([]*outFrame{f}, p.queue...)
	}
	p.mu.Unlock()
	p.kick()
	return f
}

// encodeAbort serialises an abort notice: the aborting rank, and a
// TimeoutError's facts when the cause is one, so that LateRanks works on
// every rank.
func encodeAbort(ae *comm.AbortError) []byte {
	var te *comm.TimeoutError
	late, after, detail := []int(nil), int64(0), ""
	isTimeout := errors.As(ae.Cause, &te)
	if isTimeout {
		late, after, detail = te.Late, int64(te.After), te.Detail
	}
	msg := ae.Cause.Error()
	b := binary.LittleEndian.AppendUint32(nil, uint32(int32(ae.Rank)))
	flag := byte(0)
	if isTimeout {
		flag = 1
	}
	for i, k := range carriedKinds {
		if errors.Is(ae.Cause, k) {
			flag |= 2 << i
		}
	}
	b = append(b, flag)
	b = binary.LittleEndian.AppendUint64(b, uint64(after))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(late)))
	for _, r := range late {
		b = binary.LittleEndian.AppendUint32(b, uint32(r))
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(detail)))
	b = append(b, detail...)
	return append(b, msg...)
}

func decodeAbort(b []byte) (*comm.AbortError, error) {
	if len(b) < 17 {
		return nil, errors.New("short notice")
	}
	rank := int(int32(binary.LittleEndian.Uint32(b)))
	flag := b[4]
	after := int64(binary.LittleEndian.Uint64(b[5:]))
	nl := int(binary.LittleEndian.Uint32(b[13:]))
	b = b[17:]
	if nl < 0 || nl > len(b)/4 {
		return nil, errors.New("bad rank list")
	}
	late := make([]int, nl)
	for i := range late {
		late[i] = int(binary.LittleEndian.Uint32(b[4*i:]))
	}
	b = b[4*nl:]
	if len(b) < 4 {
		return nil, errors.New("short notice")
	}
	nd := int(binary.LittleEndian.Uint32(b))
	b = b[4:]
	if nd < 0 || nd > len(b) {
		return nil, errors.New("bad detail")
	}
	detail, msg := string(b[:nd]), string(b[nd:])
	var cause error = errors.New(msg)
	if flag&1 != 0 {
		cause = &comm.TimeoutError{After: durationOf(after), Late: late, Detail: detail}
	} else if flag != 0 {
		re := &remoteError{msg: msg}
		for i, k := range carriedKinds {
			if flag&(2<<i) != 0 {
				re.kinds = append(re.kinds, k)
			}
		}
		cause = re
	}
	return &comm.AbortError{Rank: rank, Cause: cause}, nil
}

// carriedKinds are the sentinels an abort notice carries across, so that
// errors.Is finds them on every rank.
var carriedKinds = []error{ErrPeer, comm.ErrMismatch, context.Canceled, context.DeadlineExceeded}

// remoteError is a peer's abort cause: its text, and the sentinels it
// matched there.
type remoteError struct {
	msg   string
	kinds []error
}

func (e *remoteError) Error() string { return e.msg }

// Unwrap returns the sentinels the cause matched on the aborting rank.
func (e *remoteError) Unwrap() []error { return e.kinds }
