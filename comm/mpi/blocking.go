//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// blockingGrace is how long a blocking call may still run after its
// communicator was aborted (it may complete: every rank may have joined
// it) before the watchdog ends the job.
const blockingGrace = 100 * time.Millisecond

// watchDelay is how often the sentry looks at the blocking call in
// flight; a call it finds running for watchDelay gets a watchdog, so that
// one starts 5-10 ms into a call. Most calls are shorter, and neither a
// goroutine nor a timer per call would be free: a timer pending while a
// long cgo call holds the processor wakes the runtime's network poller,
// and with mpirun binding each process to one core that thread competes
// with the one blocked in MPI (a 1 MiB MPI_Allreduce of 2 processes ran
// up to 30 µs longer with a timer armed around it).
const watchDelay = 5 * time.Millisecond

// sentryIdle is how long the sentry goroutine stays without a blocking
// call before it exits; the next call starts it again.
const sentryIdle = time.Second

// sentry hands the blocking calls that run longer than watchDelay to a
// watchdog (Comm.watch). One goroutine per communicator looks at the call
// in flight every watchDelay while blocking calls are being made, so a
// call costs two lock operations, not a timer and a channel.
type sentry struct {
	mu      sync.Mutex
	running bool          // the sentry goroutine is running
	call    *work         // the blocking call in flight, or nil
	seen    bool          // the goroutine has seen call in flight once
	done    chan struct{} // closed when call returns; nil until it is watched
	last    time.Time     // when the last call ended
}

// begin records w as the blocking call in flight and starts the sentry
// goroutine if it is not running.
func (s *sentry) begin(c *Comm, w *work) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.call, s.seen, s.done = w, false, nil
	if !s.running {
		s.running = true
		go s.run(c)
	}
}

// end records that the call in flight has returned, and releases its
// watchdog if it has one.
func (s *sentry) end() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done != nil {
		close(s.done)
	}
	s.call, s.done, s.last = nil, nil, now()
}

// run looks at the call in flight every watchDelay: a call seen on two
// looks in a row has run at least watchDelay and gets a watchdog. It
// exits after sentryIdle without a call.
func (s *sentry) run(c *Comm) {
	tick := time.NewTicker(watchDelay)
	defer tick.Stop()
	for range tick.C {
		s.mu.Lock()
		switch {
		case s.call == nil:
			if now().Sub(s.last) >= sentryIdle {
				s.running = false
				s.mu.Unlock()
				return
			}
		case !s.seen:
			s.seen = true
		case s.done == nil:
			s.done = make(chan struct{})
			go c.watch(s.call, s.done)
		}
		s.mu.Unlock()
	}
}

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

	c.sentry.begin(c, w)
	var err error
	for err == nil && len(w.steps) > 0 {
		s := w.steps[0]
		w.steps = w.steps[1:]
		err = s(w)
	}
	c.sentry.end()

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

// watch guards w's blocking call, from when the sentry hands it over,
// until done is closed. MPI cannot interrupt a blocking call, so when the call outlives its deadline, its
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
			c.mu.Lock()
			c.pollCtlLocked() // a peer's abort that has arrived wins
			if e := c.failure.Load(); e != nil {
				cause = e
			}
			c.mu.Unlock()
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
