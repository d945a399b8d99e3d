package trace_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/trace"
)

// describe lists a rank's comm and wait events as "lane op group seq".
func describe(evs []trace.Event, rank int) []string {
	var out []string
	for _, e := range evs {
		if e.Rank != rank || e.Lane == trace.LaneCompute {
			continue
		}
		out = append(out, fmt.Sprintf("%v %s %s %d", e.Lane, e.Name, e.Group, e.Seq))
	}
	slices.Sort(out)
	return out
}

// TestCommEvents runs blocking, async, split and point-to-point calls on
// four traced local ranks and checks every event, its group label and
// that its times come from the flight recorder.
func TestCommEvents(t *testing.T) {
	tl := trace.NewTimeline()
	err := local.Run(context.Background(), 4, func(ctx context.Context, world comm.Communicator) error {
		r := world.Rank()
		c := trace.Comm(world, tl, r)
		if trace.Comm(c, tl, r) != c {
			return errors.New("wrapping a traced communicator again wrapped it twice")
		}
		x := comm.Host(make([]float64, 1000))
		if err := comm.AllReduce(ctx, c, x, x, comm.Sum); err != nil {
			return err
		}
		w, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum)
		if err != nil {
			return err
		}
		if err := w.Wait(ctx); err != nil {
			return err
		}
		// Reverse order within each part: [2,0] and [3,1].
		child, err := c.Split(ctx, r%2, -r)
		if err != nil {
			return err
		}
		y := comm.Host(make([]float32, 10))
		if err := comm.AllGather(ctx, child, y.SliceHost(child.Rank()*5, child.Rank()*5+5), y); err != nil {
			return err
		}
		switch r {
		case 0:
			err = comm.Send(ctx, c, y, 1, 7)
		case 1:
			err = comm.Recv(ctx, c, y, 0, 7)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	evs := tl.Events()
	if n := tl.Pending(); n != 0 {
		t.Errorf("%d calls still pending", n)
	}
	world := "[0,1,2,3]"
	base := []string{
		"comm allreduce " + world + " 1", "comm allreduce " + world + " 2", "comm split " + world + " 3",
		"wait allreduce " + world + " 0", "wait split " + world + " 0",
	}
	for r, extra := range [][]string{
		{"comm allgather [2,0] 1", "wait allgather [2,0] 0", "comm send " + world + " 1", "wait send " + world + " 0"},
		{"comm allgather [3,1] 1", "wait allgather [3,1] 0", "comm recv " + world + " 1", "wait recv " + world + " 0"},
		{"comm allgather [2,0] 1", "wait allgather [2,0] 0"},
		{"comm allgather [3,1] 1", "wait allgather [3,1] 0"},
	} {
		got := describe(evs, r)
		// The async all-reduce's Wait records a wait event only if it
		// found the work still running: drop that one if present.
		if n := slices.Index(got, "wait allreduce "+world+" 0"); n >= 0 && n+1 < len(got) && got[n+1] == got[n] {
			got = slices.Delete(got, n, n+1)
		}
		want := slices.Concat(base, extra)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("rank %d events\n got %q\nwant %q", r, got, want)
		}
	}
	for _, e := range evs {
		if e.Note != "" || e.Failed {
			t.Errorf("event %+v: note %q, failed %v; want recorder times", e, e.Note, e.Failed)
		}
		if e.End < e.Start || e.Start < e.Issued {
			t.Errorf("event %+v: times out of order", e)
		}
		if e.Lane == trace.LaneComm && e.Name == "allreduce" && (e.Bytes != 8000 || e.DType != comm.Float64 || e.Peer != -1) {
			t.Errorf("all-reduce event %+v: want 8000 bytes of float64, no peer", e)
		}
		if e.Name == "send" && e.Peer != 1 {
			t.Errorf("send event %+v: peer %d, want 1", e, e.Peer)
		}
	}
	// A blocking call's execution lies inside the time its caller waited.
	for r := range 4 {
		var do, wait trace.Event
		for _, e := range evs {
			if e.Rank == r && e.Name == "allreduce" && e.Seq == 1 {
				do = e
			}
			if e.Rank == r && e.Lane == trace.LaneWait && e.Name == "allreduce" && (wait.Lane == 0 || e.Start < wait.Start) {
				wait = e
			}
		}
		if do.Start < wait.Start || do.End > wait.End {
			t.Errorf("rank %d: blocking all-reduce executed %v..%v outside its wait %v..%v", r, do.Start, do.End, wait.Start, wait.End)
		}
	}
}

// TestMeshGroups checks that the sub-communicators a mesh creates are
// traced and labelled by their ranks, so dp and tp collectives differ.
func TestMeshGroups(t *testing.T) {
	tl := trace.NewTimeline()
	err := local.Run(context.Background(), 4, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(trace.Comm(world, tl, world.Rank()), []int{2, 2}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		for _, axis := range []string{"dp", "tp"} {
			c, err := m.Comm(ctx, axis)
			if err != nil {
				return err
			}
			x := comm.Host([]float32{1})
			if err := comm.AllReduce(ctx, c, x, x, comm.Sum); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := map[int][]string{ // dp groups share tp coordinates and vice versa
		0: {"[0,1]", "[0,2]"}, 1: {"[0,1]", "[1,3]"}, 2: {"[0,2]", "[2,3]"}, 3: {"[1,3]", "[2,3]"},
	}
	got := map[int][]string{}
	for _, e := range tl.Events() {
		if e.Lane == trace.LaneComm && e.Name == "allreduce" {
			got[e.Rank] = append(got[e.Rank], e.Group)
		}
	}
	for r := range 4 {
		slices.Sort(got[r])
		if !slices.Equal(got[r], want[r]) {
			t.Errorf("rank %d: all-reduce groups %q, want %q", r, got[r], want[r])
		}
	}
}

// TestResolveWithinRecorder issues more calls than the automatic resolve
// interval: every call must get its recorder entry before the ring
// overwrites it, and a ring too small for that falls back to the
// wrapper's own times without losing a call.
func TestResolveWithinRecorder(t *testing.T) {
	for _, tc := range []struct {
		name     string
		size     int // recorder size
		wantNote string
	}{
		{"default recorder", 0, ""},
		{"tiny recorder", 8, "observed by the wrapper"},
	} {
		tl := trace.NewTimeline()
		const calls = 700
		err := local.Run(context.Background(), 2, func(ctx context.Context, world comm.Communicator) error {
			c := trace.Comm(world, tl, world.Rank())
			x := comm.Host([]int32{1})
			for range calls {
				if err := comm.AllReduce(ctx, c, x, x, comm.Sum); err != nil {
					return err
				}
			}
			return nil
		}, local.WithOptions(comm.Options{RecorderSize: tc.size}))
		if err != nil {
			t.Fatal(err)
		}
		notes := map[string]int{}
		var seqs []uint64
		for _, e := range tl.Events() {
			if e.Rank == 0 && e.Lane == trace.LaneComm {
				notes[e.Note]++
				seqs = append(seqs, e.Seq)
			}
		}
		if len(seqs) != calls {
			t.Errorf("%s: %d comm events, want %d", tc.name, len(seqs), calls)
		}
		if notes[tc.wantNote] == 0 {
			t.Errorf("%s: notes %v, want some %q", tc.name, notes, tc.wantNote)
		}
		if tc.wantNote == "" && len(notes) != 1 {
			t.Errorf("%s: notes %v, want every event from the recorder", tc.name, notes)
		}
		if tc.wantNote == "" {
			for i, s := range seqs {
				if s != uint64(i+1) {
					t.Errorf("%s: event %d has seq %d", tc.name, i, s)
					break
				}
			}
		}
	}
}

// fake is a communicator without a flight recorder whose async work
// completes when the test says.
type fake struct {
	name  string
	size  int
	delay time.Duration
	mu    sync.Mutex
	works []*fakeWork
}

type fakeWork struct {
	done chan struct{}
}

func (w *fakeWork) Done() <-chan struct{} { return w.done }
func (w *fakeWork) Wait(ctx context.Context) error {
	select {
	case <-w.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (f *fake) Rank() int { return 0 }
func (f *fake) Size() int { return f.size }
func (f *fake) Do(ctx context.Context, c comm.Call) error {
	time.Sleep(f.delay)
	if c.Op == comm.OpBarrier {
		return errors.New("fake barrier failed")
	}
	return nil
}
func (f *fake) Start(ctx context.Context, c comm.Call) (comm.Work, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := &fakeWork{done: make(chan struct{})}
	f.works = append(f.works, w)
	return w, nil
}
func (f *fake) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	if color < 0 {
		return nil, nil
	}
	return &fake{name: "fakechild", size: 2, delay: f.delay}, nil
}
func (f *fake) Abort(error)              {}
func (f *fake) Err() error               { return nil }
func (f *fake) Recorder() *comm.Recorder { return nil }
func (f *fake) Backend() string          { return "fake" }
func (f *fake) Name() string             { return f.name }

// finish completes the i-th async work.
func (f *fake) finish(i int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	close(f.works[i].done)
}

// TestFallbackWithoutRecorder checks the wrapper's own times where the
// backend has no flight recorder.
func TestFallbackWithoutRecorder(t *testing.T) {
	ctx := context.Background()
	tl := trace.NewTimeline()
	f := &fake{name: "fakeworld", size: 1, delay: 2 * time.Millisecond}
	c := trace.Comm(f, tl, 5)
	x := comm.Host([]float32{1, 2})

	// A blocking call: its whole duration.
	if err := comm.AllReduce(ctx, c, x, x, comm.Sum); err != nil {
		t.Fatal(err)
	}
	// A failed blocking call.
	if err := comm.Barrier(ctx, c); err == nil {
		t.Fatal("the fake barrier did not fail")
	}
	// An async call whose Wait blocks until the work completes.
	w0, err := comm.BroadcastAsync(ctx, c, x, 0)
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(3 * time.Millisecond); f.finish(0) }()
	if err := w0.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	// An async call complete before its Wait: the end is a bound.
	w1, err := comm.AllGatherAsync(ctx, c, x, x)
	if err != nil {
		t.Fatal(err)
	}
	f.finish(1)
	<-w1.Done()
	if err := w1.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	// An async call never waited for.
	if _, err := comm.SendAsync(ctx, c, x, 0, 1); err != nil {
		t.Fatal(err)
	}
	// Split: the child is traced; a negative color gives a nil child.
	child, err := c.Split(ctx, 0, 0)
	if err != nil || child == nil {
		t.Fatalf("Split: %v, %v", child, err)
	}
	if none, err := c.Split(ctx, -1, 0); none != nil || err != nil {
		t.Fatalf("Split(-1): %v, %v; want a nil communicator", none, err)
	}
	if err := comm.Barrier(ctx, child); err == nil {
		t.Fatal("the child's fake barrier did not fail")
	}

	got := map[string]trace.Event{}
	for _, e := range tl.Events() {
		if e.Rank != 5 {
			t.Errorf("event on rank %d, want 5", e.Rank)
		}
		k := fmt.Sprintf("%v %s %s", e.Lane, e.Name, e.Group)
		if _, dup := got[k]; dup && e.Name != "split" {
			t.Errorf("two %q events", k)
		}
		got[k] = e
	}
	// The root's only member is known ("[5]"); the child has a member
	// this timeline never saw, so it is named by the backend.
	const cg = "fakechild (size 2)"
	for _, tc := range []struct {
		key    string
		note   string
		failed bool
		minDur time.Duration
	}{
		{"comm allreduce [5]", "observed by the wrapper", false, 2 * time.Millisecond},
		{"wait allreduce [5]", "", false, 2 * time.Millisecond},
		{"comm barrier [5]", "observed by the wrapper", true, 2 * time.Millisecond},
		{"wait barrier [5]", "", true, 2 * time.Millisecond},
		{"comm broadcast [5]", "observed by the wrapper", false, 3 * time.Millisecond},
		{"wait broadcast [5]", "", false, time.Millisecond},
		{"comm allgather [5]", "end is an upper bound", false, 0},
		{"comm send [5]", "end unknown", false, 0},
		{"comm barrier " + cg, "observed by the wrapper", true, 2 * time.Millisecond},
	} {
		e, ok := got[tc.key]
		if !ok {
			t.Errorf("no %q event; have %v", tc.key, keys(got))
			continue
		}
		if e.Note != tc.note || e.Failed != tc.failed || e.Duration() < tc.minDur {
			t.Errorf("%s: note %q, failed %v, duration %v; want %q, %v, at least %v", tc.key, e.Note, e.Failed, e.Duration(), tc.note, tc.failed, tc.minDur)
		}
	}
	if e := got["comm send [5]"]; e.Duration() != 0 {
		t.Errorf("unknown end: duration %v, want 0", e.Duration())
	}
	if _, ok := got["wait allgather [5]"]; ok {
		t.Error("a Wait that found the work complete recorded a wait event")
	}
}

func keys(m map[string]trace.Event) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// TestConformanceThroughWrapper runs the backend conformance suite (a
// reduced matrix) through the wrapper: tracing must not change results,
// and every call must become an event.
func TestConformanceThroughWrapper(t *testing.T) {
	tl := trace.NewTimeline()
	launch := func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		return local.Run(ctx, p, func(ctx context.Context, c comm.Communicator) error {
			return fn(ctx, trace.Comm(c, tl, c.Rank()))
		})
	}
	commtest.Run(t, launch, commtest.Config{Ranks: []int{1, 3}, Large: 1001, Short: true})
	evs := tl.Events()
	ops := map[string]bool{}
	for _, e := range evs {
		if e.Lane == trace.LaneComm {
			ops[e.Name] = true
			if e.Note != "" && !strings.HasPrefix(e.Note, "observed") {
				t.Errorf("event %+v: note %q", e, e.Note)
			}
		}
	}
	for _, op := range []string{"allreduce", "broadcast", "reduce", "allgather", "reducescatter", "gather", "scatter", "alltoall", "alltoallv", "send", "recv", "barrier", "split"} {
		if !ops[op] {
			t.Errorf("no %s event (ops seen: %v)", op, ops)
		}
	}
	if n := tl.Pending(); n != 0 {
		t.Errorf("%d calls pending after every rank returned", n)
	}
}

// TestShareThroughWrapper checks that wrapping keeps comm.SharedMemory
// where the wrapped communicator has it (the world and its Split children),
// records a Share as the barrier it runs as, and claims nothing for a
// communicator without it.
func TestShareThroughWrapper(t *testing.T) {
	tl := trace.NewTimeline()
	err := local.Run(context.Background(), 3, func(ctx context.Context, world comm.Communicator) error {
		r := world.Rank()
		c := trace.Comm(world, tl, r)
		if trace.Comm(c, tl, r) != c {
			return errors.New("wrapping a traced communicator again wrapped it twice")
		}
		child, err := c.Split(ctx, 0, r)
		if err != nil {
			return err
		}
		for _, x := range []comm.Communicator{c, child} {
			sm, ok := x.(comm.SharedMemory)
			if !ok {
				return fmt.Errorf("traced %T does not implement comm.SharedMemory", x)
			}
			var got []any
			if err := sm.Share(ctx, 10*r, func(peers []any) error { got = peers; return nil }); err != nil {
				return err
			}
			if want := []any{0, 10, 20}; !slices.Equal(got, want) {
				return fmt.Errorf("rank %d: Share through the wrapper saw %v, want %v", r, got, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for r := range 3 {
		got := describe(tl.Events(), r)
		// The world: split #1, then the Share, barrier #2; the child
		// (the same ranks): its Share, barrier #1.
		want := []string{"comm barrier [0,1,2] 1", "comm barrier [0,1,2] 2", "comm split [0,1,2] 1",
			"wait barrier [0,1,2] 0", "wait barrier [0,1,2] 0", "wait split [0,1,2] 0"}
		if !slices.Equal(got, want) {
			t.Errorf("rank %d events\n got %q\nwant %q", r, got, want)
		}
	}
	if _, ok := trace.Comm(&fake{name: "fakeworld", size: 1}, tl, 0).(comm.SharedMemory); ok {
		t.Error("a traced communicator without Share claims comm.SharedMemory")
	}
}
