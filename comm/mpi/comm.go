//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// HardAbortEnv, set to 1 or true, makes Abort and timeouts end the whole
// job with MPI_Abort (see WithHardAbort).
const HardAbortEnv = "LOOM_MPI_HARD_ABORT"

// BlockingEnv, set to 1 or true, makes synchronous calls use MPI's
// blocking collectives (see WithBlockingCalls).
const BlockingEnv = "LOOM_MPI_BLOCKING"

// Option configures World (and, through inheritance, every communicator
// split from it).
type Option func(*config)

type config struct {
	opts        comm.Options
	optsSet     bool
	hardAbort   bool
	hardSet     bool
	blocking    bool
	blockingSet bool
}

// WithOptions sets the communicator options. Without it,
// comm.OptionsFromEnv supplies them. Options.Algorithms is ignored: MPI
// chooses its own algorithms.
func WithOptions(o comm.Options) Option {
	return func(c *config) { c.opts, c.optsSet = o, true }
}

// WithHardAbort makes Abort, and a call that times out or is cancelled,
// end the whole job with MPI_Abort after marking the communicator aborted
// and notifying the peers. Off by default (or per HardAbortEnv), so that
// a program can report the error and decide.
func WithHardAbort(on bool) Option {
	return func(c *config) { c.hardAbort, c.hardSet = on, true }
}

// WithBlockingCalls makes a synchronous collective (Do, and the comm
// helpers that call it) use MPI's blocking call (MPI_Allreduce rather than
// MPI_Iallreduce with polling) whenever no async collective is pending on
// the communicator and MPI provided MPI_THREAD_MULTIPLE. MPI's blocking
// collectives use its tuned algorithms and progress without polling, and
// are faster, most of all at large sizes.
//
// The price is recoverability: MPI cannot interrupt a blocking call. A
// watchdog honours the context, the timeout and aborts (local or a peer's)
// while the call runs, but it can only mark the communicator aborted,
// notify the peers, print the error (rank, op, sequence number) on stderr
// and, if the call still has not returned shortly after, end the whole job
// with MPI_Abort. Off by default (or per BlockingEnv).
func WithBlockingCalls(on bool) Option {
	return func(c *config) { c.blocking, c.blockingSet = on, true }
}

func configure(opts []Option) (config, error) {
	var cfg config
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if !cfg.optsSet {
		o, err := comm.OptionsFromEnv()
		if err != nil {
			return cfg, fmt.Errorf("mpi: %w", err)
		}
		cfg.opts = o
	}
	for _, f := range []struct {
		set bool
		v   *bool
		env string
	}{{cfg.hardSet, &cfg.hardAbort, HardAbortEnv}, {cfg.blockingSet, &cfg.blocking, BlockingEnv}} {
		if f.set {
			continue
		}
		switch v := os.Getenv(f.env); strings.ToLower(strings.TrimSpace(v)) {
		case "", "0", "false", "no", "off":
		case "1", "true", "yes", "on":
			*f.v = true
		default:
			return cfg, fmt.Errorf("mpi: %s: want 1 or 0, got %q", f.env, v)
		}
	}
	cfg.opts = cfg.opts.WithDefaults()
	return cfg, nil
}

// ctlBytes is the size of an abort notice: communicator id (8 bytes),
// length of the cause (4), the cause.
const ctlBytes = 1024

// Comm is one process's handle on an MPI communicator. It implements
// comm.Communicator. Issue calls on it from one goroutine at a time (their
// order is the sequence every rank must follow); Wait, Done, Abort, Err
// and Recorder may be used from any goroutine.
type Comm struct {
	h    C.MPI_Comm
	rank int
	size int
	name string
	uid  uint64
	cfg  config
	rec  *comm.Recorder

	seq    uint64 // collectives issued, owned by the issuing goroutine
	p2pSeq atomic.Uint64

	mu      *sync.Mutex // guards everything below and every MPI call on h
	queue   []*work     // collectives in issue order, not yet finished
	p2p     []*work     // point-to-point operations not yet finished
	orphans []*work     // abandoned after an abort, still posted in MPI
	driving bool        // a background driver goroutine is running
	freed   bool

	ctlReq    C.MPI_Request
	ctlBuf    unsafe.Pointer // C memory, ctlBytes
	ctlLive   bool
	ctlPolled time.Time // when progress last looked for a notice

	failure atomic.Pointer[comm.AbortError]
	failed  chan struct{}
	once    sync.Once

	// endJob ends the job when a blocking call cannot be interrupted
	// (see WithBlockingCalls); tests replace it.
	endJob func(error)

	sentry sentry // hands long blocking calls to a watchdog
}

