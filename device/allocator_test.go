package device

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom"
)

const (
	kiB = 1 << 10
	miB = 1 << 20
)

// newTest returns an allocator over a fake driver of capacity bytes, with
// the fake device's events and sync.
func newTest(t *testing.T, capacity int64) (*Allocator, *fakeRaw, *fakeDevice) {
	t.Helper()
	raw, dev := newFakeRaw(capacity), &fakeDevice{}
	a, err := NewAllocator("fake:0", raw, dev.sync, WithEvents(dev.newEvent))
	if err != nil {
		t.Fatal(err)
	}
	return a, raw, dev
}

func mustAlloc(t *testing.T, a *Allocator, n int64, s Stream) Block {
	t.Helper()
	b, err := a.Alloc(n, s)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", n, err)
	}
	return b
}

func mustFree(t *testing.T, a *Allocator, b Block) {
	t.Helper()
	if err := a.Free(b); err != nil {
		t.Fatalf("Free(%#x): %v", b.Ptr, err)
	}
}

// incomparableStream is a Stream that cannot be a map key.
type incomparableStream struct {
	*fakeStream
	_ []int
}

func TestInvalid(t *testing.T) {
	dev := &fakeDevice{}
	s := dev.stream("s")
	raw := newFakeRaw(64 * miB)
	other, err := NewAllocator("other:0", raw, nil)
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := other.Alloc(100, s)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		do   func(a *Allocator) error
		want string
	}{
		{"nil raw", func(*Allocator) error { _, err := NewAllocator("x", nil, nil); return err }, "nil Raw"},
		{"nil option", func(*Allocator) error { _, err := NewAllocator("x", raw, nil, nil); return err }, "option 0 is nil"},
		{"WithEvents(nil)", func(*Allocator) error { _, err := NewAllocator("x", raw, nil, WithEvents(nil)); return err }, "WithEvents(nil)"},
		{"negative size", func(a *Allocator) error { _, err := a.Alloc(-1, s); return err }, "negative size -1"},
		{"nil stream", func(a *Allocator) error { _, err := a.Alloc(1, nil); return err }, "nil stream"},
		{"incomparable stream", func(a *Allocator) error { _, err := a.Alloc(1, incomparableStream{}); return err }, "not comparable"},
		{"zero block", func(a *Allocator) error { return a.Free(Block{}) }, "a zero Block"},
		{"double free", func(a *Allocator) error {
			b, err := a.Alloc(100, s)
			if err != nil {
				return err
			}
			if err := a.Free(b); err != nil {
				return err
			}
			return a.Free(b)
		}, "freed twice"},
		{"stale copy after reuse", func(a *Allocator) error {
			b, _ := a.Alloc(100, s)
			_ = a.Free(b)
			c, _ := a.Alloc(100, s) // same address, another allocation
			if c.Ptr != b.Ptr {
				return errors.New("test setup: address not reused")
			}
			return a.Free(b)
		}, "freed twice"},
		{"another allocator's block", func(a *Allocator) error { return a.Free(theirs) }, `allocated by allocator "other:0"`},
		{"RecordStream of a freed block", func(a *Allocator) error {
			b, _ := a.Alloc(100, s)
			_ = a.Free(b)
			return a.RecordStream(b, dev.stream("t"))
		}, "freed twice"},
		{"RecordStream nil stream", func(a *Allocator) error {
			b, _ := a.Alloc(100, s)
			return a.RecordStream(b, nil)
		}, "nil stream"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, _, _ := newTest(t, 64*miB)
			err := tt.do(a)
			if !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
				t.Fatalf("err = %v, want one wrapping ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %q, want it to say %q", err, tt.want)
			}
		})
	}
}

