package device_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// TestHost checks the host device: its buffers are host memory that comm
// takes as it is, copies check dtype and length, and its events time host
// work.
func TestHost(t *testing.T) {
	h := device.Host()
	if h != device.Host() || h.Name() != "host" || h.Kind() != device.KindHost || h.Kind().String() != "host" {
		t.Fatalf("Host() = %v %q %v", h, h.Name(), h.Kind())
	}
	if h.Memory() != nil || h.Kernels() != nil {
		t.Fatal("the host has an allocator or kernels")
	}
	b, err := h.Alloc(comm.Float32, 4)
	if err != nil {
		t.Fatal(err)
	}
	if b.Owner() != h || b.Device() != "host" || b.Len() != 4 || b.DType() != comm.Float32 || b.Ptr() == 0 {
		t.Fatalf("buffer %v %q %d %v %#x", b.Owner(), b.Device(), b.Len(), b.DType(), b.Ptr())
	}
	view := b.(comm.HostBacked).HostView().Float32s()
	if err := h.CopyFromHost(b, comm.Host([]float32{1, 2, 3, 4})); err != nil {
		t.Fatal(err)
	}
	if view[3] != 4 {
		t.Fatalf("HostView after CopyFromHost: %v", view)
	}
	c, _ := h.Alloc(comm.Float32, 2)
	if err := h.Copy(c, b.Slice(1, 3).(device.Buffer)); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, 2)
	if err := h.CopyToHost(comm.Host(got), c); err != nil || got[0] != 2 || got[1] != 3 {
		t.Fatalf("Copy of a slice then CopyToHost: %v, %v", got, err)
	}
	for name, err := range map[string]error{
		"length": h.Copy(c, b),
		"dtype":  h.CopyFromHost(c, comm.Host([]float64{1, 2})),
		"nil":    h.CopyToHost(nil, c),
		"alloc":  func() error { _, err := h.Alloc(comm.Float32, -1); return err }(),
	} {
		if !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("%s: %v, want loom.ErrInvalid", name, err)
		}
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	s := h.Compute()
	start, _ := h.NewEvent(true)
	end, _ := h.NewEvent(true)
	if err := start.Record(s); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	if err := end.Record(s); err != nil {
		t.Fatal(err)
	}
	if el, err := end.Since(start); err != nil || el < 5*time.Millisecond {
		t.Fatalf("Since = %v, %v across a 5 ms sleep", el, err)
	}
	if done, err := s.Query(); !done || err != nil {
		t.Fatalf("host stream Query = %v, %v", done, err)
	}
}

// named is a device with a name only, for Same.
type named struct {
	device.Device
	name string
}

func (n *named) Name() string { return n.name }

// TestSame checks the mixed-device error: it names the op and both
// devices, matches ErrMixed, ErrInvalid and loom.ErrInvalid, and is nil
// for one device.
func TestSame(t *testing.T) {
	gpu, gpu2, twin := &named{name: "cuda:0"}, &named{name: "cuda:1"}, &named{name: "cuda:0"}
	for _, c := range []struct {
		name string
		a, b device.Device
		want string // "" for nil
	}{
		{"host twice", device.Host(), device.Host(), ""},
		{"nil is host", nil, device.Host(), ""},
		{"one device", gpu, gpu, ""},
		{"device and host", gpu, device.Host(), "autograd: Linear: data on different devices: inputs on cuda:0 and host"},
		{"two devices", gpu, gpu2, "autograd: Linear: data on different devices: inputs on cuda:0 and cuda:1"},
		{"two of one name", gpu, twin, "autograd: Linear: data on different devices: inputs on two devices named cuda:0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := device.Same("autograd: Linear", c.a, c.b)
			if c.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || err.Error() != c.want || !errors.Is(err, device.ErrMixed) || !errors.Is(err, device.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
				t.Fatalf("got %v, want %q", err, c.want)
			}
		})
	}
}

// trace records the calls the collective glue makes.
type trace struct{ calls []string }

type fakeDev struct {
	device.Device
	tr      *trace
	compute *fakeStream
	coll    device.Collectives
}

// plainDev is a device without Collectives.
type plainDev struct{ *fakeDev }

func (d plainDev) Collectives() {}

func (d *fakeDev) Collectives() *device.Collectives { return &d.coll }

func (d *fakeDev) NewEvent(bool) (device.Event, error) { return &fakeEv{tr: d.tr}, nil }
func (d *fakeDev) Compute() device.Stream              { return d.compute }

