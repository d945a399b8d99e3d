package trace

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/b7ea7098/loom/device"
)

// Streams records when a rank's work ran on its device's streams, from
// device timing events, as events on LaneStreamCompute and LaneStreamComm
// of the Timeline: the host lanes say when work was queued, these when the
// device executed it. It records an event on the compute stream after each
// op the tape reports (Op) and events on the communicator's stream before
// and after each collective of a communicator wrapped by Comm for the same
// rank (when it is a device.StreamComm), and reads them all at End, which
// synchronises once; nothing synchronises per op.
//
// An op's span ends at its event and starts at the later of the previous
// op's event and the op's host start (the device cannot run work before
// it is queued; a host start after the op's end, which only a clock
// other than the host's gives, is ignored), so work queued between ops without a tape op (an
// optimizer step, copies) is drawn in the next op's span when it is still
// running when that op is queued, and left out otherwise. Device times
// become timeline times through a reference event recorded and
// synchronised at Begin, when the compute stream is idle.
//
// A nil *Streams records nothing. Its methods are safe for concurrent use.
type Streams struct {
	tl   *Timeline
	rank int32
	d    device.Device

	mu    sync.Mutex
	ref   device.Event
	refAt int64 // timeline time of ref's completion; -1 outside Begin..End
	pool  []device.Event
	ops   []streamMark // compute, in queue order
	comms []streamMark
	err   error // the first failure to record, returned by End
}

// streamMark is one recorded span awaiting its times: start is nil for
// compute ops.
type streamMark struct {
	start, end device.Event
	issued     int64
	ev         event // the template: name, cat, lane, comm fields
}

// Streams returns the stream recorder of rank on device d, which a
// communicator wrapped by Comm for rank on this timeline then uses too. A
// second call for the same rank replaces the first's registration (close
// the old one). It returns nil (which records nothing) for a nil Timeline
// or device, or a host device, which has no streams.
func (tl *Timeline) Streams(rank int, d device.Device) *Streams {
	if tl == nil || d == nil || d.Kind() == device.KindHost {
		return nil
	}
	s := &Streams{tl: tl, rank: int32(rank), d: d, refAt: -1}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if tl.streams == nil {
		tl.streams = map[int32]*Streams{}
	}
	tl.streams[s.rank] = s
	return s
}

// streamsOf returns rank's stream recorder, or nil.
func (tl *Timeline) streamsOf(rank int32) *Streams {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.streams[rank]
}

// event returns a timing event from the pool or a new one.
func (s *Streams) event() (device.Event, error) {
	if n := len(s.pool); n > 0 {
		e := s.pool[n-1]
		s.pool = s.pool[:n-1]
		return e, nil
	}
	return s.d.NewEvent(true)
}

// fail keeps the first recording error for End.
func (s *Streams) fail(err error) {
	if s.err == nil {
		s.err = fmt.Errorf("trace: rank %d: recording %s's stream events: %w", s.rank, s.d.Name(), err)
	}
}

// Begin starts recording a step: it records the reference event on the
// compute stream and waits for it (the stream is idle between traced
// steps, so this costs one round trip). Spans not read by an End are
// dropped.
func (s *Streams) Begin() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recycle()
	s.err = nil
	if s.ref == nil {
		ref, err := s.d.NewEvent(true)
		if err != nil {
			return fmt.Errorf("trace: rank %d: %w", s.rank, err)
		}
		s.ref = ref
	}
	if err := s.ref.Record(s.d.Compute()); err != nil {
		return fmt.Errorf("trace: rank %d: recording the reference event: %w", s.rank, err)
	}
	if err := s.ref.Synchronize(); err != nil {
		return fmt.Errorf("trace: rank %d: waiting for the reference event: %w", s.rank, err)
	}
	s.refAt = s.tl.clock()
	return nil
}

