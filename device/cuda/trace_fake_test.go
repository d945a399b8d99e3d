//go:build linux && (amd64 || arm64)

package cuda

import (
	"context"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/trace"
)

// fakeStreamComm is a device.StreamComm on a stream of the fake device:
// each Start first queues three memsets on the stream, standing in for a
// collective's kernel.
type fakeStreamComm struct {
	comm.Communicator
	s   *Stream
	buf Buffer
}

func (c *fakeStreamComm) CommStream() device.Stream { return c.s }

func (c *fakeStreamComm) Start(ctx context.Context, call comm.Call) (comm.Work, error) {
	for range 3 {
		if err := c.s.Memset32(c.buf, 0, 1); err != nil {
			return nil, err
		}
	}
	return c.Communicator.Start(ctx, call)
}

// TestFakeStreamTracks traces a step on the whole-device fake through
// trace.Streams, with CUDA events (cuEventRecord, cuEventElapsedTime; the
// fake's clock advances 0.25 ms per operation run): an op of one kernel
// (Fill) and one of two (two Scales) on the compute stream, and a
// collective whose communicator queues three memsets on its own stream.
// The stream tracks have the two ops, one and two operations long, the
// second after the first, the op that queued nothing left out, and the
// collective at least three operations long.
func TestFakeStreamTracks(t *testing.T) {
	f := buildDeviceFake(t)
	l, d := f.open(t, f.path, f.blas())
	defer func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	}()
	const tick = 250 * time.Microsecond
	err := local.Run(context.Background(), 1, func(ctx context.Context, world comm.Communicator) error {
		b, err := d.Alloc(comm.Float32, 64)
		if err != nil {
			return err
		}
		defer b.Free()
		cs, err := d.NewStream()
		if err != nil {
			return err
		}
		tl := trace.NewTimeline()
		tc := trace.Comm(&fakeStreamComm{Communicator: world, s: cs.(*Stream), buf: b.(*DeviceBuffer).raw()}, tl, 0)
		s := tl.Streams(0, d)
		defer func() {
			if err := s.Close(); err != nil {
				t.Error(err)
			}
		}()
		if err := s.Begin(); err != nil {
			return err
		}
		k := d.Kernels()
		t0 := time.Now()
		if err := k.Fill(b, 1); err != nil {
			return err
		}
		s.Op("Fill", "forward", t0)
		t1 := time.Now()
		for range 2 {
			if err := k.Scale(b, b, 2); err != nil {
				return err
			}
		}
		s.Op("Scale", "forward", t1)
		s.Op("View", "forward", time.Now()) // queues nothing: no span
		h := comm.Host([]float32{1})
		w, err := tc.Start(ctx, comm.Call{Op: comm.OpAllReduce, Send: h, Recv: h, Reduce: comm.Sum})
		if err != nil {
			return err
		}
		if err := w.Wait(ctx); err != nil {
			return err
		}
		if err := s.End(); err != nil {
			return err
		}
		got := map[string]trace.Event{}
		n := 0
		for _, e := range tl.Events() {
			if e.Lane.IsStream() {
				got[e.Name] = e
				n++
			}
		}
		fill, scale, ar := got["Fill"], got["Scale"], got["allreduce"]
		if n != 3 || fill.Lane != trace.LaneStreamCompute || scale.Lane != trace.LaneStreamCompute || ar.Lane != trace.LaneStreamComm {
			t.Fatalf("stream events %v, want Fill and Scale on the compute stream and allreduce on the comm stream", got)
		}
		// The ends are device times; a start is the previous end, or the
		// op's host start where that falls inside the span (the fake's
		// clock is not the host's).
		if fill.Duration() <= 0 || fill.Duration() > tick || scale.End-fill.End != 2*tick ||
			scale.Start < fill.End || scale.Start >= scale.End {
			t.Errorf("Fill %v–%v, Scale %v–%v: want one operation, then two after it", fill.Start, fill.End, scale.Start, scale.End)
		}
		if ar.Duration() < 3*tick {
			t.Errorf("allreduce ran %v on its stream, want at least %v", ar.Duration(), 3*tick)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
