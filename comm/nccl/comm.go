package nccl

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
)

// Store is the part of a key-value store that bootstraps communicators:
// rank 0 publishes the NCCL unique id, the others read it, and every rank
// watches one key for abort notices from its peers. *rendezvous.Client
// implements it. Get blocks until the key exists or ctx ends.
type Store interface {
	Set(ctx context.Context, key string, value []byte) error
	Get(ctx context.Context, key string) ([]byte, error)
}

// Option configures a communicator.
type Option func(*commConfig)

type commConfig struct {
	opts    comm.Options
	optsSet bool
	nccl    Config
	stream  *cuda.Stream
	name    string
	onSplit func(*Comm) // tests: sees every communicator Split creates
}

// WithOptions sets the communicator options (timeout, consistency check,
// recorder size, dump folder). Without it comm.OptionsFromEnv supplies
// them. Options.Algorithms and Options.CostModel are ignored: NCCL chooses
// its own algorithms.
func WithOptions(o comm.Options) Option {
	return func(c *commConfig) { c.opts, c.optsSet = o, true }
}

// WithConfig sets the ncclConfig_t fields (see Config).
func WithConfig(cfg Config) Option {
	return func(c *commConfig) { c.nccl = cfg }
}

// WithStream makes the communicator issue its work on s, a stream of the
// communicator's device context, which the caller owns and must keep open
// until the communicator is closed. Without it each communicator creates
// a nonblocking stream of its own.
func WithStream(s *cuda.Stream) Option {
	return func(c *commConfig) { c.stream = s }
}

// WithName names the communicator in errors and flight-recorder dumps
// (default: the store key, or "nccl").
func WithName(name string) Option {
	return func(c *commConfig) { c.name = name }
}

func resolve(opts []Option) (commConfig, error) {
	var cfg commConfig
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if !cfg.optsSet {
		o, err := comm.OptionsFromEnv()
		if err != nil {
			return cfg, fmt.Errorf("nccl: %w", err)
		}
		cfg.opts = o
	}
	cfg.opts = cfg.opts.WithDefaults()
	return cfg, nil
}

// Comm is one rank's handle on an NCCL communicator. It implements
// comm.Communicator. Issue calls on it from one goroutine at a time (their
// order is the sequence every rank must follow); Wait, Done, Abort, Err,
// Recorder and Close may be used from any goroutine.
type Comm struct {
	lib       *Library
	dev       *cuda.Context
	devName   string // "cuda:N", the Device() of the buffers it takes unstaged
	h         uintptr
	rank      int
	size      int
	name      string
	cfg       commConfig
	rec       *comm.Recorder
	stream    *cuda.Stream
	ownStream bool
	barrier   cuda.Buffer // one float32 of device memory for Barrier
	store     Store
	key       string
	pin       runtime.Pinner

	// issueMu serialises everything that issues work to NCCL or ends the
	// communicator: Start, flushes of point-to-point work, Split, Close
	// and ncclCommAbort. It is taken before mu.
	issueMu sync.Mutex
	seq     uint64 // collectives issued
	p2pSeq  uint64 // point-to-point operations issued

	// mu guards the fields below; progress runs under it.
	mu      sync.Mutex
	queue   []*work // issued, not finished, in issue order
	batch   []*work // point-to-point work not yet issued to NCCL
	orphans []*work // failed while device work may still use their memory
	doomed  []*work // to fail, with their own cause, once the abort is done
	events  []*cuda.Event
	done    *cuda.Event // never recorded: the Event of work with none
	driving bool
	closed  bool
	gone    bool // ncclCommAbort or ncclCommDestroy has freed h
	// aborted: the abort is done (ncclCommAbort has returned, unless Close
	// had freed the communicator first) and pending work has failed.
	aborted bool

	failure   atomic.Pointer[comm.AbortError]
	failed    chan struct{}
	abortDone chan struct{} // closed with aborted set
	failOnce  sync.Once
	stopWatch context.CancelFunc
}