func TestSizeClasses(t *testing.T) {
	tests := []struct {
		request, block, segment int64
	}{
		{0, 512, 2 * miB},
		{1, 512, 2 * miB},
		{512, 512, 2 * miB},
		{513, 1024, 2 * miB},
		{1 * miB, 1 * miB, 2 * miB},
		{1*miB + 1, 1*miB + 512, 20 * miB},
		{10*miB - 512, 10*miB - 512, 20 * miB},
		{10*miB - 1, 10 * miB, 10 * miB}, // classes go by the rounded size
		{10 * miB, 10 * miB, 10 * miB},
		{11 * miB, 12 * miB, 12 * miB}, // a large block keeps a rest of ≤ 1 MiB
		{21*miB + 1, 22 * miB, 22 * miB},
	}
	for _, tt := range tests {
		a, _, dev := newTest(t, 1<<30)
		b := mustAlloc(t, a, tt.request, dev.stream("s"))
		st := a.Stats()
		if b.Size != tt.request || st.Allocated != tt.block || st.Reserved != tt.segment || st.Segments != 1 {
			t.Errorf("Alloc(%d): Size %d, Allocated %d, Reserved %d, Segments %d; want %d, %d, %d, 1",
				tt.request, b.Size, st.Allocated, st.Reserved, st.Segments, tt.request, tt.block, tt.segment)
		}
	}
}

// TestReuseAcrossSteps runs a training step's allocations (parameters
// kept, activations and gradients freed each step) and checks that only
// the first step reaches the driver.
func TestReuseAcrossSteps(t *testing.T) {
	sizes := []int64{4 * kiB, 300 * kiB, 1 * miB, 3 * miB, 700, 12 * miB, 5 * miB, 64}
	a, raw, dev := newTest(t, 1<<30)
	s := dev.stream("compute")
	mustAlloc(t, a, 40*miB, s) // parameters, held throughout
	var after []int64
	for step := range 6 {
		var held []Block
		for i, n := range sizes {
			held = append(held, mustAlloc(t, a, n-int64(step%2), s))
			if i%3 == 2 { // some temporaries die during the step
				mustFree(t, a, held[len(held)-2])
				held = append(held[:len(held)-2], held[len(held)-1])
			}
		}
		for i := len(held) - 1; i >= 0; i-- {
			mustFree(t, a, held[i])
		}
		after = append(after, a.Stats().DriverAllocs)
	}
	for i, n := range after {
		if n != after[0] {
			t.Fatalf("DriverAllocs after each step = %v: step %d allocated from the driver", after, i+1)
		}
	}
	if raw.mallocs != int(after[0]) || raw.frees != 0 {
		t.Errorf("driver saw %d mallocs and %d frees, stats say %d", raw.mallocs, raw.frees, after[0])
	}
}

func TestSplitAndMerge(t *testing.T) {
	a, raw, dev := newTest(t, 1<<30)
	s := dev.stream("s")
	x := mustAlloc(t, a, 256*kiB, s)
	y := mustAlloc(t, a, 256*kiB, s)
	z := mustAlloc(t, a, 256*kiB, s)
	if y.Ptr != x.Ptr+256*kiB || z.Ptr != y.Ptr+256*kiB || raw.mallocs != 1 {
		t.Fatalf("three blocks at %#x %#x %#x from %d segments; want consecutive in one", x.Ptr, y.Ptr, z.Ptr, raw.mallocs)
	}
	// x and y free, merged: 512 KiB at x, then z, then the 1.25 MiB tail.
	mustFree(t, a, x)
	mustFree(t, a, y)
	if st := a.Stats(); st.LargestFree != 1280*kiB {
		t.Errorf("LargestFree = %d, want the tail %d", st.LargestFree, 1280*kiB)
	}
	w := mustAlloc(t, a, 512*kiB, s) // best fit: the merged 512 KiB, not the tail
	if w.Ptr != x.Ptr || raw.mallocs != 1 {
		t.Errorf("512 KiB went to %#x (%d mallocs), want the merged block at %#x", w.Ptr, raw.mallocs, x.Ptr)
	}
	mustFree(t, a, w)
	mustFree(t, a, z)
	st := a.Stats()
	if st.LargestFree != 2*miB || st.Fragmentation != 0 {
		t.Errorf("all freed: LargestFree %d, Fragmentation %v; want one 2 MiB block, 0", st.LargestFree, st.Fragmentation)
	}
	if b := mustAlloc(t, a, 1*miB, s); b.Ptr != x.Ptr || raw.mallocs != 1 {
		t.Errorf("1 MiB after merging went to %#x with %d mallocs, want %#x in the first segment", b.Ptr, raw.mallocs, x.Ptr)
	}
}

