package emu_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
)

// countingDev counts the events made on an emulated device.
type countingDev struct {
	*emu.Device
	made *atomic.Int64
}

func (d countingDev) NewEvent(timing bool) (device.Event, error) {
	d.made.Add(1)
	return d.Device.NewEvent(timing)
}

// streamComm is a communicator with a stream of the device, as nccl's.
type streamComm struct {
	comm.Communicator
	s device.Stream
}

func (c streamComm) CommStream() device.Stream { return c.s }

// eventWork is a collective whose completion is an event recorded on the
// communicator's stream, failing with err (nil: it succeeded).
type eventWork struct {
	ev   device.Event
	done chan struct{}
	err  error
}

func (w *eventWork) Event() device.Event            { return w.ev }
func (w *eventWork) Done() <-chan struct{}          { return w.done }
func (w *eventWork) Wait(ctx context.Context) error { <-w.done; return w.err }
func newWork(t *testing.T, d device.Device, s device.Stream, err error) *eventWork {
	t.Helper()
	ev, e := d.NewEvent(false)
	if e != nil {
		t.Fatal(e)
	}
	if e := ev.Record(s); e != nil {
		t.Fatal(e)
	}
	w := &eventWork{ev: ev, done: make(chan struct{}), err: err}
	close(w.done)
	return w
}

// TestCollectiveEventsPooled: ordering many collectives after compute
// makes one event, not one per call.
func TestCollectiveEventsPooled(t *testing.T) {
	for _, sync := range []bool{false, true} {
		var opts []emu.Option
		if sync {
			opts = append(opts, emu.WithSynchronous())
		}
		base := newDevice(t, opts...)
		d := countingDev{Device: base, made: new(atomic.Int64)}
		sc := streamComm{s: newStream(t, base)}
		for range 50 {
			if err := device.BeforeCollective(sc, d); err != nil {
				t.Fatal(err)
			}
		}
		if n := d.made.Load(); n != 1 {
			t.Errorf("synchronous=%v: 50 collectives made %d events, want 1", sync, n)
		}
		if n := base.Collectives().EventsMade(); n != 1 {
			t.Errorf("synchronous=%v: the pool counts %d events, want 1", sync, n)
		}
	}
}

// TestCollectiveErrorSurfaces: a collective that compute waits for on
// the device (AfterCollective does not block) and that fails has its
// error, naming the rank, op and sequence number, returned by the
// device's Synchronize, or by the next collective's BeforeCollective once
// it has completed; each error once.
func TestCollectiveErrorSurfaces(t *testing.T) {
	failure := &comm.Error{Backend: "nccl", Rank: 1, Op: comm.OpAllReduce, Seq: 7, Peer: -1, Err: errors.New("unhandled cuda error")}
	ctx := context.Background()
	for _, c := range []struct {
		name string
		next func(d device.Device, sc streamComm) error
	}{
		{"Synchronize", func(d device.Device, _ streamComm) error { return d.Synchronize() }},
		{"BeforeCollective", func(d device.Device, sc streamComm) error { return device.BeforeCollective(sc, d) }},
		{"AfterCollective", func(d device.Device, _ streamComm) error { return device.AfterCollective(ctx, nil, d) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDevice(t)
			sc := streamComm{s: newStream(t, d)}
			if err := device.BeforeCollective(sc, d); err != nil {
				t.Fatal(err)
			}
			if err := device.AfterCollective(ctx, newWork(t, d, sc.s, nil), d); err != nil {
				t.Fatal(err)
			}
			if err := device.AfterCollective(ctx, newWork(t, d, sc.s, failure), d); err != nil {
				t.Fatalf("AfterCollective blocked on the work: %v", err)
			}
			err := c.next(d, sc)
			var ce *comm.Error
			if !errors.As(err, &ce) || ce.Rank != 1 || ce.Seq != 7 || ce.Op != comm.OpAllReduce {
				t.Fatalf("got %v, want the collective's *comm.Error", err)
			}
			if !strings.Contains(err.Error(), "rank 1") || !strings.Contains(err.Error(), "#7") {
				t.Errorf("error %q names neither rank nor sequence number", err)
			}
			if err := d.Synchronize(); err != nil {
				t.Fatalf("the error came twice: %v", err)
			}
		})
	}
}