var (
	_ comm.Communicator = (*Comm)(nil)
	_ device.StreamComm = (*Comm)(nil)
	_ device.EventWork  = (*work)(nil)
)

// NewComm creates rank's member of a communicator of size ranks on dev, a
// context opened with l.Driver(), bootstrapping through store: rank 0 creates an NCCL unique id and sets
// it at key+"/id"; the other ranks get it from there. key must be unique
// to this communicator (a fresh one per job and per communicator).
// Every rank then runs ncclCommInitRankConfig, which returns once all
// size ranks have joined, the context ends or the timeout passes. The
// communicator also watches key+"/abort", so that an Abort on any rank
// fails the others promptly.
func (l *Library) NewComm(ctx context.Context, dev *cuda.Context, store Store, key string, rank, size int, opts ...Option) (*Comm, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if dev == nil || store == nil || key == "" {
		return nil, fmt.Errorf("nccl: %w: NewComm needs a device, a store and a key", comm.ErrInvalid)
	}
	if err := l.own(dev); err != nil {
		return nil, err
	}
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("nccl: %w: rank %d of %d", comm.ErrInvalid, rank, size)
	}
	cfg, err := resolve(opts)
	if err != nil {
		return nil, err
	}
	var id UniqueID
	if rank == 0 {
		if id, err = l.UniqueID(); err != nil {
			return nil, fmt.Errorf("nccl: rank 0: %w", err)
		}
		if err := store.Set(ctx, key+"/id", id[:]); err != nil {
			return nil, fmt.Errorf("nccl: rank 0: publishing the unique id: %w", err)
		}
	} else {
		gctx, cancel := context.WithTimeout(ctx, cfg.opts.Timeout)
		b, err := store.Get(gctx, key+"/id")
		cancel()
		if err != nil {
			return nil, fmt.Errorf("nccl: rank %d: reading the unique id from rank 0: %w", rank, err)
		}
		if len(b) != UniqueIDBytes {
			return nil, fmt.Errorf("nccl: rank %d: %w: the unique id at %q has %d bytes, want %d", rank, comm.ErrInvalid, key+"/id", len(b), UniqueIDBytes)
		}
		copy(id[:], b)
	}
	if cfg.name == "" {
		cfg.name = key
	}
	return l.newFromID(ctx, dev, id, rank, size, cfg, store, key)
}

// NewCommFromID creates rank's member of a communicator of size ranks on
// dev from a unique id that the caller distributed itself. See NewComm.
func (l *Library) NewCommFromID(ctx context.Context, dev *cuda.Context, id UniqueID, rank, size int, opts ...Option) (*Comm, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if dev == nil {
		return nil, fmt.Errorf("nccl: %w: nil device", comm.ErrInvalid)
	}
	if err := l.own(dev); err != nil {
		return nil, err
	}
	if size < 1 || rank < 0 || rank >= size {
		return nil, fmt.Errorf("nccl: %w: rank %d of %d", comm.ErrInvalid, rank, size)
	}
	cfg, err := resolve(opts)
	if err != nil {
		return nil, err
	}
	if cfg.name == "" {
		cfg.name = "nccl"
	}
	return l.newFromID(ctx, dev, id, rank, size, cfg, nil, "")
}

// own checks that dev is a context of l's driver binding and that a
// WithStream stream is one of dev's.
func (l *Library) own(dev *cuda.Context) error {
	if dev.Lib() != l.cu {
		return fmt.Errorf("nccl: %w: device %d was opened with another *cuda.Lib than the Library's Driver()", comm.ErrInvalid, dev.Ordinal())
	}
	return nil
}