var _ comm.Communicator = (*Comm)(nil)

// newComm wraps the MPI communicator h, which it owns from now on.
func newComm(h C.MPI_Comm, name string, uid uint64, cfg config) (*Comm, error) {
	c := &Comm{h: h, name: name, uid: uid, cfg: cfg, failed: make(chan struct{}), endJob: endJob}
	if serialized() {
		c.mu = &lib.serial
	} else {
		c.mu = new(sync.Mutex)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var rank, size C.int
	if err := ok(C.loom_set_errors_return(h), "MPI_Comm_set_errhandler"); err != nil {
		return nil, fmt.Errorf("mpi: %w", err)
	}
	if err := ok(C.MPI_Comm_rank(h, &rank), "MPI_Comm_rank"); err != nil {
		return nil, fmt.Errorf("mpi: %w", err)
	}
	if err := ok(C.MPI_Comm_size(h, &size), "MPI_Comm_size"); err != nil {
		return nil, fmt.Errorf("mpi: %w", err)
	}
	c.rank, c.size = int(rank), int(size)
	c.rec = comm.NewRecorder(name, c.rank, cfg.opts.RecorderSize)
	c.ctlBuf = C.malloc(ctlBytes)
	if err := c.postCtlLocked(); err != nil {
		C.free(c.ctlBuf)
		return nil, fmt.Errorf("mpi: %w", err)
	}
	lib.mu.Lock()
	lib.live[c] = true
	lib.mu.Unlock()
	return c, nil
}

// Rank implements comm.Communicator.
func (c *Comm) Rank() int { return c.rank }

// Size implements comm.Communicator.
func (c *Comm) Size() int { return c.size }

// Backend implements comm.Communicator; it returns "mpi".
func (c *Comm) Backend() string { return "mpi" }

// Recorder implements comm.Communicator.
func (c *Comm) Recorder() *comm.Recorder { return c.rec }

// Name identifies the communicator in errors and dumps ("world",
// "world/split3.c1").
func (c *Comm) Name() string { return c.name }

// Options returns the communicator's options, defaults filled in.
func (c *Comm) Options() comm.Options { return c.cfg.opts }

// Err implements comm.Communicator.
func (c *Comm) Err() error {
	if e := c.failure.Load(); e != nil {
		return e
	}
	return nil
}

// Abort implements comm.Communicator: it fails every pending and later call
// on this communicator with a *comm.AbortError carrying cause, and sends a
// notice to every peer so that theirs fail too. MPI cannot cancel posted
// collectives; they stay posted. With WithHardAbort it then ends the job
// with MPI_Abort.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("aborted")
	}
	c.mu.Lock()
	c.abortLocked(&comm.AbortError{Rank: c.rank, Cause: cause}, true)
	c.mu.Unlock()
	c.hardAbort()
}

func (c *Comm) hardAbort() {
	if c.cfg.hardAbort {
		C.MPI_Abort(C.loom_comm_world(), 1)
	}
}

// abortLocked marks the communicator aborted (the first abort wins), fails
// every pending operation with it, and with notify sends the notice to the
// peers.
func (c *Comm) abortLocked(e *comm.AbortError, notify bool) {
	first := false
	c.once.Do(func() {
		first = true
		c.failure.Store(e)
		close(c.failed)
	})
	if !first {
		return
	}
	e = c.failure.Load()
	for _, w := range c.queue {
		c.abandonLocked(w, c.wrap(w.op, w.seq, -1, e))
	}
	for _, w := range c.p2p {
		c.abandonLocked(w, c.wrap(w.op, w.seq, w.peer, e))
	}
	c.queue, c.p2p = nil, nil
	if notify && !c.freed {
		c.notifyLocked(e.Cause)
	}
}

// notifyLocked sends an abort notice to every peer on the reserved tag.
// The sends are fire-and-forget (MPI_Request_free) from C memory that is
// never freed: a few hundred bytes per abort.
func (c *Comm) notifyLocked(cause error) {
	msg := cause.Error()
	if len(msg) > ctlBytes-12 {
		msg = msg[:ctlBytes-12]
	}
	buf := C.malloc(ctlBytes)
	b := unsafe.Slice((*byte)(buf), ctlBytes)
	binary.LittleEndian.PutUint64(b[0:], c.uid)
	binary.LittleEndian.PutUint32(b[8:], uint32(len(msg)))
	copy(b[12:], msg)
	for q := 0; q < c.size; q++ {
		if q == c.rank {
			continue
		}
		var req C.MPI_Request
		if C.MPI_Isend(buf, C.int(12+len(msg)), C.loom_byte(), C.int(q), C.int(lib.tagUB), c.h, &req) == C.loom_success() {
			C.MPI_Request_free(&req)
		}
	}
}

