//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"syscall"
	"time"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// A work is one issued operation. It runs as a list of steps: each step
// posts nonblocking MPI requests (or decides the outcome), and the next
// step runs once they complete. Collectives run their steps in issue
// order across the communicator: a step that posts a collective runs only
// once every earlier collective has posted all of its steps, so every rank
// posts the same collectives in the same order. It implements comm.Work.
type work struct {
	c        *Comm
	ctx      context.Context
	call     comm.Call
	op       comm.Op
	seq      uint64
	peer     int
	id       uint64
	deadline time.Time // set when the first step runs
	blocking bool      // steps make blocking MPI calls (see runBlocking)

	steps     []step
	reqs      []C.MPI_Request // the current step's requests
	completed bool            // a pass that also looked for notices completed reqs
	finish    []func() error  // run after the last step completes

	// Recv: the elements each request expects, and what arrived.
	recvWant []int
	recvGot  []int
	recvDone []bool
	recvType C.MPI_Datatype

	pin  runtime.Pinner
	cmem []unsafe.Pointer // C memory to free when the requests are done

	done     chan struct{}
	err      error
	finished bool
}

type step func(w *work) error

// ctlPollEvery is how often a rank looks for peers' abort notices when
// no test of its requests does (loom_testall_ctl looks at every one): in
// blocking mode, and between calls. Each look is an MPI_Test, which runs
// MPI's whole progress engine once and, with more ranks than cores,
// yields the core to another process (Open MPI's mpi_yield_when_idle);
// the collective then waits for that rank. Looking before every blocking
// call cost a 1 MiB allreduce of 4 ranks on 2 cores 8-15% of its time.
// A notice only hastens a failure that the timeout reports anyway, so it
// is looked for as often as a blocking call's watchdog looks (watchPoll).
const ctlPollEvery = watchPoll

// noticesLocked looks for a peer's abort notice (pollCtlLocked) if it
// has not looked for ctlPollEvery.
func (c *Comm) noticesLocked() {
	if t := now(); t.Sub(c.ctlPolled) >= ctlPollEvery {
		c.ctlPolled = t
		c.pollCtlLocked()
	}
}

// Done implements comm.Work.
func (w *work) Done() <-chan struct{} { return w.done }

// Wait implements comm.Work. It drives MPI's progress itself, polling
// MPI_Test with a backoff, until the operation completes, ctx is done, the
// operation outlives the communicator's timeout, or the communicator is
// aborted. A cancelled ctx or a timeout aborts the communicator.
func (w *work) Wait(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	c := w.c
	start := now()
	for {
		select {
		case <-w.done:
			return w.err
		default:
		}
		// Spin first: a call that Do has just issued is then tested in
		// MPI_Wait's loop alone, with no pass of the progress engine
		// before it (with more ranks than cores, each pass that finds
		// nothing to do yields the core to another process).
		c.mu.Lock()
		c.spinLocked()
		if !w.finished {
			c.progressLocked()
		}
		expired := false
		if !w.finished {
			expired = c.expireLocked(w, ctx)
		}
		c.mu.Unlock()
		if expired {
			c.hardAbort()
		}
		select {
		case <-w.done:
			return w.err
		default:
		}
		pause(now().Sub(start))
	}
}

// spinFor bounds one spinLocked: long enough that MPI's progress engine
// runs in C for whole collectives of a few MiB, short enough that a
// cancelled context is noticed promptly. Abort notices end a spin at once.
const spinFor = 2 * time.Millisecond