func (l *Library) newFromID(ctx context.Context, dev *cuda.Context, id UniqueID, rank, size int, cfg commConfig, store Store, key string) (*Comm, error) {
	if cfg.stream != nil && cfg.stream.Context() != dev {
		return nil, fmt.Errorf("nccl: %w: the WithStream stream is not a stream of device %d's context", comm.ErrInvalid, dev.Ordinal())
	}
	c := &Comm{lib: l, dev: dev, devName: deviceName(dev), rank: rank, size: size, name: cfg.name, cfg: cfg, store: store, key: key, failed: make(chan struct{}), abortDone: make(chan struct{})}
	fail := func(err error) (*Comm, error) {
		c.pin.Unpin()
		return nil, fmt.Errorf("nccl: creating communicator %q (rank %d of %d): %w", c.name, rank, size, err)
	}
	raw, err := l.layout.encode(&cfg.nccl, &c.pin)
	if err != nil {
		return fail(err)
	}
	c.pin.Pin(&raw[0])
	var rc int32
	err = dev.Run(func() error {
		rc = l.initRank(&c.h, int32(size), &id, int32(rank), unsafe.Pointer(&raw[0]))
		return nil
	})
	runtime.KeepAlive(raw)
	if err != nil {
		return fail(err)
	}
	deadline := time.Now().Add(cfg.opts.Timeout)
	// On a failed init, ncclCommAbort only frees what NCCL allocated; its
	// result code adds nothing to the init error returned.
	if rc != int32(Success) && rc != int32(InProgress) {
		err := l.ncclError("ncclCommInitRankConfig", rc, c.h)
		if c.h != 0 {
			l.nc.commAbort(c.h)
		}
		return fail(err)
	}
	if err := settle(ctx, l, c.h, "ncclCommInitRankConfig", deadline, nil); err != nil {
		if c.h != 0 {
			l.nc.commAbort(c.h)
		}
		return fail(err)
	}
	if err := c.setup(); err != nil {
		return fail(err)
	}
	return c, nil
}

// setup checks the new communicator's rank and size and creates what it
// needs beside the NCCL communicator: recorder, stream, barrier word and
// the abort watcher. On failure it aborts h.
func (c *Comm) setup() error {
	l := c.lib
	var n, r int32
	// bad undoes a half-made communicator; what fails while undoing is
	// joined to err, the reason it is undone.
	bad := func(err error) error {
		c.mu.Lock()
		c.gone = true
		c.mu.Unlock()
		errs := []error{err}
		if rc := l.nc.commAbort(c.h); rc != int32(Success) {
			errs = append(errs, l.ncclError("ncclCommAbort", rc, 0))
		}
		if c.ownStream {
			errs = append(errs, c.stream.Close())
		}
		errs = append(errs, c.dev.Free(c.barrier), c.done.Close())
		return errors.Join(errs...)
	}
	if rc := l.nc.commCount(c.h, &n); rc != 0 {
		return bad(l.ncclError("ncclCommCount", rc, c.h))
	}
	if rc := l.nc.commUserRank(c.h, &r); rc != 0 {
		return bad(l.ncclError("ncclCommUserRank", rc, c.h))
	}
	if int(n) != c.size || int(r) != c.rank {
		return bad(fmt.Errorf("%w: NCCL reports rank %d of %d, want %d of %d", comm.ErrInvalid, r, n, c.rank, c.size))
	}
	c.rec = comm.NewRecorder(c.name, c.rank, c.cfg.opts.RecorderSize)
	if c.cfg.stream != nil {
		c.stream = c.cfg.stream
	} else {
		s, err := c.dev.NewStream()
		if err != nil {
			return bad(err)
		}
		c.stream, c.ownStream = s, true
	}
	b, err := c.dev.Alloc(4)
	if err != nil {
		return bad(err)
	}
	c.barrier = b
	if c.done, err = c.dev.NewEvent(false); err != nil {
		return bad(err)
	}
	if c.store != nil {
		wctx, cancel := context.WithCancel(context.Background())
		c.stopWatch = cancel
		go c.watch(wctx)
	}
	return nil
}

// Rank implements comm.Communicator.
func (c *Comm) Rank() int { return c.rank }

