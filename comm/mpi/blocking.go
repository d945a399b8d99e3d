//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"fmt"
	"os"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// blockingGrace is how long a blocking call may still run after its
// communicator was aborted (it may complete: every rank may have joined
// it) before the watchdog ends the job.
const blockingGrace = 100 * time.Millisecond

// watchDelay is how long a blocking call runs before its watchdog starts.
// Most calls are shorter, and a goroutine started at once would cost them
// time: it needs a thread, which competes for the processor with the one
// blocked in MPI (mpirun binds each process to one core).
const watchDelay = 5 * time.Millisecond

// watchPoll is how often a blocking call's watchdog looks for a peer's
// abort notice. Polling is an MPI call from a second thread, which slows
// the blocked one (MPI_THREAD_MULTIPLE serialises them), so the watchdog
// leaves the calls that take less than this alone.
const watchPoll = 50 * time.Millisecond

// runBlocking runs a blocking work (see WithBlockingCalls). MPI requires
// every rank to issue the same collectives in the same order, so it first
// drives the pending async collectives until each has posted all of its
// steps; then it runs w's steps, each making blocking MPI calls, outside
// c.mu so that Abort, the background driver and the watchdog can act
// meanwhile. A call that completes after the communicator was aborted
// fails with the abort, as a pending call would.
func (c *Comm) runBlocking(w *work) error {
	start := now()
	c.mu.Lock()
	// A call that would block forever because a peer has aborted fails
	// here instead, if the notice has arrived and been looked for.
	c.noticesLocked()
	for !w.finished {
		c.progressLocked()
		if e := c.failure.Load(); e != nil {
			c.finishLocked(w, c.wrap(w.op, w.seq, -1, e))
			break
		}
		if c.postedLocked() {
			break
		}
		expired := c.expireLocked(w, w.ctx)
		c.mu.Unlock()
		if expired {
			c.hardAbort()
		}
		pause(now().Sub(start))
		c.mu.Lock()
	}
	if w.finished {
		c.mu.Unlock()
		return w.err
	}
	w.deadline = now().Add(c.cfg.opts.Timeout)
	c.mu.Unlock()

	done := make(chan struct{})
	watchdog := time.AfterFunc(watchDelay, func() { c.watch(w, done) })
	var err error
	for err == nil && len(w.steps) > 0 {
		s := w.steps[0]
		w.steps = w.steps[1:]
		err = s(w)
	}
	close(done)
	watchdog.Stop()

	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.failure.Load(); e != nil && err == nil {
		err = c.wrap(w.op, w.seq, -1, e)
	}
	if err != nil {
		c.failLocked(w, err)
	} else {
		c.finishLocked(w, nil)
	}
	return w.err
}

// postedLocked reports whether every pending collective has posted all
// of its steps.
func (c *Comm) postedLocked() bool {
	for _, w := range c.queue {
		if !w.finished && len(w.steps) > 0 {
			return false
		}
	}
	return true
}

// watch guards w's blocking call, from watchDelay on, until done is
// closed. MPI cannot
// interrupt a blocking call, so when the call outlives its deadline, its
// context ends, or the communicator is aborted meanwhile (by Abort, or by
// a peer's notice, which watch polls for every watchPoll),
// watch aborts the communicator, notifying the peers, and if the call has
// not returned within blockingGrace, ends the job (c.endJob).
func (c *Comm) watch(w *work, done <-chan struct{}) {
	deadline := time.NewTimer(w.deadline.Sub(now()))
	defer deadline.Stop()
	poll := time.NewTicker(watchPoll)
	defer poll.Stop()
	var cause error
	for cause == nil {
		select {
		case <-done:
			return
		case <-w.ctx.Done():
			cause = fmt.Errorf("%w while blocked in MPI (context: %w)", errCancelled, w.ctx.Err())
		case <-deadline.C:
			cause = fmt.Errorf("%w after %v: the blocking MPI call has not returned%s", comm.ErrTimeout, c.cfg.opts.Timeout, c.dump(w.seq))
		case <-c.failed:
			cause = c.failure.Load()
		case <-poll.C:
			c.mu.Lock()
			c.pollCtlLocked()
			c.mu.Unlock()
		}
	}
	select {
	case <-done:
		return
	default:
	}
	e := c.wrap(w.op, w.seq, -1, cause)
	c.mu.Lock()
	c.abortLocked(&comm.AbortError{Rank: c.rank, Cause: e}, true)
	c.mu.Unlock()
	grace := time.NewTimer(blockingGrace)
	defer grace.Stop()
	select {
	case <-done:
	case <-grace.C:
		c.endJob(e)
	}
}

// endJob reports err on stderr and ends the job with MPI_Abort: the
// blocking MPI call behind err cannot be interrupted.
func endJob(err error) {
	fmt.Fprintf(os.Stderr, "%v\nmpi: a blocking MPI call cannot be interrupted; ending the job with MPI_Abort\n", err)
	C.MPI_Abort(C.loom_comm_world(), 1)
}