// TestLargeSplit: a large block is split only when more than 1 MiB is
// left, so a 19.5 MiB request takes a whole 20 MiB segment.
func TestLargeSplit(t *testing.T) {
	tests := []struct {
		request, allocated int64
	}{
		{5 * miB, 5 * miB},
		{18*miB + 512, 18*miB + 512},
		{19 * miB, 20 * miB}, // the 1 MiB rest is not split off
	}
	for _, tt := range tests {
		a, _, dev := newTest(t, 1<<30)
		s := dev.stream("s")
		mustFree(t, a, mustAlloc(t, a, 2*miB, s)) // a 20 MiB segment in the cache
		mustAlloc(t, a, tt.request, s)
		if st := a.Stats(); st.Allocated != tt.allocated || st.Segments != 1 {
			t.Errorf("%d from a cached 20 MiB block: Allocated %d in %d segments, want %d in 1", tt.request, st.Allocated, st.Segments, tt.allocated)
		}
	}
}

func TestStreams(t *testing.T) {
	t.Run("pools are per stream", func(t *testing.T) {
		a, raw, dev := newTest(t, 1<<30)
		s1, s2 := dev.stream("s1"), dev.stream("s2")
		b := mustAlloc(t, a, 4*kiB, s1)
		mustFree(t, a, b)
		c := mustAlloc(t, a, 4*kiB, s2)
		if c.Ptr == b.Ptr || raw.mallocs != 2 {
			t.Errorf("s2 got %#x (s1's block %#x) with %d mallocs; want a segment of its own", c.Ptr, b.Ptr, raw.mallocs)
		}
		if d := mustAlloc(t, a, 4*kiB, s1); d.Ptr != b.Ptr {
			t.Errorf("s1 got %#x, want its cached %#x", d.Ptr, b.Ptr)
		}
	})
	t.Run("pending until the event completes", func(t *testing.T) {
		a, raw, dev := newTest(t, 1<<30)
		compute, comm := dev.stream("compute"), dev.stream("comm")
		b := mustAlloc(t, a, 64*kiB, compute)
		if err := a.RecordStream(b, comm); err != nil {
			t.Fatal(err)
		}
		if err := a.RecordStream(b, compute); err != nil { // its own stream: nothing to wait for
			t.Fatal(err)
		}
		mustFree(t, a, b)
		if st := a.Stats(); st.Pending != 64*kiB || st.Allocated != 0 || dev.made != 1 {
			t.Fatalf("after Free: Pending %d, Allocated %d, %d events; want %d, 0, 1", st.Pending, st.Allocated, dev.made, 64*kiB)
		}
		c := mustAlloc(t, a, 64*kiB, compute)
		if c.Ptr == b.Ptr {
			t.Fatalf("block %#x handed out again while comm's event is pending", b.Ptr)
		}
		mustFree(t, a, c)
		dev.complete(comm)
		d := mustAlloc(t, a, 64*kiB, compute)
		if d.Ptr != b.Ptr || raw.mallocs != 1 {
			t.Errorf("after the event: got %#x with %d mallocs, want %#x from the cache", d.Ptr, raw.mallocs, b.Ptr)
		}
		if st := a.Stats(); st.Pending != 0 {
			t.Errorf("Pending = %d after the event", st.Pending)
		}
		// The event is pooled: a second cross-stream free makes none.
		_ = a.RecordStream(d, comm)
		mustFree(t, a, d)
		if dev.made != 1 {
			t.Errorf("%d events made, want the first one reused", dev.made)
		}
	})
	t.Run("no events: Free synchronises the other streams", func(t *testing.T) {
		dev := &fakeDevice{}
		a, err := NewAllocator("fake:0", newFakeRaw(1<<30), nil)
		if err != nil {
			t.Fatal(err)
		}
		compute, comm := dev.stream("compute"), dev.stream("comm")
		b := mustAlloc(t, a, 64*kiB, compute)
		_ = a.RecordStream(b, comm)
		mustFree(t, a, b)
		if comm.syncs != 1 || compute.syncs != 0 {
			t.Errorf("comm synchronised %d times, compute %d; want 1, 0", comm.syncs, compute.syncs)
		}
		if c := mustAlloc(t, a, 64*kiB, compute); c.Ptr != b.Ptr {
			t.Errorf("got %#x, want %#x reused at once", c.Ptr, b.Ptr)
		}
	})
}