// Size implements comm.Communicator.
func (c *Comm) Size() int { return c.size }

// Backend implements comm.Communicator; it returns "nccl".
func (c *Comm) Backend() string { return "nccl" }

// Recorder implements comm.Communicator.
func (c *Comm) Recorder() *comm.Recorder { return c.rec }

// Name identifies the communicator in errors and dumps.
func (c *Comm) Name() string { return c.name }

// Options returns the communicator's options, defaults filled in.
func (c *Comm) Options() comm.Options { return c.cfg.opts }

// Device returns the device context the communicator runs on.
func (c *Comm) Device() *cuda.Context { return c.dev }

// Stream returns the stream the communicator issues its work on. Device
// buffers are read and written in that stream's order: work the caller
// enqueued elsewhere must be ordered before (Stream.WaitEvent, or
// device.BeforeCollective) or complete.
func (c *Comm) Stream() *cuda.Stream { return c.stream }

// CommStream implements device.StreamComm: the stream of Stream, on which
// device.BeforeCollective orders the communicator's work after compute.
func (c *Comm) CommStream() device.Stream { return c.stream }

// Handle returns the ncclComm_t, for calls this package does not wrap.
// It is invalid after Abort or Close.
func (c *Comm) Handle() uintptr { return c.h }

// Err implements comm.Communicator.
func (c *Comm) Err() error {
	if e := c.failure.Load(); e != nil {
		return e
	}
	return nil
}

// Abort implements comm.Communicator: it fails every pending and later call
// with a *comm.AbortError carrying cause, aborts the NCCL communicator
// (ncclCommAbort, which also stops its running kernels) and, when the
// communicator was created through a store, posts a notice there so that
// the peers' calls fail too.
func (c *Comm) Abort(cause error) {
	if cause == nil {
		cause = errors.New("aborted")
	}
	c.abort(&comm.AbortError{Rank: c.rank, Cause: cause}, true, false)
}

// abort marks the communicator failed with e, aborts the NCCL
// communicator, then fails pending work and, with notify, tells the peers.
// issueHeld says whether the caller holds issueMu. Pending work fails only
// after ncclCommAbort has returned, so that whoever sees an operation fail
// may rely on NCCL having stopped with its buffers.
func (c *Comm) abort(e *comm.AbortError, notify, issueHeld bool) {
	first := false
	c.failOnce.Do(func() {
		first = true
		c.failure.Store(e)
		close(c.failed)
	})
	if !first {
		return
	}
	if !issueHeld && !c.cfg.nccl.Blocking {
		// In nonblocking mode no NCCL call holds issueMu for long: every
		// wait loop sees the failure and lets go.
		c.issueMu.Lock()
		defer c.issueMu.Unlock()
	}
	// In blocking mode a call may be stuck inside NCCL holding issueMu;
	// ncclCommAbort from another thread is NCCL's way to unblock it.
	c.ncclAbort()
	c.failPending(e)
	if notify && c.store != nil {
		go c.notify(e.Cause)
	}
}

// failPending fails every pending operation: the doomed with their own
// causes, the rest with e.
func (c *Comm) failPending(e *comm.AbortError) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, w := range c.doomed {
		c.abandonLocked(w, w.cause)
	}
	for _, w := range c.queue {
		c.abandonLocked(w, e)
	}
	for _, w := range c.batch {
		_ = c.finishLocked(w, e) // nil: e is not nil, so nothing is copied
	}
	c.doomed, c.queue, c.batch = nil, nil, nil
	c.aborted = true
	close(c.abortDone)
}

// awaitAbort waits, once the communicator has failed, until its abort is
// done, so that a call failing because of another goroutine's abort
// returns after NCCL has stopped using the call's buffers. The context and
// the communicator's timeout bound the wait.
func (c *Comm) awaitAbort(ctx context.Context) {
	if c.failure.Load() == nil {
		return
	}
	t := time.NewTimer(c.cfg.opts.Timeout)
	defer t.Stop()
	select {
	case <-c.abortDone:
	case <-ctx.Done():
	case <-t.C:
	}
}

