package nccl

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
)

// errCancelled is the cause of an operation whose context ended.
var errCancelled = errors.New("cancelled")

// settle polls ncclCommGetAsyncError(h) until the communicator leaves
// ncclInProgress (nonblocking mode), and returns the error it settled on.
// It gives up when ctx ends, deadline passes or check (if not nil)
// returns an error; the caller then aborts h.
func settle(ctx context.Context, l *Library, h uintptr, call string, deadline time.Time, check func() error) error {
	start := time.Now()
	for {
		var st int32
		if rc := l.nc.commGetAsyncError(h, &st); rc != 0 {
			return l.ncclError("ncclCommGetAsyncError", rc, h)
		}
		switch Result(st) {
		case Success:
			return nil
		case InProgress:
		default:
			e := l.ncclError("ncclCommGetAsyncError", st, h)
			e.Call = call + " (async)"
			return e
		}
		if check != nil {
			if err := check(); err != nil {
				return err
			}
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("%w while %s was in progress (context: %w)", errCancelled, call, err)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: %s still in progress after %v", comm.ErrTimeout, call, time.Since(start).Round(time.Millisecond))
		}
		pause(time.Since(start))
	}
}

// pause is the backoff between polls: yield for the first 50 µs, then
// sleep, growing with the time already waited up to a millisecond, so a
// long wait costs little CPU.
func pause(elapsed time.Duration) {
	switch {
	case elapsed < 50*time.Microsecond:
		runtime.Gosched()
	default:
		time.Sleep(min(max(elapsed/50, 10*time.Microsecond), time.Millisecond))
	}
}

// hostCopy is one device-to-host copy made when a work completes.
type hostCopy struct {
	host []byte
	dev  cuda.Buffer
}

// A work is one issued operation. It implements comm.Work.
type work struct {
	c        *Comm
	call     comm.Call
	op       comm.Op
	seq      uint64
	peer     int
	tag      int
	id       uint64
	recorded bool
	ctx      context.Context
	deadline time.Time

	p2p    bool        // point-to-point: batched until flushed
	issued bool        // given to NCCL (guarded by Comm.mu)
	kicked atomic.Bool // Done has asked for a flush

	event   *cuda.Event   // recorded after the NCCL call; nil: no device work
	copyOut []hostCopy    // staged host results
	scratch []cuda.Buffer // staging memory to free
	sendPtr uintptr
	recvPtr uintptr

	done     chan struct{}
	err      error
	finished bool
	cause    *comm.Error // set when w is doomed: its error once the abort is done
}

// newWork creates (and, unless internal, records) a work for call at seq.
func (c *Comm) newWork(ctx context.Context, call *comm.Call, seq uint64, internal bool) *work {
	w := &work{c: c, call: *call, op: call.Op, seq: seq, peer: -1, ctx: ctx, done: make(chan struct{}),
		deadline: time.Now().Add(c.cfg.opts.Timeout)}
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		w.peer, w.tag, w.p2p = call.Peer, call.Tag, true
	}
	if !internal {
		w.id = c.rec.BeginLabeled(comm.LabelOf(ctx), seq, call, comm.Auto)
		w.recorded = true
	}
	return w
}

// Done implements comm.Work. For point-to-point work not yet given to
// NCCL it first starts a flush in the background.
func (w *work) Done() <-chan struct{} {
	if w.p2p && !w.kicked.Swap(true) {
		w.c.mu.Lock()
		pending := !w.issued && !w.finished
		w.c.mu.Unlock()
		if pending {
			go w.c.flushFor(context.Background(), w)
		}
	}
	return w.done
}