// spinLocked drives MPI's progress engine in C, as MPI_Wait does, until
// the requests of the first pending collective complete, an abort notice
// arrives or spinFor passes; it takes the notice, and progressLocked
// finishes what completed. Each pass tests the requests and the notice
// receive together (loom_testall_ctl), so a notice that came with the data
// still wins without a pass of its own. Polling from Go instead (a lock, a
// cgo call, the clock and a yield per MPI_Test) made a 1 MiB allreduce of
// two processes 1.2-1.4x raw MPI_Iallreduce+MPI_Wait.
func (c *Comm) spinLocked() {
	if c.failure.Load() != nil || c.freed || len(c.queue) == 0 {
		return
	}
	w := c.queue[0]
	if w.finished || len(w.reqs) == 0 || w.recvWant != nil {
		return
	}
	var flag, ctlFlag C.int
	var st C.MPI_Status
	n, usec := C.int(len(w.reqs)), C.int(spinFor/time.Microsecond)
	var rc C.int
	// &c.ctlReq is written out in the call: cgo then checks the field
	// alone, not the whole Comm (which holds Go pointers).
	if c.ctlLive {
		rc = C.loom_testall_for(n, &w.reqs[0], &c.ctlReq, &flag, &ctlFlag, &st, usec)
	} else {
		rc = C.loom_testall_for(n, &w.reqs[0], nil, &flag, &ctlFlag, &st, usec)
	}
	w.completed = rc == C.loom_success() && flag != 0
	if ctlFlag != 0 {
		c.noticeLocked(&st)
	}
	if rc != C.loom_success() {
		c.failLocked(w, fmt.Errorf("MPI_Testsome: %w", mpiError(rc)))
		return
	}
	if flag != 0 || ctlFlag != 0 {
		c.progressLocked()
	}
}

// pause is the backoff between polls of a waiter. MPI progresses only
// inside MPI calls (Open MPI has no progress thread), so a large transfer
// needs frequent polls: spin (yielding to other goroutines) for the first
// 50 µs, then yield the processor to other processes between polls
// for up to a second, as MPI's own blocking calls do when oversubscribed;
// after that sleep between polls, up to a millisecond, so that a rank
// waiting long for a slow peer costs little CPU.
func pause(elapsed time.Duration) {
	switch {
	case elapsed < 50*time.Microsecond:
		runtime.Gosched()
	case elapsed < time.Second:
		syscall.Syscall(syscall.SYS_SCHED_YIELD, 0, 0, 0)
	default:
		time.Sleep(min(elapsed/1000, time.Millisecond))
	}
}

// newWork creates and records a work for call at seq.
func (c *Comm) newWork(ctx context.Context, call *comm.Call, seq uint64) *work {
	w := &work{c: c, ctx: ctx, call: *call, op: call.Op, seq: seq, peer: -1, done: make(chan struct{})}
	if call.Op == comm.OpSend || call.Op == comm.OpRecv {
		w.peer = call.Peer
	}
	w.id = c.rec.BeginLabeled(comm.LabelOf(ctx), seq, call, call.Algorithm)
	return w
}

// enqueue adds w to its issue queue and starts it if it may. With
// blocking, w is instead marked blocking, for the caller to run
// (runBlocking).
func (c *Comm) enqueue(w *work, blocking bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e := c.failure.Load(); e != nil {
		c.finishLocked(w, c.wrap(w.op, w.seq, -1, e))
		return
	}
	if blocking {
		w.blocking = true
		return
	}
	if w.op == comm.OpSend || w.op == comm.OpRecv {
		c.p2p = append(c.p2p, w)
	} else {
		c.queue = append(c.queue, w)
	}
	c.progressLocked()
}