// fail fails w with err and aborts the communicator. Unless the abort is
// already done, w fails with the other pending work once it is. It returns
// the error w fails with: err, or the one it had already failed with. That
// is w's outcome, not a failure of fail, so callers that need only the
// effect ignore it.
func (c *Comm) fail(w *work, err *comm.Error, issueHeld bool) error {
	c.mu.Lock()
	switch {
	case c.aborted:
		c.abandonLocked(w, err)
	case !w.finished && w.cause == nil:
		w.cause = err
		c.doomed = append(c.doomed, w)
	}
	var werr error
	if w.finished {
		werr = w.err
	} else {
		werr = w.cause
	}
	c.mu.Unlock()
	c.abort(&comm.AbortError{Rank: c.rank, Cause: err}, true, issueHeld)
	return werr
}

// ncclAbort calls ncclCommAbort once.
func (c *Comm) ncclAbort() {
	c.mu.Lock()
	if c.gone {
		c.mu.Unlock()
		return
	}
	c.gone = true
	c.mu.Unlock()
	// Nothing is left to report to: the communicator is failed already, its
	// cause recorded, and ncclCommAbort frees it whatever it returns. If the
	// device is closed, NCCL's resources went with the context.
	_ = c.dev.Run(func() error {
		c.lib.nc.commAbort(c.h)
		return nil
	})
}

// notify posts an abort notice at key+"/abort": "rank\ncause".
func (c *Comm) notify(cause error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// Best effort: a peer that never reads the notice still fails, by its
	// own timeout or NCCL's asynchronous error, only later and with a
	// vaguer cause.
	_ = c.store.Set(ctx, c.key+"/abort", []byte(strconv.Itoa(c.rank)+"\n"+cause.Error()))
}

// watch waits for an abort notice from a peer and aborts this member.
func (c *Comm) watch(ctx context.Context) {
	for {
		v, err := c.store.Get(ctx, c.key+"/abort")
		if err == nil {
			rank, cause, _ := strings.Cut(string(v), "\n")
			r, perr := strconv.Atoi(rank)
			if perr != nil {
				r = -1
			}
			if r == c.rank {
				return // our own notice
			}
			c.abort(&comm.AbortError{Rank: r, Cause: errors.New(cause)}, false, false)
			return
		}
		if ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
			return
		}
	}
}

// Close releases the communicator. Pending work must be waited for first
// (Close fails otherwise). A healthy communicator is finalised
// (ncclCommFinalize, waited for with the timeout) and destroyed
// (ncclCommDestroy); an aborted one was already freed by ncclCommAbort.
// Then the stream (if the communicator created it), the barrier word and
// pooled events are released. Later calls fail with comm.ErrInvalid.
// Close is idempotent.
func (c *Comm) Close() error {
	c.issueMu.Lock()
	defer c.issueMu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	pending := len(c.queue) + len(c.batch)
	if pending > 0 && c.failure.Load() == nil {
		c.mu.Unlock()
		return fmt.Errorf("nccl: %s: %w: Close with %d operations pending; wait for them first", c.name, comm.ErrInvalid, pending)
	}
	c.closed = true
	gone := c.gone
	c.gone = true
	c.mu.Unlock()
	if c.stopWatch != nil {
		c.stopWatch()
	}
	var errs []error
	if !gone {
		errs = append(errs, c.finalize())
	}
	c.mu.Lock()
	errs = append(errs, c.releaseLocked())
	c.mu.Unlock()
	c.pin.Unpin()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("nccl: %s: rank %d: closing: %w", c.name, c.rank, err)
	}
	return nil
}