func TestOutOfMemory(t *testing.T) {
	a, raw, dev := newTest(t, 64*miB)
	s := dev.stream("s")
	held := mustAlloc(t, a, 8*miB, s) // a 20 MiB segment
	_, err := a.Alloc(100*miB, s)
	var oom *OOMError
	if !errors.As(err, &oom) || !errors.Is(err, ErrOutOfMemory) || errors.Is(err, loom.ErrInvalid) {
		t.Fatalf("err = %v, want an *OOMError matching ErrOutOfMemory only", err)
	}
	want := OOMError{Device: "fake:0", Requested: 100 * miB, Rounded: 100 * miB, Segment: 100 * miB,
		Free: 44 * miB, Total: 64 * miB, Synced: true}
	got := *oom
	got.Stats = Stats{}
	if got != want {
		t.Errorf("OOMError = %+v, want %+v", got, want)
	}
	if oom.Stats.Allocated != 8*miB || oom.Stats.Reserved != 20*miB || oom.Stats.OOMs != 1 || oom.Stats.Retries != 1 {
		t.Errorf("OOMError.Stats = %+v", oom.Stats)
	}
	for _, part := range []string{"device: fake:0: out of memory allocating 100.0 MiB (104857600 bytes",
		"8.0 MiB allocated, 20.0 MiB reserved (1 segments", "device free 44.0 MiB of 64.0 MiB", "after synchronising"} {
		if !strings.Contains(err.Error(), part) {
			t.Errorf("error %q does not say %q", err, part)
		}
	}
	if dev.syncs != 1 {
		t.Errorf("sync called %d times, want once", dev.syncs)
	}
	// The process goes on: a smaller request succeeds, and nothing leaked.
	small := mustAlloc(t, a, 30*miB, s)
	mustFree(t, a, small)
	mustFree(t, a, held)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Reserved != 0 || st.Allocated != 0 || st.Segments != 0 || raw.liveSegments() != 0 {
		t.Errorf("after freeing all and EmptyCache: %+v, %d driver segments live", st, raw.liveSegments())
	}
	if _, err := a.Alloc(1<<62+1, s); !errors.Is(err, ErrOutOfMemory) || !strings.Contains(err.Error(), "too large for any segment") {
		t.Errorf("Alloc(2^62+1) = %v, want out of memory", err)
	}
}

// TestRetry covers both retries: cached free segments released for a
// request on another stream, and frees pending on events made usable by
// synchronising the device.
func TestRetry(t *testing.T) {
	t.Run("release cached segments", func(t *testing.T) {
		a, _, dev := newTest(t, 64*miB)
		s1, s2 := dev.stream("s1"), dev.stream("s2")
		b1, b2 := mustAlloc(t, a, 5*miB, s1), mustAlloc(t, a, 2*miB, s2)
		mustFree(t, a, b1) // s1's 20 MiB segment is cached
		mustAlloc(t, a, 40*miB, s2)
		st := a.Stats()
		if st.Retries != 1 || st.DriverFrees != 1 || st.Reserved != 60*miB || dev.syncs != 0 {
			t.Errorf("Retries %d, DriverFrees %d, Reserved %d, syncs %d; want 1, 1, %d, 0", st.Retries, st.DriverFrees, st.Reserved, dev.syncs, 60*miB)
		}
		mustFree(t, a, b2)
	})
	t.Run("synchronise for pending frees", func(t *testing.T) {
		a, raw, dev := newTest(t, 40*miB)
		compute, comm := dev.stream("compute"), dev.stream("comm")
		b := mustAlloc(t, a, 30*miB, compute)
		_ = a.RecordStream(b, comm)
		mustFree(t, a, b) // pending on comm's event
		c, err := a.Alloc(30*miB, compute)
		if err != nil {
			t.Fatalf("Alloc after a pending free: %v", err)
		}
		if c.Ptr != b.Ptr || dev.syncs != 1 || raw.mallocs != 1 {
			t.Errorf("got %#x after %d syncs and %d mallocs, want %#x after 1 sync, 1 malloc", c.Ptr, dev.syncs, raw.mallocs, b.Ptr)
		}
	})
	t.Run("no sync function", func(t *testing.T) {
		raw, dev := newFakeRaw(40*miB), &fakeDevice{}
		a, err := NewAllocator("fake:0", raw, nil, WithEvents(dev.newEvent))
		if err != nil {
			t.Fatal(err)
		}
		compute, comm := dev.stream("compute"), dev.stream("comm")
		b := mustAlloc(t, a, 30*miB, compute)
		_ = a.RecordStream(b, comm)
		mustFree(t, a, b)
		_, err = a.Alloc(30*miB, compute)
		if !errors.Is(err, ErrOutOfMemory) || !strings.Contains(err.Error(), "30.0 MiB pending") || !strings.Contains(err.Error(), "no sync function") {
			t.Errorf("err = %v, want out of memory naming the pending bytes and the missing sync", err)
		}
	})
}

