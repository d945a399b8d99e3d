package device

import (
	"fmt"
	"sync"
	"time"
)

// fakeRaw is device memory with a capacity: addresses are never reused,
// and it counts its calls.
type fakeRaw struct {
	mu             sync.Mutex
	capacity, used int64
	next           uintptr
	live           map[uintptr]int64
	mallocs, frees int
	failMalloc     error // returned by Malloc while set
	failFree       error // returned by Free while set
}

func newFakeRaw(capacity int64) *fakeRaw {
	return &fakeRaw{capacity: capacity, next: 1 << 32, live: map[uintptr]int64{}}
}

func (r *fakeRaw) Malloc(n int64) (uintptr, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failMalloc != nil {
		return 0, r.failMalloc
	}
	if r.used+n > r.capacity {
		return 0, fmt.Errorf("fake driver: %d bytes with %d free: %w", n, r.capacity-r.used, ErrOutOfMemory)
	}
	p := r.next
	r.next += uintptr(n) + 4096 // a gap, so that two segments are never adjacent by accident
	r.live[p] = n
	r.used += n
	r.mallocs++
	return p, nil
}

func (r *fakeRaw) Free(p uintptr) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.failFree != nil {
		return r.failFree
	}
	n, ok := r.live[p]
	if !ok {
		return fmt.Errorf("fake driver: free of %#x, not allocated", p)
	}
	delete(r.live, p)
	r.used -= n
	r.frees++
	return nil
}

func (r *fakeRaw) MemInfo() (free, total int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.capacity - r.used, r.capacity
}

func (r *fakeRaw) liveSegments() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live)
}

// fakeDevice orders fake streams and events: an event recorded on a
// stream completes only when the test says so (complete), when its
// stream is synchronised, or when the device is (sync).
type fakeDevice struct {
	mu     sync.Mutex
	events []*fakeEvent
	syncs  int // calls of sync
	made   int // events made

	failRecord, failQuery error // returned by every event's Record or Query while set
}

type fakeStream struct {
	d     *fakeDevice
	name  string
	syncs int
}

type fakeEvent struct {
	d      *fakeDevice
	stream *fakeStream
	done   bool
	closed bool
}

func (d *fakeDevice) stream(name string) *fakeStream { return &fakeStream{d: d, name: name} }

func (d *fakeDevice) newEvent() (Event, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := &fakeEvent{d: d, done: true}
	d.events = append(d.events, e)
	d.made++
	return e, nil
}

// complete finishes the work queued on s so far.
func (d *fakeDevice) complete(s *fakeStream) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, e := range d.events {
		if e.stream == s {
			e.done = true
		}
	}
}

// sync finishes all work: the allocator's sync function.
func (d *fakeDevice) sync() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.syncs++
	for _, e := range d.events {
		e.done = true
	}
	return nil
}

func (s *fakeStream) Owner() Device         { return nil }
func (s *fakeStream) WaitEvent(Event) error { return nil }

func (s *fakeStream) Synchronize() error {
	s.d.complete(s)
	s.d.mu.Lock()
	s.syncs++
	s.d.mu.Unlock()
	return nil
}

func (s *fakeStream) Query() (bool, error) {
	s.d.mu.Lock()
	defer s.d.mu.Unlock()
	for _, e := range s.d.events {
		if e.stream == s && !e.done {
			return false, nil
		}
	}
	return true, nil
}

func (e *fakeEvent) Record(s Stream) error {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	if e.closed {
		return fmt.Errorf("fake event: record after close")
	}
	if e.d.failRecord != nil {
		return e.d.failRecord
	}
	e.stream, e.done = s.(*fakeStream), false
	return nil
}

func (e *fakeEvent) Query() (bool, error) {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	if e.d.failQuery != nil {
		return false, e.d.failQuery
	}
	return e.done, nil
}

func (e *fakeEvent) Synchronize() error {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	e.done = true
	return nil
}

func (e *fakeEvent) Since(Event) (time.Duration, error) { return 0, nil }

func (e *fakeEvent) Close() error {
	e.d.mu.Lock()
	defer e.d.mu.Unlock()
	e.closed = true
	return nil
}