// finalize flushes and destroys a healthy NCCL communicator; on failure it
// aborts it instead.
func (c *Comm) finalize() error {
	l := c.lib
	// The device's run error matters here: with the device closed or its
	// context lost, NCCL was never called and its result code means nothing.
	err := c.dev.Run(func() error {
		if rc := l.nc.commFinalize(c.h); rc != int32(Success) && rc != int32(InProgress) {
			return l.ncclError("ncclCommFinalize", rc, c.h)
		}
		return nil
	})
	if err == nil {
		// An abort from another goroutine waits for issueMu, which Close
		// holds: give up for it.
		err = settle(context.Background(), l, c.h, "ncclCommFinalize", time.Now().Add(c.cfg.opts.Timeout), c.Err)
	}
	if err != nil {
		return errors.Join(err, c.dev.Run(func() error {
			if rc := l.nc.commAbort(c.h); rc != int32(Success) {
				return l.ncclError("ncclCommAbort", rc, 0)
			}
			return nil
		}))
	}
	return c.dev.Run(func() error {
		if rc := l.nc.commDestroy(c.h); rc != int32(Success) {
			return l.ncclError("ncclCommDestroy", rc, 0)
		}
		return nil
	})
}

// releaseLocked frees the stream, barrier word, pooled events and the
// memory of failed operations whose device work has finished.
func (c *Comm) releaseLocked() error {
	var errs []error
	kept := c.orphans[:0]
	for _, w := range c.orphans {
		if w.event != nil {
			if done, err := w.event.Query(); err != nil || !done {
				kept = append(kept, w) // the device may still use its memory: leak it
				continue
			}
		}
		c.releaseWorkLocked(w)
	}
	c.orphans = kept
	for _, e := range c.events {
		errs = append(errs, e.Close())
	}
	c.events = nil
	errs = append(errs, c.dev.Free(c.barrier), c.done.Close())
	c.barrier = cuda.Buffer{}
	if c.ownStream {
		errs = append(errs, c.stream.Close())
	}
	return errors.Join(errs...)
}

// Split implements comm.Communicator with ncclCommSplit (NCCL 2.18 or
// later; with an older NCCL it fails with comm.ErrUnsupported). A negative
// color is NCCL_SPLIT_NOCOLOR and yields a nil Communicator. The new
// communicator inherits this one's NCCL config (config NULL), options and
// stream choice; it is named "<parent>/split<seq>.c<color>".
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
	nc, err := c.split(ctx, color, key)
	if err != nil {
		c.awaitAbort(ctx)
	}
	return nc, err
}