type fakeStream struct {
	name string
	dev  *fakeDev
}

func (s *fakeStream) WaitEvent(e device.Event) error {
	s.dev.tr.calls = append(s.dev.tr.calls, s.name+".WaitEvent("+e.(*fakeEv).on+")")
	return nil
}
func (s *fakeStream) Synchronize() error {
	s.dev.tr.calls = append(s.dev.tr.calls, s.name+".Synchronize")
	return nil
}
func (s *fakeStream) Query() (bool, error) { return true, nil }

type fakeEv struct {
	tr *trace
	on string
}

func (e *fakeEv) Record(s device.Stream) error {
	e.on = s.(*fakeStream).name
	e.tr.calls = append(e.tr.calls, "Record("+e.on+")")
	return nil
}
func (e *fakeEv) Synchronize() error                        { return nil }
func (e *fakeEv) Query() (bool, error)                      { return true, nil }
func (e *fakeEv) Since(device.Event) (time.Duration, error) { return 0, nil }
func (e *fakeEv) Close() error                              { e.tr.calls = append(e.tr.calls, "Close"); return nil }

// streamComm is a communicator with a stream, as nccl's.
type streamComm struct {
	comm.Communicator
	s device.Stream
}

func (c streamComm) CommStream() device.Stream { return c.s }

// hostComm is a communicator without one, as local's.
type hostComm struct{ comm.Communicator }

// eventWork completes as an event on the communicator's stream.
type eventWork struct {
	comm.Work
	ev device.Event
}

func (w eventWork) Event() device.Event { return w.ev }

// blockingWork is waited for on the host.
type blockingWork struct {
	comm.Work
	tr *trace
}

// Done never completes, so the glue's checks leave the work alone.
func (w blockingWork) Done() <-chan struct{} { return nil }

func (w blockingWork) Wait(context.Context) error {
	w.tr.calls = append(w.tr.calls, "Wait")
	return nil
}

// TestCollectiveGlue checks how BeforeCollective and AfterCollective order
// a collective against compute: with a communicator's stream on the
// device, by events; without one, by synchronising (before) and waiting
// for the work (after).
func TestCollectiveGlue(t *testing.T) {
	tr := &trace{}
	d := &fakeDev{tr: tr}
	compute, cs := &fakeStream{name: "compute", dev: d}, &fakeStream{name: "comm", dev: d}
	d.compute = compute
	ctx := context.Background()
	for _, c := range []struct {
		name string
		run  func() error
		want string
	}{
		{"before, stream comm", func() error { return device.BeforeCollective(streamComm{s: cs}, d) }, "Record(compute) comm.WaitEvent(compute)"},
		{"before, stream comm, pooled event", func() error { return device.BeforeCollective(streamComm{s: cs}, d) }, "Record(compute) comm.WaitEvent(compute)"},
		{"before, stream comm, no pool", func() error { return device.BeforeCollective(streamComm{s: cs}, plainDev{d}) }, "Record(compute) comm.WaitEvent(compute) Close"},
		{"before, host comm", func() error { return device.BeforeCollective(hostComm{}, d) }, "compute.Synchronize"},
		{"after, event work", func() error {
			return device.AfterCollective(ctx, eventWork{Work: blockingWork{tr: tr}, ev: &fakeEv{tr: tr, on: "comm"}}, d)
		}, "compute.WaitEvent(comm)"},
		{"after, event work, device without Collectives", func() error {
			return device.AfterCollective(ctx, eventWork{Work: blockingWork{tr: tr}, ev: &fakeEv{tr: tr, on: "comm"}}, plainDev{d})
		}, "compute.WaitEvent(comm) Wait"},
		{"after, blocking work", func() error { return device.AfterCollective(ctx, blockingWork{tr: tr}, d) }, "Wait"},
		{"after, Do", func() error { return device.AfterCollective(ctx, nil, d) }, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			tr.calls = nil
			if err := c.run(); err != nil {
				t.Fatal(err)
			}
			if got := strings.Join(tr.calls, " "); got != c.want {
				t.Fatalf("calls %q, want %q", got, c.want)
			}
		})
	}
	if n := d.coll.EventsMade(); n != 1 {
		t.Errorf("the pool made %d events, want 1", n)
	}
	if err := device.BeforeCollective(hostComm{}, nil); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("nil device: %v", err)
	}
	if err := device.AfterCollective(ctx, nil, nil); !errors.Is(err, device.ErrInvalid) {
		t.Fatalf("nil device: %v", err)
	}
}
