package trace_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/trace"
)

// streamComm is a device.StreamComm for the tests: each Start first queues
// busy (a sleep) on its stream, as NCCL queues a collective's kernel, and
// its work is a device.EventWork whose event follows that work.
type streamComm struct {
	comm.Communicator
	s    *emu.Stream
	d    device.Device
	busy time.Duration
}

func (c *streamComm) CommStream() device.Stream { return c.s }

func (c *streamComm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	if err := c.s.Launch(func() error { time.Sleep(c.busy); return nil }); err != nil {
		return nil, err
	}
	w, err := c.Communicator.Start(ctx, call)
	if err != nil {
		return nil, err
	}
	ev, err := c.d.NewEvent(false)
	if err != nil {
		return nil, err
	}
	if err := ev.Record(c.s); err != nil {
		return nil, err
	}
	return eventWork{w, ev}, nil
}

type eventWork struct {
	comm.Work
	ev device.Event
}

func (w eventWork) Event() device.Event { return w.ev }

// TestStreamsEmulated traces a step on the emulated device, whose events
// carry the host time at which its streams reach them: two ops that each
// queue a sleep on the compute stream (20 and 10 ms) and, between them,
// a collective whose communicator queues 30 ms on its own stream. The
// host calls return at once; the stream lanes show the device's times:
// the two ops back to back, each at least its sleep, the collective at
// least 30 ms and overlapping them, which Overlap (of the timeline and of
// package train) counts as hidden. The traced communicator is still a
// device.StreamComm and its work a device.EventWork, and the Chrome trace
// has the two stream tracks.
func TestStreamsEmulated(t *testing.T) {
	const a, b, c = 20 * time.Millisecond, 10 * time.Millisecond, 30 * time.Millisecond
	err := local.Run(context.Background(), 1, func(ctx context.Context, world comm.Communicator) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		cs, err := d.NewStream()
		if err != nil {
			return err
		}
		tl := trace.NewTimeline()
		tc := trace.Comm(&streamComm{Communicator: world, s: cs.(*emu.Stream), d: d, busy: c}, tl, 0)
		if sc, ok := tc.(device.StreamComm); !ok || sc.CommStream() != cs {
			t.Errorf("the traced communicator is %T, not a device.StreamComm of its stream", tc)
		}
		s := tl.Streams(0, d)
		defer func() {
			if err := s.Close(); err != nil {
				t.Error(err)
			}
		}()
		if err := s.Begin(); err != nil {
			return err
		}
		compute := d.Compute().(*emu.Stream)
		op := func(name string, sleep time.Duration) error {
			t0 := time.Now()
			if err := compute.Launch(func() error { time.Sleep(sleep); return nil }); err != nil {
				return err
			}
			s.Op(name, "forward", t0)
			return nil
		}
		if err := op("A", a); err != nil {
			return err
		}
		buf := comm.Host([]float32{1, 2})
		w, err := tc.Start(ctx, comm.Call{Op: comm.OpAllReduce, Send: buf, Recv: buf, Reduce: comm.Sum})
		if err != nil {
			return err
		}
		if _, ok := w.(device.EventWork); !ok {
			t.Errorf("the traced work is %T, not a device.EventWork", w)
		}
		if err := op("B", b); err != nil {
			return err
		}
		if err := w.Wait(ctx); err != nil {
			return err
		}
		if err := s.End(); err != nil {
			return err
		}
		var spans []trace.Event
		for _, e := range tl.Events() {
			if e.Lane.IsStream() {
				spans = append(spans, e)
			}
		}
		got := map[string]trace.Event{}
		for _, e := range spans {
			got[e.Name] = e
		}
		if len(spans) != 3 || got["A"].Lane != trace.LaneStreamCompute || got["B"].Lane != trace.LaneStreamCompute ||
			got["allreduce"].Lane != trace.LaneStreamComm {
			t.Fatalf("stream events %+v, want A and B on the compute stream and allreduce on the comm stream", spans)
		}
		for _, w := range []struct {
			name string
			min  time.Duration
		}{{"A", a}, {"B", b}, {"allreduce", c}} {
			if d := got[w.name].Duration(); d < w.min || d > w.min+time.Second {
				t.Errorf("%s ran %v on its stream, want at least %v", w.name, d, w.min)
			}
		}
		if got["B"].Start < got["A"].End {
			t.Errorf("B starts at %v, before A ends at %v", got["B"].Start, got["A"].End)
		}
		if got["A"].Cat != "forward" {
			t.Errorf("A's category is %q, want the tape phase", got["A"].Cat)
		}
		ov := tl.Overlap(0, trace.Window{}, nil)
		if ov.Comm != got["allreduce"].Duration() || ov.Hidden < a/2 {
			t.Errorf("Overlap %+v: want the stream collective's %v, mostly hidden behind A and B", ov, got["allreduce"].Duration())
		}
		var out bytes.Buffer
		if err := tl.WriteChrome(&out); err != nil {
			return err
		}
		for _, track := range []string{`"name":"stream compute"`, `"name":"stream comm"`} {
			if !strings.Contains(out.String(), track) {
				t.Errorf("the Chrome trace has no %s track", track)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestStreamsNil: a nil Timeline, a nil device and the host device give
// a nil recorder, whose methods do nothing.
func TestStreamsNil(t *testing.T) {
	var tl *trace.Timeline
	for _, s := range []*trace.Streams{tl.Streams(0, device.Host()), trace.NewTimeline().Streams(0, nil), trace.NewTimeline().Streams(0, device.Host())} {
		if s != nil {
			t.Fatalf("Streams = %v, want nil", s)
		}
		s.Op("x", "forward", time.Now())
		if err := s.Begin(); err != nil {
			t.Error(err)
		}
		if err := s.End(); err != nil {
			t.Error(err)
		}
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	}
}