// split is SplitComm under issueMu; SplitComm waits, after it has let go,
// for an abort that failed it.
func (c *Comm) split(ctx context.Context, color, key int) (*Comm, error) {
	c.issueMu.Lock()
	defer c.issueMu.Unlock()
	if err := c.usable(comm.OpSplit, c.seq+1, -1); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, c.refuseEnded(comm.OpSplit, c.seq+1, -1, err)
	}
	if !c.lib.split {
		return nil, c.errorf(comm.OpSplit, c.seq+1, -1, "%w: ncclCommSplit needs NCCL 2.18 or later; the loaded NCCL is %s",
			comm.ErrUnsupported, VersionString(c.lib.version))
	}
	if key < -1<<31 || key > 1<<31-1 || color > 1<<31-1 {
		return nil, c.errorf(comm.OpSplit, c.seq+1, -1, "%w: color %d or key %d does not fit a C int", comm.ErrInvalid, color, key)
	}
	c.flushLocked(ctx)
	if err := c.usable(comm.OpSplit, c.seq+1, -1); err != nil {
		return nil, err // the flush failed and aborted
	}
	call := comm.Call{Op: comm.OpSplit}
	seq := c.seq + 1
	if c.cfg.opts.ConsistencyCheck {
		if err := c.checkFingerprint(ctx, seq, &call, nil, color, key); err != nil {
			return nil, err
		}
	}
	c.seq = seq
	id := c.rec.Begin(seq, &call, comm.Auto)
	fail := func(err error) (*Comm, error) {
		e := c.wrap(comm.OpSplit, seq, -1, err)
		c.rec.Update(id, comm.Failed, e)
		return nil, e
	}
	ncolor := int32(color)
	if color < 0 {
		ncolor = -1 // NCCL_SPLIT_NOCOLOR
	}
	var newh uintptr
	var rc int32
	if err := c.dev.Run(func() error { rc = c.lib.nc.commSplit(c.h, ncolor, int32(key), &newh, nil); return nil }); err != nil {
		return fail(err)
	}
	deadline := time.Now().Add(c.cfg.opts.Timeout)
	if rc != int32(Success) && rc != int32(InProgress) {
		err := c.lib.ncclError("ncclCommSplit", rc, c.h)
		c.abort(&comm.AbortError{Rank: c.rank, Cause: c.wrap(comm.OpSplit, seq, -1, err)}, true, true)
		return fail(err)
	}
	check := func() error { return c.Err() }
	err := settle(ctx, c.lib, c.h, "ncclCommSplit", deadline, check)
	if err == nil && newh != 0 {
		err = settle(ctx, c.lib, newh, "ncclCommSplit", deadline, check)
	}
	if err != nil {
		if newh != 0 {
			// Freeing the half-made child cannot change the error returned.
			_ = c.dev.Run(func() error { c.lib.nc.commAbort(newh); return nil })
		}
		c.abort(&comm.AbortError{Rank: c.rank, Cause: c.wrap(comm.OpSplit, seq, -1, err)}, true, true)
		return fail(err)
	}
	c.rec.Update(id, comm.Completed, nil)
	if newh == 0 {
		return nil, nil
	}
	suffix := fmt.Sprintf("/split%d.c%d", seq, color)
	nc := &Comm{lib: c.lib, dev: c.dev, devName: c.devName, h: newh, name: c.name + suffix, cfg: c.cfg, failed: make(chan struct{}), abortDone: make(chan struct{})}
	if c.store != nil {
		nc.store, nc.key = c.store, c.key+suffix
	}
	var n, r int32
	if rc := c.lib.nc.commCount(newh, &n); rc != 0 {
		return fail(c.lib.ncclError("ncclCommCount", rc, newh))
	}
	if rc := c.lib.nc.commUserRank(newh, &r); rc != 0 {
		return fail(c.lib.ncclError("ncclCommUserRank", rc, newh))
	}
	nc.rank, nc.size = int(r), int(n)
	if err := nc.setup(); err != nil {
		return fail(err)
	}
	if c.cfg.onSplit != nil {
		c.cfg.onSplit(nc)
	}
	return nc, nil
}

// usable returns the error for a call on a failed or closed communicator.
func (c *Comm) usable(op comm.Op, seq uint64, peer int) error {
	if e := c.failure.Load(); e != nil {
		return c.wrap(op, seq, peer, e)
	}
	c.mu.Lock()
	closed := c.closed
	c.mu.Unlock()
	if closed {
		return c.errorf(op, seq, peer, "%w: communicator closed", comm.ErrInvalid)
	}
	return nil
}

func (c *Comm) wrap(op comm.Op, seq uint64, peer int, err error) *comm.Error {
	if ce, ok := err.(*comm.Error); ok && ce.Backend == "nccl" && ce.Rank == c.rank && ce.Op == op && ce.Seq == seq {
		return ce
	}
	e := &comm.Error{Backend: "nccl", Rank: c.rank, Op: op, Seq: seq, Peer: peer, Err: err}
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
	prefix := fmt.Sprintf("loom_fr_%s_rank%d_seq%d", strings.NewReplacer("/", "_", " ", "_").Replace(c.name), c.rank, seq)
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
		inComm := strings.Contains(f.Function, "loom/comm.") || strings.Contains(f.Function, "loom/comm/nccl.")
		if !inComm || strings.HasSuffix(f.File, "_test.go") {
			return fmt.Sprintf("%s:%d", f.File, f.Line)
		}
		if !more {
			return ""
		}
	}
}
