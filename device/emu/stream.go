package emu

import (
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/device"
)

// Stream is a stream of an emulated device: a goroutine running a FIFO of
// closures (inline under WithSynchronous). It implements device.Stream.
type Stream struct {
	dev  *Device
	sync bool

	mu     sync.Mutex
	cond   *sync.Cond // signalled when work arrives, completes, or the stream stops
	queue  []task
	issued uint64 // sequence number of the last task queued
	done   uint64 // of the last task completed
	err    error  // the first error of a task not yet returned by Synchronize
	quit   bool
}

// task is one piece of work on a stream.
type task struct {
	seq  uint64
	name string
	fn   func() error
	// callers are the program counters of the call that queued the task,
	// resolved only when it fails, so that the error the stream reports
	// at a later, unrelated call names the call that caused it.
	callers [8]uintptr
}

// queuedBy names the first caller in t.callers outside the device
// packages ("autograd.softmaxDev (devices.go:830)"), "" when none is.
func (t *task) queuedBy() string {
	frames := runtime.CallersFrames(t.callers[:])
	for {
		f, more := frames.Next()
		if f.Function != "" && !strings.Contains(f.Function, "/loom/device/emu.") && !strings.Contains(f.Function, "/loom/device.") {
			fn := f.Function[strings.LastIndex(f.Function, "/")+1:]
			return fmt.Sprintf("%s (%s:%d)", fn, filepath.Base(f.File), f.Line)
		}
		if !more {
			return ""
		}
	}
}

var _ device.Stream = (*Stream)(nil)

// newStream starts a stream of d and registers it for Synchronize and
// Close.
func (d *Device) newStream() *Stream {
	s := &Stream{dev: d, sync: d.sync}
	s.cond = sync.NewCond(&s.mu)
	d.mu.Lock()
	d.streams = append(d.streams, s)
	d.mu.Unlock()
	if !s.sync {
		go s.run()
	}
	return s
}

// Owner is the stream's device.
func (s *Stream) Owner() device.Device { return s.dev }

// Launch queues fn on the stream, after the work queued before it (a host
// function, as cuLaunchHostFunc): it runs on the stream's goroutine, and
// the stream's later work waits for it. An error it returns (or a panic,
// recovered) is returned by the next Synchronize; under WithSynchronous fn
// runs now and its error is returned here.
func (s *Stream) Launch(fn func() error) error {
	if fn == nil {
		return fmt.Errorf("%s: Stream.Launch: %w: nil function", s.dev.name, device.ErrInvalid)
	}
	return s.launch("Launch", fn)
}

// launch queues fn, named name in errors.
func (s *Stream) launch(name string, fn func() error) error {
	_, err := s.enqueue(name, fn)
	return err
}

// enqueue queues fn and returns its sequence number: the stream has run
// it once done reaches it.
func (s *Stream) enqueue(name string, fn func() error) (uint64, error) {
	s.mu.Lock()
	if s.quit {
		s.mu.Unlock()
		return 0, fmt.Errorf("%s: %s: %w: the device is closed", s.dev.name, name, device.ErrInvalid)
	}
	s.issued++
	seq := s.issued
	if !s.sync {
		t := task{seq: seq, name: name, fn: fn}
		runtime.Callers(3, t.callers[:]) // above enqueue and launch
		s.queue = append(s.queue, t)
		s.cond.Broadcast()
		s.mu.Unlock()
		return seq, nil
	}
	s.mu.Unlock()
	// Inline: tasks of one stream may run concurrently when several
	// goroutines queue at once, as their calls are not ordered either.
	err := runTask(s.dev.name, name, fn)
	s.mu.Lock()
	s.done = max(s.done, seq)
	s.cond.Broadcast()
	s.mu.Unlock()
	return seq, err
}

// runTask runs fn, turning a panic into an error.
func runTask(dev, name string, fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%s: %s: panic: %v", dev, name, r)
		}
	}()
	if err := fn(); err != nil {
		return fmt.Errorf("%s: %s: %w", dev, name, err)
	}
	return nil
}

// run is the stream's goroutine.
func (s *Stream) run() {
	s.mu.Lock()
	for {
		for len(s.queue) == 0 && !s.quit {
			s.cond.Wait()
		}
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		t := s.queue[0]
		s.queue[0] = task{}
		s.queue = s.queue[1:]
		s.mu.Unlock()
		err := runTask(s.dev.name, t.name, t.fn)
		if err != nil {
			// Reported by a later call (Synchronize, a copy to the
			// host): say which queued work failed and who queued it.
			by := ""
			if q := t.queuedBy(); q != "" {
				by = ", queued by " + q + ","
			}
			err = fmt.Errorf("%w (the stream's work #%d%s reported at the next synchronisation)", err, t.seq, by)
		}
		s.mu.Lock()
		s.done = t.seq
		if err != nil && s.err == nil {
			s.err = err
		}
		s.cond.Broadcast()
	}
}