// recycle returns every mark's events to the pool and forgets the marks.
func (s *Streams) recycle() {
	for _, ms := range [][]streamMark{s.ops, s.comms} {
		for _, m := range ms {
			for _, e := range []device.Event{m.start, m.end} {
				if e != nil {
					s.pool = append(s.pool, e)
				}
			}
		}
	}
	s.ops, s.comms = s.ops[:0], s.comms[:0]
}

// Op records the end of op name (of tape phase cat), queued on the
// compute stream by work the host began at start: call it after the op's
// work is queued. Outside Begin..End it does nothing.
func (s *Streams) Op(name, cat string, start time.Time) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refAt < 0 {
		return
	}
	e, err := s.event()
	if err == nil {
		err = e.Record(s.d.Compute())
	}
	if err != nil {
		s.fail(err)
		return
	}
	s.ops = append(s.ops, streamMark{end: e, issued: s.tl.since(start),
		ev: event{name: name, cat: cat, rank: s.rank, group: -1, peer: -1, lane: LaneStreamCompute}})
}

// commStart records an event on stream before a collective is queued on
// it; nil outside Begin..End or on failure.
func (s *Streams) commStart(stream device.Stream) device.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refAt < 0 || stream == nil {
		return nil
	}
	e, err := s.event()
	if err == nil {
		err = e.Record(stream)
	}
	if err != nil {
		s.fail(err)
		return nil
	}
	return e
}

// commEnd records the event after the collective of template ev on
// stream, pairing it with start (commStart's).
func (s *Streams) commEnd(stream device.Stream, start device.Event, ev event) {
	if start == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refAt < 0 {
		s.pool = append(s.pool, start)
		return
	}
	e, err := s.event()
	if err == nil {
		err = e.Record(stream)
	}
	if err != nil {
		s.pool = append(s.pool, start)
		s.fail(err)
		return
	}
	ev.lane, ev.flags = LaneStreamComm, ev.flags&flagFailed
	s.comms = append(s.comms, streamMark{start: start, end: e, issued: ev.issued, ev: ev})
}

// End waits for every recorded event (the step's one synchronisation),
// adds the spans to the timeline and returns the first error of the
// step's recording or reading; the events go back to the pool.
func (s *Streams) End() error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.refAt < 0 {
		return nil
	}
	errs := []error{s.err}
	at := func(e device.Event) (int64, bool) {
		if err := e.Synchronize(); err != nil {
			errs = append(errs, err)
			return 0, false
		}
		d, err := e.Since(s.ref)
		if err != nil {
			errs = append(errs, err)
			return 0, false
		}
		return s.refAt + int64(d), true
	}
	prev := s.refAt
	for _, m := range s.ops {
		end, ok := at(m.end)
		if !ok {
			continue
		}
		// The host start bounds the span only where it is consistent
		// with the device's times (a clock that is not the host's, as a
		// fake's, can put it after the op's end).
		start := prev
		if m.issued > prev && m.issued < end {
			start = m.issued
		}
		prev = end
		if end > start { // an op that queued nothing has no span
			ev := m.ev
			ev.start, ev.end, ev.issued = start, end, m.issued
			s.tl.add(ev)
		}
	}
	for _, m := range s.comms {
		start, ok1 := at(m.start)
		end, ok2 := at(m.end)
		if ok1 && ok2 {
			ev := m.ev
			ev.start, ev.end = start, max(start, end)
			s.tl.add(ev)
		}
	}
	s.recycle()
	s.refAt = -1
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("trace: rank %d: reading %s's stream events: %w", s.rank, s.d.Name(), err)
	}
	return nil
}

// Close releases the recorder's events and removes its registration.
func (s *Streams) Close() error {
	if s == nil {
		return nil
	}
	s.tl.mu.Lock()
	if s.tl.streams[s.rank] == s {
		delete(s.tl.streams, s.rank)
	}
	s.tl.mu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.recycle()
	var errs []error
	for _, e := range append(s.pool, s.ref) {
		if e != nil {
			errs = append(errs, e.Close())
		}
	}
	s.pool, s.ref, s.refAt = nil, nil, -1
	return errors.Join(errs...)
}
