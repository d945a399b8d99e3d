package trace_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/trace"
)

// TestNilTimeline checks that a nil *Timeline is a no-op everywhere.
func TestNilTimeline(t *testing.T) {
	var tl *trace.Timeline
	tl.Begin(0, "x").End()
	trace.Span{}.End()
	if err := tl.Record(0, trace.LaneCompute, "x", time.Now(), time.Now()); err != nil {
		t.Errorf("Record on nil: %v", err)
	}
	if tl.TapeObserver(0) != nil {
		t.Error("TapeObserver on nil is not nil")
	}
	tl.Reset()
	if n := len(tl.Events()); n != 0 || tl.Dropped() != 0 || tl.Pending() != 0 || tl.Now() != 0 || !tl.Epoch().IsZero() {
		t.Errorf("nil timeline: %d events, %d dropped, %d pending, now %v", n, tl.Dropped(), tl.Pending(), tl.Now())
	}
	if got := tl.Overlap(0, trace.Window{}, nil); got != (trace.OverlapStats{}) {
		t.Errorf("Overlap on nil: %+v", got)
	}
	var buf bytes.Buffer
	if err := tl.WriteChrome(&buf); err != nil || !json.Valid(buf.Bytes()) {
		t.Errorf("WriteChrome on nil: %v, valid %v: %s", err, json.Valid(buf.Bytes()), buf.String())
	}
	err := local.Run(context.Background(), 1, func(ctx context.Context, c comm.Communicator) error {
		if got := trace.Comm(c, nil, 0); got != c {
			return fmt.Errorf("Comm with a nil timeline wrapped the communicator: %T", got)
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

func TestBeginRecordLanes(t *testing.T) {
	tl := trace.NewTimeline()
	outer := tl.Begin(3, "step")
	tl.Begin(3, "forward").End()
	outer.End()
	if err := tl.Record(1, trace.LaneWait, "w", tl.Epoch().Add(time.Millisecond), tl.Epoch()); err != nil {
		t.Fatal(err)
	}
	if err := tl.Record(1, trace.Lane(9), "bad", time.Now(), time.Now()); !errors.Is(err, trace.ErrInvalid) {
		t.Errorf("Record with an invalid lane: %v, want ErrInvalid", err)
	}
	evs := tl.Events()
	var got []string
	for _, e := range evs {
		got = append(got, fmt.Sprintf("%d %v %s", e.Rank, e.Lane, e.Name))
	}
	want := []string{"1 wait w", "3 compute step", "3 compute forward"}
	if !slices.Equal(got, want) {
		t.Fatalf("events %q, want %q", got, want)
	}
	if evs[0].Duration() != 0 || evs[0].Start != time.Millisecond {
		t.Errorf("an end before the start: %+v, want zero length at 1ms", evs[0])
	}
	if evs[2].Start < evs[1].Start || evs[2].End > evs[1].End {
		t.Errorf("forward %v..%v is not inside step %v..%v", evs[2].Start, evs[2].End, evs[1].Start, evs[1].End)
	}
	for _, l := range []trace.Lane{trace.LaneCompute, trace.LaneComm, trace.LaneWait, 0} {
		if l.Valid() == (l == 0) {
			t.Errorf("Lane(%d).Valid() = %v", l, l.Valid())
		}
	}
	if s := trace.Lane(7).String(); s != "lane(7)" {
		t.Errorf("Lane(7).String() = %q", s)
	}
}

func TestCapacityAndReset(t *testing.T) {
	tl := trace.NewTimeline(trace.WithCapacity(2))
	for range 5 {
		tl.Begin(0, "x").End()
	}
	if n, d := len(tl.Events()), tl.Dropped(); n != 2 || d != 3 {
		t.Errorf("capacity 2 after 5 spans: %d events, %d dropped; want 2 and 3", n, d)
	}
	tl.Reset()
	if n, d := len(tl.Events()), tl.Dropped(); n != 0 || d != 0 {
		t.Errorf("after Reset: %d events, %d dropped", n, d)
	}
}

// TestConcurrentRecording records from many goroutines at once (run it
// with -race).
func TestConcurrentRecording(t *testing.T) {
	tl := trace.NewTimeline()
	const goroutines, spans = 8, 500
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			obs := tl.TapeObserver(g)
			for range spans {
				s := tl.Begin(g, "op")
				obs("Linear", autograd.PhaseBackward, time.Now(), time.Now())
				s.End()
			}
		}()
	}
	wg.Wait()
	if n := len(tl.Events()); n != 2*goroutines*spans {
		t.Errorf("%d events, want %d", n, 2*goroutines*spans)
	}
}

// TestNoAllocationPerSpan checks that recording a span allocates nothing
// once the event slice has grown.
func TestNoAllocationPerSpan(t *testing.T) {
	tl := trace.NewTimeline()
	for range 4096 {
		tl.Begin(0, "warm").End()
	}
	tl.Reset() // keeps the slice's capacity
	obs := tl.TapeObserver(1)
	now := time.Now()
	for name, fn := range map[string]func(){
		"Begin/End":    func() { tl.Begin(0, "forward").End() },
		"TapeObserver": func() { obs("Linear", autograd.PhaseForward, now, now) },
		"Record":       func() { _ = tl.Record(2, trace.LaneCompute, "x", now, now) },
	} {
		if a := testing.AllocsPerRun(1000, fn); a != 0 {
			t.Errorf("%s: %v allocations per span, want 0", name, a)
		}
	}
}

// TestTapeObserver checks the compute events of a tape's forward,
// backward and hooks on a one-rank mesh.
func TestTapeObserver(t *testing.T) {
	tl := trace.NewTimeline()
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape(autograd.WithObserver(tl.TapeObserver(m.WorldRank())))
		param := func(name string, shape []int, seed uint64) (*autograd.Value, error) {
			spec, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{placement.Replicate()})
			if err != nil {
				return nil, err
			}
			dt, err := placement.FromFull(spec, placementtest.Random(shape, comm.Float64, seed))
			if err != nil {
				return nil, err
			}
			return tape.Param(name, dt)
		}
		x, err := param("x", []int{4, 3}, 1)
		if err != nil {
			return err
		}
		w, err := param("w", []int{2, 3}, 2)
		if err != nil {
			return err
		}
		hooked := 0
		if err := w.OnGradReady(func(context.Context, *autograd.Value) error { hooked++; return nil }); err != nil {
			return err
		}
		y, err := autograd.Linear(x, w, nil)
		if err != nil {
			return err
		}
		if y, err = autograd.GELU(y); err != nil {
			return err
		}
		loss, err := autograd.Sum(y)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if hooked != 1 {
			return fmt.Errorf("hook ran %d times", hooked)
		}
		return nil
	})
	var got []string
	for _, e := range tl.Events() {
		if e.Lane != trace.LaneCompute || e.Rank != 0 || e.End < e.Start {
			t.Errorf("unexpected event %+v", e)
		}
		got = append(got, e.Cat+" "+e.Name)
	}
	// Events sort by start time: forward in order, then backward in
	// reverse, w's hook after Linear's backward (x has no hook: it fires
	// no PhaseHooks event).
	want := []string{
		"forward Linear", "forward GELU", "forward Sum",
		"backward Sum", "backward GELU", "backward Linear", "hooks w",
	}
	if !slices.Equal(got, want) {
		t.Errorf("tape events %q, want %q", got, want)
	}
}