// stop ends the stream's goroutine once its queue is empty; later work is
// refused.
func (s *Stream) stop() {
	s.mu.Lock()
	s.quit = true
	s.cond.Broadcast()
	s.mu.Unlock()
}

// issuedSeq is the sequence number of the last task queued.
func (s *Stream) issuedSeq() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.issued
}

// wait blocks until the stream has run task seq.
func (s *Stream) wait(seq uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.done < seq {
		s.cond.Wait()
	}
}

// reached reports whether the stream has run task seq.
func (s *Stream) reached(seq uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done >= seq
}

// WaitEvent makes the work queued on s from now on wait until e, as last
// recorded, has completed, without blocking the caller. An event never
// recorded has completed.
func (s *Stream) WaitEvent(e device.Event) error {
	ev, ok := e.(*Event)
	if !ok || ev == nil || ev.dev != s.dev {
		return fmt.Errorf("%s: Stream.WaitEvent: %w: an event of another device (%T)", s.dev.name, device.ErrInvalid, e)
	}
	m := ev.mark()
	if m == nil || m.stream == s {
		return nil // nothing recorded, or already ordered by the FIFO
	}
	return s.launch("WaitEvent", func() error { m.stream.wait(m.seq); return nil })
}

// Synchronize blocks until the work queued on s so far has run, and
// returns the first error that work (or earlier work not yet reported)
// found; the error is returned once.
func (s *Stream) Synchronize() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for s.done < s.issued {
		s.cond.Wait()
	}
	err := s.err
	s.err = nil
	return err
}

// Query reports whether the work queued on s has run.
func (s *Stream) Query() (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done >= s.issued, nil
}

// Event is an event of an emulated device: a mark in a stream's FIFO,
// stamped with the host time when the stream reaches it. It implements
// device.Event.
type Event struct {
	dev    *Device
	timing bool

	mu     sync.Mutex
	cur    *mark
	closed bool
}

// mark is one Record: the task that stamps at, on stream. at is written by
// the stream before done reaches seq, and read only after.
type mark struct {
	stream *Stream
	seq    uint64
	at     time.Time
}

var _ device.Event = (*Event)(nil)

func (e *Event) mark() *mark {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.cur
}

// Record places the event at the end of s's queue; it completes when the
// work queued on s before it has run.
func (e *Event) Record(s device.Stream) error {
	st, err := e.dev.stream("Event.Record", s)
	if err != nil {
		return err
	}
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return fmt.Errorf("%s: Event.Record: %w: the event is closed", e.dev.name, device.ErrInvalid)
	}
	m := &mark{stream: st}
	seq, err := st.enqueue("Event.Record", func() error { m.at = time.Now(); return nil })
	if err != nil {
		return err
	}
	m.seq = seq
	e.mu.Lock()
	e.cur = m
	e.mu.Unlock()
	return nil
}

// Synchronize blocks until the event has completed.
func (e *Event) Synchronize() error {
	if m := e.mark(); m != nil {
		m.stream.wait(m.seq)
	}
	return nil
}

// Query reports whether the event has completed; an event never recorded
// has.
func (e *Event) Query() (bool, error) {
	m := e.mark()
	return m == nil || m.stream.reached(m.seq), nil
}

// Since is the host time between start's completion and e's. Both must be
// timing events that were recorded and have completed; otherwise it is an
// error wrapping device.ErrInvalid.
func (e *Event) Since(start device.Event) (time.Duration, error) {
	s, ok := start.(*Event)
	if !ok || s == nil || s.dev != e.dev {
		return 0, fmt.Errorf("%s: Event.Since: %w: start is an event of another device (%T)", e.dev.name, device.ErrInvalid, start)
	}
	if !e.timing || !s.timing {
		return 0, fmt.Errorf("%s: Event.Since: %w: an event made without timing", e.dev.name, device.ErrInvalid)
	}
	sm, em := s.mark(), e.mark()
	if sm == nil || em == nil {
		return 0, fmt.Errorf("%s: Event.Since: %w: an event that was never recorded", e.dev.name, device.ErrInvalid)
	}
	if !sm.stream.reached(sm.seq) || !em.stream.reached(em.seq) {
		return 0, fmt.Errorf("%s: Event.Since: %w: an event that has not completed", e.dev.name, device.ErrInvalid)
	}
	return em.at.Sub(sm.at), nil
}

// Close releases the event: later Records fail. Waits already queued on
// it are unaffected.
func (e *Event) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	return nil
}