// postCtlLocked posts the receive for abort notices.
func (c *Comm) postCtlLocked() error {
	c.ctlReq = C.loom_request_null()
	if err := ok(C.MPI_Irecv(c.ctlBuf, ctlBytes, C.loom_byte(), C.loom_any_source(), C.int(lib.tagUB), c.h, &c.ctlReq), "MPI_Irecv (abort notices)"); err != nil {
		return err
	}
	c.ctlLive = true
	return nil
}

// pollCtlLocked checks for an abort notice from a peer.
func (c *Comm) pollCtlLocked() {
	if !c.ctlLive {
		return
	}
	var flag C.int
	var st C.MPI_Status
	if C.MPI_Test(&c.ctlReq, &flag, &st) != C.loom_success() || flag == 0 {
		return
	}
	c.noticeLocked(&st)
}

// noticeLocked handles the completed notice receive, whose status is st:
// it aborts the communicator with the peer's cause, or reposts the
// receive for a notice meant for an earlier communicator.
func (c *Comm) noticeLocked(st *C.MPI_Status) {
	c.ctlLive = false
	b := unsafe.Slice((*byte)(c.ctlBuf), ctlBytes)
	var count C.int
	C.MPI_Get_count(st, C.loom_byte(), &count)
	if count < 12 || binary.LittleEndian.Uint64(b) != c.uid {
		// A notice for an earlier communicator that had this context id.
		// If reposting fails, ctlLive stays false: this rank no longer hears
		// peers' abort notices, and a peer's failure reaches it as a
		// timeout instead, which is slower but still an error.
		_ = c.postCtlLocked()
		return
	}
	n := min(int(binary.LittleEndian.Uint32(b[8:])), int(count)-12)
	cause := errors.New(string(b[12 : 12+n]))
	c.abortLocked(&comm.AbortError{Rank: int(st.MPI_SOURCE), Cause: cause}, false)
}

// Free releases the MPI communicator. It fails while async work is
// pending; after an abort it releases what it can and keeps the MPI
// communicator, which abandoned operations may still use. Later calls fail
// with comm.ErrInvalid.
func (c *Comm) Free() error {
	c.mu.Lock()
	pending := len(c.queue) + len(c.p2p)
	c.mu.Unlock()
	if pending > 0 {
		return fmt.Errorf("mpi: %w: Free with %d operations pending; wait for them first", comm.ErrInvalid, pending)
	}
	c.release()
	return nil
}

// release frees the communicator unless operations are stuck in it, and
// returns the number of stuck operations.
func (c *Comm) release() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reapOrphansLocked()
	if c.freed {
		return len(c.orphans)
	}
	for _, w := range append(c.queue, c.p2p...) {
		c.abandonLocked(w, c.wrap(w.op, w.seq, w.peer, fmt.Errorf("%w: communicator freed", comm.ErrInvalid)))
	}
	c.queue, c.p2p = nil, nil
	c.freed = true
	if c.ctlLive {
		C.loom_cancel_wait(&c.ctlReq)
		c.ctlLive = false
	}
	lib.mu.Lock()
	delete(lib.live, c)
	lib.mu.Unlock()
	if len(c.orphans) > 0 {
		return len(c.orphans)
	}
	c.releaseHandleLocked()
	return 0
}

// releaseHandleLocked frees the MPI communicator of a freed Comm whose
// abandoned operations have all completed.
func (c *Comm) releaseHandleLocked() {
	if c.ctlBuf == nil {
		return
	}
	C.free(c.ctlBuf)
	c.ctlBuf = nil
	C.MPI_Comm_free(&c.h)
}

// reapOrphansLocked releases abandoned operations that MPI has completed
// since (a peer may still have joined them).
func (c *Comm) reapOrphansLocked() {
	out := c.orphans[:0]
	for _, w := range c.orphans {
		var flag C.int
		if len(w.reqs) == 0 || (C.loom_testall(C.int(len(w.reqs)), &w.reqs[0], &flag) == C.loom_success() && flag != 0) {
			w.release()
			continue
		}
		out = append(out, w)
	}
	clear(c.orphans[len(out):])
	c.orphans = out
	if len(c.orphans) == 0 && c.freed {
		c.releaseHandleLocked()
	}
}