// TestDriverErrors: a failing driver or event call is returned with
// context, leaves the allocator consistent, and once the failure is gone
// the same call succeeds.
func TestDriverErrors(t *testing.T) {
	broken := errors.New("device lost")
	tests := []struct {
		name string
		// do breaks something, makes the failing call and returns its
		// error, the undo of the break and the call to repeat.
		do   func(a *Allocator, raw *fakeRaw, dev *fakeDevice, s, comm *fakeStream) (undo func(), again func() error, err error)
		want string
	}{
		{"Malloc fails, not out of memory", func(a *Allocator, raw *fakeRaw, _ *fakeDevice, s, _ *fakeStream) (func(), func() error, error) {
			raw.failMalloc = broken
			again := func() error { _, err := a.Alloc(100, s); return err }
			return func() { raw.failMalloc = nil }, again, again()
		}, "allocating a segment of 2097152 bytes: device lost"},
		{"Record fails: the block stays allocated", func(a *Allocator, _ *fakeRaw, dev *fakeDevice, s, comm *fakeStream) (func(), func() error, error) {
			b, _ := a.Alloc(100, s)
			_ = a.RecordStream(b, comm)
			dev.failRecord = broken
			again := func() error { return a.Free(b) }
			return func() { dev.failRecord = nil }, again, again()
		}, "Free: recording an event on a stream the block was used on: device lost"},
		{"Query fails", func(a *Allocator, _ *fakeRaw, dev *fakeDevice, s, comm *fakeStream) (func(), func() error, error) {
			b, _ := a.Alloc(100, s)
			_ = a.RecordStream(b, comm)
			_ = a.Free(b)
			dev.failQuery = broken
			again := func() error { _, err := a.Alloc(100, s); return err }
			return func() { dev.failQuery = nil }, again, again()
		}, "querying an event of a pending free: device lost"},
		{"driver Free fails: the segment stays", func(a *Allocator, raw *fakeRaw, _ *fakeDevice, s, _ *fakeStream) (func(), func() error, error) {
			b, _ := a.Alloc(100, s)
			_ = a.Free(b)
			raw.failFree = broken
			again := a.EmptyCache
			return func() { raw.failFree = nil }, again, again()
		}, "freeing a segment of 2097152 bytes: device lost"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, raw, dev := newTest(t, 1<<30)
			s, comm := dev.stream("s"), dev.stream("comm")
			undo, again, err := tt.do(a, raw, dev, s, comm)
			if !errors.Is(err, broken) || errors.Is(err, ErrOutOfMemory) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want it to wrap the driver's error and say %q", err, tt.want)
			}
			if st := a.Stats(); st.Retries != 0 || st.OOMs != 0 {
				t.Errorf("Retries %d, OOMs %d after a driver error, want none", st.Retries, st.OOMs)
			}
			undo()
			if err := again(); err != nil {
				t.Fatalf("after the failure is gone: %v", err)
			}
		})
	}
}

func TestEmptyCache(t *testing.T) {
	a, raw, dev := newTest(t, 1<<30)
	s1, s2 := dev.stream("s1"), dev.stream("s2")
	var all []Block
	for _, n := range []int64{100, 1 * miB, 3 * miB, 15 * miB, 200 * kiB} {
		for _, s := range []*fakeStream{s1, s2} {
			all = append(all, mustAlloc(t, a, n, s))
		}
	}
	kept := all[0]
	_ = a.RecordStream(all[3], s1) // one free still pending on an event
	for _, b := range all[1:] {
		mustFree(t, a, b)
	}
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	st := a.Stats()
	if st.Segments != 1 || st.Reserved != 2*miB || st.Pending != 0 || raw.liveSegments() != 1 {
		t.Errorf("with one block held: %+v, %d driver segments; want only its 2 MiB segment", st, raw.liveSegments())
	}
	for _, e := range dev.events {
		if !e.closed {
			t.Errorf("an idle event was not closed")
		}
	}
	mustFree(t, a, kept)
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Reserved != 0 || st.Segments != 0 || st.DriverFrees != st.DriverAllocs || raw.liveSegments() != 0 {
		t.Errorf("all freed: %+v, %d driver segments", st, raw.liveSegments())
	}
	// Still usable, with fresh events.
	b := mustAlloc(t, a, 100, s1)
	_ = a.RecordStream(b, s2)
	mustFree(t, a, b)
}

