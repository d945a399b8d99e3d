//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
)

// ctxDevice is the part of a device.Device that BeforeCollective and
// AfterCollective use (compute stream, events), over a device/cuda
// context, until device/cuda implements device.Device itself.
type ctxDevice struct {
	device.Device // nil: only the methods below are called
	ctx           *cuda.Context
	compute       *cuda.Stream
}

func (d ctxDevice) Compute() device.Stream { return d.compute }

func (d ctxDevice) NewEvent(timing bool) (device.Event, error) { return d.ctx.NewEvent(timing) }

// handleOf is the CUevent or CUstream behind a device/cuda event or stream.
func handleOf(x interface{ Handle() uintptr }) string { return ptr(x.Handle()) }

// TestDeviceBuffersUnstaged runs an all-reduce of device buffers on two
// ranks the way device code does: BeforeCollective makes the
// communicator's stream wait for an event recorded on compute, the call
// takes the buffers' device addresses with nothing staged, and
// AfterCollective makes compute wait for the work's event. Then: a
// completed work's Event is one never recorded; a point-to-point work's
// Event gives it to NCCL first.
func TestDeviceBuffersUnstaged(t *testing.T) {
	f := useFake(t)
	l := f.load(t)
	const p = 2
	w := newWorld(t, l, p)
	defer w.close()
	ctx := context.Background()
	type rankLog struct {
		wait, waitEvent string // a completed work's Event; the work's event
		comm, compute   string // stream handles
		buf             uintptr
	}
	logs := make([]rankLog, p)
	err := w.run(func(r int, c *Comm) error {
		d := w.devs[r]
		compute, err := d.NewStream()
		if err != nil {
			return err
		}
		defer compute.Close()
		dev := ctxDevice{ctx: d, compute: compute}
		x, err := upload(d, comm.Host([]float32{1, 2, 3, 4, float32(r)}))
		if err != nil {
			return err
		}
		defer x.Free()
		if _, ok := any(c).(device.StreamComm); !ok || c.CommStream() != device.Stream(c.Stream()) {
			return errors.New("the communicator's stream is not its device.StreamComm stream")
		}
		if err := device.BeforeCollective(c, dev); err != nil {
			return err
		}
		wk, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum)
		if err != nil {
			return err
		}
		ew, ok := wk.(device.EventWork)
		if !ok {
			return fmt.Errorf("work %T is no device.EventWork", wk)
		}
		ev, ok := ew.Event().(*cuda.Event)
		if !ok {
			return fmt.Errorf("event %T is no *cuda.Event", ew.Event())
		}
		if err := device.AfterCollective(ctx, wk, dev); err != nil {
			return err
		}
		logs[r] = rankLog{waitEvent: handleOf(ev), comm: handleOf(c.Stream()), compute: handleOf(compute), buf: x.Ptr()}
		// The fake's cuStreamWaitEvent orders nothing: wait on the host
		// for the data.
		if err := wk.Wait(ctx); err != nil {
			return err
		}
		got, err := x.download()
		if err != nil {
			return err
		}
		if want := []float32{2, 4, 6, 8, 1}; !slices.Equal(got.Float32s(), want) {
			return fmt.Errorf("rank %d: all-reduce gave %v, want %v", r, got.Float32s(), want)
		}
		done, ok := ew.Event().(*cuda.Event)
		if !ok || done == ev {
			return fmt.Errorf("rank %d: a completed work's Event is its pooled event %v", r, done)
		}
		if ok, err := done.Query(); !ok || err != nil {
			return fmt.Errorf("rank %d: a completed work's Event is not complete: %v", r, err)
		}
		logs[r].wait = handleOf(done)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for r, rl := range logs {
		// BeforeCollective: an event recorded on compute, waited for by the
		// communicator's stream.
		rec := f.lines("cuEventRecord", "stream="+rl.compute)
		if len(rec) != 1 {
			t.Fatalf("rank %d: records on compute: %q", r, rec)
		}
		ev := strings.Fields(strings.TrimPrefix(rec[0], "cuEventRecord event="))[0]
		if len(f.lines("cuStreamWaitEvent stream="+rl.comm+" event="+ev)) != 1 {
			t.Errorf("rank %d: the communicator's stream does not wait for compute's event %s:\n%s", r, ev, f.log())
		}
		// The call has the buffer's address on both sides: nothing staged.
		if want := fmt.Sprintf("ncclAllReduce send=%s recv=%s count=5", ptr(rl.buf), ptr(rl.buf)); len(f.lines(want)) != 1 {
			t.Errorf("rank %d: no %q in\n%s", r, want, f.log())
		}
		// AfterCollective: compute waits for the work's event, recorded on
		// the communicator's stream.
		if len(f.lines("cuEventRecord event="+rl.waitEvent+" stream="+rl.comm)) != 1 ||
			len(f.lines("cuStreamWaitEvent stream="+rl.compute+" event="+rl.waitEvent)) != 1 {
			t.Errorf("rank %d: compute does not wait for the work's event %s:\n%s", r, rl.waitEvent, f.log())
		}
		if got := f.lines("cuEventRecord event=" + rl.wait); len(got) != 0 {
			t.Errorf("rank %d: the completed work's event was recorded: %q", r, got)
		}
	}
	if got := f.lines("cuMemAlloc_v2 bytes=20"); len(got) != p {
		t.Errorf("device allocations %q: want only the two uploads, nothing staged", got)
	}

	// Point to point: Event flushes the batch, so the event it returns
	// follows the group.
	f.logClear()
	err = w.run(func(r int, c *Comm) error {
		b, err := allocDev(w.devs[r], comm.Int32, 3)
		if err != nil {
			return err
		}
		defer b.Free()
		var wk comm.Work
		if r == 0 {
			wk, err = comm.SendAsync(ctx, c, b, 1, 7)
		} else {
			wk, err = comm.RecvAsync(ctx, c, b, 0, 7)
		}
		if err != nil {
			return err
		}
		ev, ok := wk.(device.EventWork).Event().(*cuda.Event)
		if !ok {
			return errors.New("no CUDA event")
		}
		if got := f.lines("cuEventRecord event=" + handleOf(ev)); len(got) != 1 {
			return fmt.Errorf("rank %d: the point-to-point work's event is not recorded after Event: %q", r, got)
		}
		return wk.Wait(ctx)
	})
	if err != nil {
		t.Fatal(err)
	}
	f.clean(t)
}