// progressLocked tests every pending operation, runs the steps that may
// run, and completes what is done. It also picks up abort notices.
func (c *Comm) progressLocked() {
	if c.failure.Load() != nil || c.freed {
		return
	}
	if c.noticesLocked(); c.failure.Load() != nil {
		return
	}
	q := c.queue
	mayIssue := true
	for _, w := range q {
		c.advanceLocked(w, mayIssue)
		if c.failure.Load() != nil {
			return
		}
		if !w.finished && len(w.steps) > 0 {
			mayIssue = false
		}
	}
	c.queue = pending(q)
	ps := c.p2p
	for _, w := range ps {
		c.advanceLocked(w, true)
		if c.failure.Load() != nil {
			return
		}
	}
	c.p2p = pending(ps)
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

// advanceLocked moves w on as far as it can: tests its requests and, when
// they are complete and mayIssue allows, runs its next steps.
func (c *Comm) advanceLocked(w *work, mayIssue bool) {
	for !w.finished {
		if len(w.reqs) > 0 {
			done, err := w.testLocked()
			if err != nil {
				c.failLocked(w, err)
				return
			}
			if !done {
				return
			}
			// A peer's abort notice sent before the data that completed w
			// must still win, though progress polls for notices only now
			// and then: testLocked looked for it in the same pass.
			if c.failure.Load() != nil {
				return
			}
			w.reqs, w.completed = w.reqs[:0], false
		}
		if len(w.steps) == 0 {
			c.finishLocked(w, nil)
			return
		}
		if !mayIssue {
			return
		}
		if w.deadline.IsZero() {
			w.deadline = now().Add(c.cfg.opts.Timeout)
		}
		s := w.steps[0]
		w.steps = w.steps[1:]
		if err := s(w); err != nil {
			c.failLocked(w, err)
			return
		}
		if len(w.reqs) > 0 {
			// Tested by the next pass (a wait spins on them at once),
			// not by a pass of its own here.
			return
		}
	}
}

// failLocked ends w with err. An MPI error in a collective aborts the
// communicator, since the ranks can no longer agree on the sequence;
// verdicts that every rank reached alike (mismatch, rejected counts) and
// point-to-point errors do not.
func (c *Comm) failLocked(w *work, err error) {
	var me mpiErr
	isMPI := errors.As(err, &me)
	e := c.finishLocked(w, err)
	if isMPI && w.op != comm.OpSend && w.op != comm.OpRecv {
		c.abortLocked(&comm.AbortError{Rank: c.rank, Cause: e}, true)
	}
}

// testLocked tests the current step's requests.
func (w *work) testLocked() (bool, error) {
	if w.recvWant != nil {
		all := true
		for i := range w.reqs {
			if w.recvDone[i] {
				continue
			}
			var flag, count C.int
			if rc := C.loom_test_recv(&w.reqs[i], &flag, &count, w.recvType); rc != C.loom_success() {
				return false, fmt.Errorf("receive from rank %d: %w", w.peer, mpiError(rc))
			}
			if flag == 0 {
				all = false
				continue
			}
			w.recvDone[i], w.recvGot[i] = true, int(count)
		}
		if !all {
			return false, nil
		}
		got, want := 0, 0
		for i := range w.recvWant {
			got += w.recvGot[i]
			want += w.recvWant[i]
		}
		if got != want {
			w.reqs = w.reqs[:0]
			return true, fmt.Errorf("%w: received %d elements from rank %d, want %d (Send and Recv lengths must agree)", comm.ErrInvalid, got, w.peer, want)
		}
		w.c.pollCtlLocked() // for a notice sent before the data
		return true, nil
	}
	if w.completed {
		// A pass of spinLocked completed the requests, and looked for
		// notices in it: another pass would only yield the processor.
		return true, nil
	}
	var flag, ctlFlag C.int
	var st C.MPI_Status
	c := w.c
	var rc C.int
	if c.ctlLive { // &c.ctlReq in the call, as in spinLocked
		rc = C.loom_testall_ctl(C.int(len(w.reqs)), &w.reqs[0], &c.ctlReq, &flag, &ctlFlag, &st)
	} else {
		rc = C.loom_testall_ctl(C.int(len(w.reqs)), &w.reqs[0], nil, &flag, &ctlFlag, &st)
	}
	if ctlFlag != 0 {
		c.noticeLocked(&st)
	}
	if rc != C.loom_success() {
		return false, fmt.Errorf("MPI_Testsome: %w", mpiError(rc))
	}
	return flag != 0, nil
}

// finishLocked completes w with err (nil: success, after running its
// finish functions) and returns the error as the caller sees it.
func (c *Comm) finishLocked(w *work, err error) error {
	if w.finished {
		return w.err
	}
	if err == nil {
		for _, f := range w.finish {
			if err = f(); err != nil {
				break
			}
		}
	}
	if err != nil {
		var ce *comm.Error
		if !errors.As(err, &ce) {
			err = c.wrap(w.op, w.seq, w.peer, err)
		}
	}
	c.closeLocked(w, err)
	return err
}

// abandonLocked fails w without running its finish functions; requests
// still posted keep w (and its buffers) alive among the orphans.
func (c *Comm) abandonLocked(w *work, err error) {
	if !w.finished {
		c.closeLocked(w, err)
	}
}

func (c *Comm) closeLocked(w *work, err error) {
	w.finished = true
	w.err = err
	w.steps = nil
	if len(w.reqs) > 0 && err != nil {
		c.orphans = append(c.orphans, w)
	} else {
		w.release()
	}
	if err != nil {
		c.rec.Update(w.id, comm.Failed, err)
	} else {
		c.rec.Update(w.id, comm.Completed, nil)
	}
	close(w.done)
}

// release unpins w's buffers and frees its C memory.
func (w *work) release() {
	w.pin.Unpin()
	for _, p := range w.cmem {
		C.free(p)
	}
	w.cmem = nil
	w.reqs = nil
}

var errCancelled = errors.New("cancelled")

// expireLocked fails the operations whose context is done or whose time is
// up, the waiter's own ctx included, and aborts the communicator; it
// reports whether it did. A peer's abort notice that has arrived wins over
// a context that ended meanwhile (the program may have cancelled it
// because of that failure): it is looked for first, and its abort fails
// every pending operation with its cause.
func (c *Comm) expireLocked(waiter *work, ctx context.Context) bool {
	if c.failure.Load() != nil {
		return false // the abort has failed every pending operation
	}
	if waiter != nil && ctx != nil && ctx.Err() != nil {
		if c.pollCtlLocked(); c.failure.Load() != nil {
			return false
		}
		c.expireOne(waiter, fmt.Errorf("%w while waiting (context: %w)", errCancelled, ctx.Err()))
		return true
	}
	t := now()
	for _, list := range [][]*work{c.queue, c.p2p} {
		for _, w := range list {
			if w.finished {
				continue
			}
			if err := w.ctx.Err(); err != nil {
				if c.pollCtlLocked(); c.failure.Load() != nil {
					return false
				}
				c.expireOne(w, fmt.Errorf("%w (context: %w)", errCancelled, err))
				return true
			}
			if !w.deadline.IsZero() && t.After(w.deadline) {
				cause := fmt.Errorf("%w after %v: MPI has not completed the operation, and MPI cannot cancel it; the communicator is aborted (mpi.AbortJob ends the job)%s",
					comm.ErrTimeout, c.cfg.opts.Timeout, c.dump(w.seq))
				c.expireOne(w, cause)
				return true
			}
		}
	}
	return false
}

func (c *Comm) expireOne(w *work, cause error) {
	e := c.wrap(w.op, w.seq, w.peer, cause)
	c.abandonLocked(w, e)
	c.abortLocked(&comm.AbortError{Rank: c.rank, Cause: e}, true)
}

// driveLocked starts the background driver, which progresses async work
// that nobody waits for, and expires it; it exits when nothing is pending.
func (c *Comm) driveLocked() {
	if c.driving {
		return
	}
	c.driving = true
	go c.drive()
}

func (c *Comm) drive() {
	sleep := 20 * time.Microsecond
	for {
		c.mu.Lock()
		c.progressLocked()
		expired := c.expireLocked(nil, nil)
		if len(c.queue)+len(c.p2p) == 0 || c.failure.Load() != nil || c.freed {
			c.driving = false
			c.mu.Unlock()
			if expired {
				c.hardAbort()
			}
			return
		}
		c.mu.Unlock()
		time.Sleep(sleep)
		sleep = min(2*sleep, time.Millisecond)
	}
}

// newReq appends a request slot to the current step and returns it; for
// a blocking work it returns nil, which makes the loom_* collective shims
// call the blocking form.
func (w *work) newReq() *C.MPI_Request {
	if w.blocking {
		return nil
	}
	w.reqs = append(w.reqs, C.loom_request_null())
	return &w.reqs[len(w.reqs)-1]
}

// mpiName names the MPI function a step calls for the collective name
// ("Allreduce"): MPI_Allreduce for a blocking work, else MPI_Iallreduce.
func (w *work) mpiName(name string) string {
	if w.blocking {
		return "MPI_" + name
	}
	return "MPI_I" + strings.ToLower(name[:1]) + name[1:]
}

// use pins the memory of bufs for as long as requests use it.
func (w *work) use(bufs ...[]byte) {
	for _, b := range bufs {
		if len(b) > 0 {
			w.pin.Pin(&b[0])
		}
	}
}

// cAlloc allocates C memory freed when w is done.
func (w *work) cAlloc(n int) unsafe.Pointer {
	p := C.malloc(C.size_t(max(n, 1)))
	w.cmem = append(w.cmem, p)
	return p
}