func TestStats(t *testing.T) {
	a, _, dev := newTest(t, 1<<30)
	s := dev.stream("s")
	x := mustAlloc(t, a, 512*kiB, s)
	y := mustAlloc(t, a, 512*kiB, s)
	z := mustAlloc(t, a, 512*kiB, s) // 512 KiB left at the end of the 2 MiB segment
	big := mustAlloc(t, a, 15*miB, s)
	check := func(what string, want Stats) {
		t.Helper()
		got := a.Stats()
		got.DriverAllocs, got.DriverFrees, got.Retries, got.OOMs = 0, 0, 0, 0
		if got != want {
			t.Errorf("%s:\n got %+v\nwant %+v", what, got, want)
		}
	}
	// The 15 MiB block is its whole 16 MiB segment: a rest of 1 MiB is not split off.
	check("four blocks", Stats{Allocated: 1536*kiB + 16*miB, Reserved: 2*miB + 16*miB, PeakAllocated: 1536*kiB + 16*miB,
		PeakReserved: 18 * miB, LargestFree: 512 * kiB, Segments: 2})
	mustFree(t, a, big)
	mustFree(t, a, x) // free: 512 KiB at x and 512 KiB at the end, apart
	check("x and big freed", Stats{Allocated: 1 * miB, Reserved: 18 * miB, PeakAllocated: 1536*kiB + 16*miB,
		PeakReserved: 18 * miB, LargestFree: 16 * miB, Fragmentation: 1 - float64(16*miB)/float64(17*miB), Segments: 2})
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	a.ResetPeak()
	check("EmptyCache and ResetPeak", Stats{Allocated: 1 * miB, Reserved: 2 * miB, PeakAllocated: 1 * miB,
		PeakReserved: 2 * miB, LargestFree: 512 * kiB, Fragmentation: 0.5, Segments: 1})
	mustFree(t, a, y)
	mustFree(t, a, z)
	check("all freed", Stats{Reserved: 2 * miB, PeakAllocated: 1 * miB, PeakReserved: 2 * miB, LargestFree: 2 * miB, Segments: 1})

	js, err := json.Marshal(a.Stats())
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"allocated", "reserved", "pending", "peak_allocated", "peak_reserved", "largest_free",
		"fragmentation", "segments", "driver_allocs", "driver_frees", "retries", "ooms"} {
		if !strings.Contains(string(js), `"`+key+`":`) {
			t.Errorf("JSON %s lacks %q", js, key)
		}
	}
}

// TestConcurrent runs allocations, cross-stream frees and Stats from
// several goroutines; run it with -race.
func TestConcurrent(t *testing.T) {
	a, raw, dev := newTest(t, 1<<30)
	comm := dev.stream("comm")
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := dev.stream("compute")
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			var held []Block
			for i := range 300 {
				b, err := a.Alloc(rng.Int64N(3*miB), s)
				if err != nil {
					t.Error(err)
					return
				}
				if i%5 == 0 {
					_ = a.RecordStream(b, comm)
				}
				held = append(held, b)
				if len(held) > 8 {
					j := rng.IntN(len(held))
					if err := a.Free(held[j]); err != nil {
						t.Error(err)
						return
					}
					held = append(held[:j], held[j+1:]...)
				}
				if i%50 == 0 {
					dev.complete(comm)
					_ = a.Stats()
				}
			}
			for _, b := range held {
				if err := a.Free(b); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	if err := a.EmptyCache(); err != nil {
		t.Fatal(err)
	}
	if st := a.Stats(); st.Allocated != 0 || st.Reserved != 0 || raw.liveSegments() != 0 {
		t.Errorf("after all goroutines: %+v, %d driver segments", st, raw.liveSegments())
	}
}