// Split implements comm.Communicator with MPI_Comm_split; a negative color
// becomes MPI_UNDEFINED and yields a nil Communicator. Every member first
// allgathers its (color, key) and call fingerprint, so that Split honours
// ctx and the timeout and reports mismatched calls; then MPI_Comm_split
// runs. The new communicator inherits this one's options and is named
// "<parent>/split<seq>.c<color>". Async work must be waited for first.
func (c *Comm) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	nc, err := c.SplitComm(ctx, color, key)
	if err != nil || nc == nil {
		return nil, err // a nil *Comm must not become a non-nil interface
	}
	return nc, nil
}

// SplitComm is Split with a concrete result type.
func (c *Comm) SplitComm(ctx context.Context, color, key int) (*Comm, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	call := comm.Call{Op: comm.OpSplit}
	c.mu.Lock()
	busy := len(c.queue) > 0
	freed := c.freed
	c.mu.Unlock()
	if e := c.failure.Load(); e != nil {
		return nil, c.wrap(comm.OpSplit, c.seq+1, -1, e)
	}
	if freed {
		return nil, c.errorf(comm.OpSplit, c.seq+1, -1, "%w: communicator freed", comm.ErrInvalid)
	}
	if busy {
		return nil, c.errorf(comm.OpSplit, c.seq+1, -1, "%w: Split while async work is pending; wait for it first", comm.ErrInvalid)
	}
	if err := ctx.Err(); err != nil {
		return nil, c.refuseEnded(&call, err)
	}
	c.seq++
	seq := c.seq
	w := c.newWork(ctx, &call, seq)
	fp := comm.FingerprintOf(seq, &call)
	if c.cfg.opts.ConsistencyCheck {
		fp.Site = callerSite()
	}
	w.steps = append(w.steps, c.fingerprintStep(fp, nil, color, key))
	c.enqueue(w, false)
	if err := w.Wait(ctx); err != nil {
		return nil, err
	}
	mcolor := C.int(color)
	if color < 0 {
		mcolor = C.loom_undefined()
	}
	var h C.MPI_Comm
	c.mu.Lock()
	rc := C.MPI_Comm_split(c.h, mcolor, C.int(key), &h)
	c.mu.Unlock()
	if rc != C.loom_success() {
		err := c.errorf(comm.OpSplit, seq, -1, "MPI_Comm_split: %w", mpiError(rc))
		c.rec.Update(w.id, comm.Failed, err)
		return nil, err
	}
	if color < 0 || C.loom_comm_is_null(h) != 0 {
		return nil, nil
	}
	nc, err := newComm(h, fmt.Sprintf("%s/split%d.c%d", c.name, seq, color), hashID(c.uid, "split", seq, color), c.cfg)
	if err != nil {
		return nil, c.wrap(comm.OpSplit, seq, -1, err)
	}
	return nc, nil
}

func (c *Comm) wrap(op comm.Op, seq uint64, peer int, err error) *comm.Error {
	e := &comm.Error{Backend: "mpi", Rank: c.rank, Op: op, Seq: seq, Peer: peer, Err: err}
	if c.rec != nil {
		if en, ok := c.rec.Find(seq, !op.Collective()); ok && en.Op == op.String() {
			e.Label = en.Label // the caller's WithLabel
		}
	}
	return e
}

func (c *Comm) errorf(op comm.Op, seq uint64, peer int, format string, args ...any) *comm.Error {
	return c.wrap(op, seq, peer, fmt.Errorf(format, args...))
}

// dump writes the flight recorder where the options say and returns a note
// for the error message.
func (c *Comm) dump(seq uint64) string {
	dir := c.cfg.opts.DumpDir
	if dir == "" {
		return " (flight recorder: Communicator.Recorder, or set " + comm.DumpDirEnv + ")"
	}
	prefix := fmt.Sprintf("loom_fr_%s_rank%d_seq%d", strings.ReplaceAll(c.name, "/", "_"), c.rank, seq)
	paths, err := c.rec.WriteFiles(dir, prefix)
	if err != nil {
		return fmt.Sprintf(" (flight recorder dump failed: %v)", err)
	}
	return fmt.Sprintf(" (flight recorder dumped to %s)", strings.Join(paths, ", "))
}

// callerSite returns file:line of the first caller outside loom's comm
// packages, for consistency-check reports.
func callerSite() string {
	pcs := make([]uintptr, 16)
	n := runtime.Callers(3, pcs)
	frames := runtime.CallersFrames(pcs[:n])
	for {
		f, more := frames.Next()
		if !strings.Contains(f.Function, "loom/comm.") && !strings.Contains(f.Function, "loom/comm/mpi.") {
			return fmt.Sprintf("%s:%d", f.File, f.Line)
		}
		if !more {
			return ""
		}
	}
}

// now is time.Now, kept separate for readability of deadline code.
func now() time.Time { return time.Now() }