// Event implements device.EventWork, for device.AfterCollective: an event
// on the communicator's stream that completes with the operation's device
// work, so that a compute stream can wait for it without the host
// blocking. It covers device memory only: a staged host buffer receives
// its result when Wait returns (or the background completion runs), not
// when the event does. Point-to-point work not yet given to NCCL is
// flushed first. Work that has no device work (a collective that moves no
// data), has completed, or failed returns an event never recorded, which
// counts as complete; a failure is Wait's (and the communicator's Err).
// Once the work completes, its event goes back to the communicator's pool,
// so a wait started later may also wait for later work, never for less.
func (w *work) Event() device.Event {
	c := w.c
	if w.p2p {
		c.flushFor(context.Background(), w)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.event != nil && !w.finished {
		return w.event
	}
	return c.done
}

// Wait implements comm.Work. It polls the work's CUDA event and the
// communicator's asynchronous error (ncclCommGetAsyncError) with a
// backoff until the operation completes, ctx ends, the operation outlives
// the communicator's timeout or the communicator fails. An asynchronous
// NCCL error, a CUDA error, a cancelled ctx or a timeout aborts the
// communicator. Point-to-point work not yet given to NCCL is flushed first.
func (w *work) Wait(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c := w.c
	if w.p2p {
		c.flushFor(ctx, w)
	}
	start := time.Now()
	for {
		select {
		case <-w.done:
			return w.err
		default:
		}
		if c.failure.Load() == nil {
			c.mu.Lock()
			err := c.progressLocked()
			c.mu.Unlock()
			if err != nil {
				c.abort(&comm.AbortError{Rank: c.rank, Cause: err}, true, false)
				continue
			}
		}
		// Once the communicator has failed, w fails when the abort is
		// done; the context and the timeout still bound the wait.
		select {
		case <-w.done:
			return w.err
		default:
		}
		var cause error
		if err := ctx.Err(); err != nil {
			if e := c.failure.Load(); e != nil {
				// The communicator was aborted first (the program may
				// have cancelled ctx because of that failure): its cause
				// wins, and w fails with it when the abort is done.
				return c.wrap(w.op, w.seq, w.peer, e)
			}
			cause = fmt.Errorf("%w while waiting (context: %w)", errCancelled, err)
		} else if time.Now().After(w.deadline) {
			cause = c.timeoutCause(w)
		}
		if cause != nil {
			err := c.expire(w, cause)
			select {
			case <-w.done:
				return w.err
			default:
				// Another goroutine's abort is still running: the context
				// and the timeout bound this wait, not that abort.
				return err
			}
		}
		pause(time.Since(start))
	}
}

func (c *Comm) timeoutCause(w *work) error {
	return fmt.Errorf("%w after %v: NCCL has not completed the operation (a peer that failed or never issued it?); the communicator is aborted%s",
		comm.ErrTimeout, c.cfg.opts.Timeout, c.dump(w.seq))
}

// expire fails w with cause and aborts the communicator; it returns the
// error w fails with.
func (c *Comm) expire(w *work, cause error) error {
	return c.fail(w, c.wrap(w.op, w.seq, w.peer, cause), false)
}

// progressLocked completes the issued works whose events have fired, in
// issue order, and checks the communicator's asynchronous error. It
// returns an error that must abort the communicator: a failed event, a
// failed copy, or an asynchronous NCCL error (a peer that failed, a
// network error).
func (c *Comm) progressLocked() error {
	if c.gone {
		return nil
	}
	for _, w := range c.queue {
		if w.finished {
			continue
		}
		if w.cause != nil {
			break // doomed: it fails when the abort is done
		}
		if w.event != nil {
			done, err := w.event.Query()
			if err != nil {
				return c.wrap(w.op, w.seq, w.peer, err)
			}
			if !done {
				break // one stream: later work completes after this one
			}
		}
		if err := c.finishLocked(w, nil); err != nil {
			return err
		}
	}
	c.queue = pending(c.queue)
	var st int32
	if rc := c.lib.nc.commGetAsyncError(c.h, &st); rc != 0 {
		return c.asyncCause(c.lib.ncclError("ncclCommGetAsyncError", rc, c.h))
	}
	if Result(st) != Success && Result(st) != InProgress {
		e := c.lib.ncclError("ncclCommGetAsyncError", st, c.h)
		return c.asyncCause(e)
	}
	return nil
}

// asyncCause names the oldest pending operation in an asynchronous error.
func (c *Comm) asyncCause(err error) error {
	for _, w := range c.queue {
		if !w.finished {
			return c.wrap(w.op, w.seq, w.peer, err)
		}
	}
	return c.wrap(0, c.seq, -1, err)
}

// pending filters out finished works, in place.
func pending(ws []*work) []*work {
	out := ws[:0]
	for _, w := range ws {
		if !w.finished {
			out = append(out, w)
		}
	}
	clear(ws[len(out):])
	return out
}

// expiredLocked returns the first queued work whose context has ended or
// whose time is up, with the cause; none once the communicator has failed,
// since its abort fails every queued work with its own cause.
func (c *Comm) expiredLocked() (*work, error) {
	if c.failure.Load() != nil {
		return nil, nil
	}
	t := time.Now()
	for _, w := range c.queue {
		if w.finished || w.cause != nil {
			continue // done, or doomed: the abort fails it
		}
		if err := w.ctx.Err(); err != nil {
			return w, fmt.Errorf("%w (context: %w)", errCancelled, err)
		}
		if t.After(w.deadline) {
			return w, c.timeoutCause(w)
		}
	}
	return nil, nil
}

// finishLocked completes w: with err nil it copies staged results to the
// host (a failure there is returned, and fails w), frees its staging
// memory and records it; with err it fails w. It returns the copy error,
// so always nil when err is not nil.
func (c *Comm) finishLocked(w *work, err error) error {
	if w.finished {
		return nil
	}
	var copyErr error
	if err == nil {
		for _, h := range w.copyOut {
			if copyErr = cuda.CopyFromDevice(c.dev, h.host, h.dev); copyErr != nil {
				copyErr = c.wrap(w.op, w.seq, w.peer, copyErr)
				err = copyErr
				break
			}
		}
	} else {
		err = c.wrap(w.op, w.seq, w.peer, err)
	}
	c.releaseWorkLocked(w)
	c.closeLocked(w, err)
	return copyErr
}

// abandonLocked fails w; if its device work may still be running, its
// memory is kept (among the orphans) instead of freed.
func (c *Comm) abandonLocked(w *work, err error) {
	if w.finished {
		return
	}
	if w.event != nil || len(w.scratch) > 0 {
		c.orphans = append(c.orphans, w)
	}
	c.closeLocked(w, c.wrap(w.op, w.seq, w.peer, err))
}

func (c *Comm) closeLocked(w *work, err error) {
	w.finished = true
	w.err = err
	w.copyOut = nil
	if w.recorded {
		if err != nil {
			c.rec.Update(w.id, comm.Failed, err)
		} else {
			c.rec.Update(w.id, comm.Completed, nil)
		}
	}
	close(w.done)
}

// releaseWorkLocked frees w's staging memory and returns its event to the
// pool.
func (c *Comm) releaseWorkLocked(w *work) {
	for _, b := range w.scratch {
		// w's outcome is decided already. A failed free leaks the block
		// until the context is released; it fails only with a broken
		// context, which the next collective reports.
		_ = c.dev.Free(b)
	}
	w.scratch = nil
	if w.event != nil {
		c.events = append(c.events, w.event)
		w.event = nil
	}
}

// eventLocked takes an event from the pool or creates one.
func (c *Comm) eventLocked() (*cuda.Event, error) {
	if n := len(c.events); n > 0 {
		e := c.events[n-1]
		c.events = c.events[:n-1]
		return e, nil
	}
	return c.dev.NewEvent(false)
}

// driveLocked starts the background driver, which completes async work
// that nobody waits for and expires it; it exits when nothing is queued.
func (c *Comm) driveLocked() {
	if c.driving || len(c.queue) == 0 {
		return
	}
	c.driving = true
	go c.drive()
}

func (c *Comm) drive() {
	sleep := 20 * time.Microsecond
	for {
		c.mu.Lock()
		err := c.progressLocked()
		var exp *work
		var cause error
		if err == nil {
			exp, cause = c.expiredLocked()
		}
		if err == nil && exp == nil && (len(c.queue) == 0 || c.failure.Load() != nil || c.closed) {
			c.driving = false
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		switch {
		case err != nil:
			c.abort(&comm.AbortError{Rank: c.rank, Cause: err}, true, false)
		case exp != nil:
			c.expire(exp, cause)
		default:
			time.Sleep(sleep)
			sleep = min(2*sleep, time.Millisecond)
		}
	}
}
