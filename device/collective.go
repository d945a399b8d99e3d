package device

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
)

// StreamComm is a communicator that runs its collectives on a stream of
// the device (nccl's): work it is given is ordered after what that stream
// waits for, not after the caller's compute.
type StreamComm interface {
	// CommStream is the stream the collectives run on.
	CommStream() Stream
}

// EventWork is a collective's handle whose completion is an event on the
// communicator's stream, so that compute can wait for it on the device
// instead of the host waiting.
type EventWork interface {
	// Event completes when the collective has.
	Event() Event
}

// BeforeCollective orders a collective of c after the work queued on d's
// compute stream so far, since the collective reads and writes buffers
// that work produces. A communicator with a stream (StreamComm) has its
// stream wait for an event recorded on compute, without blocking the
// host; one without (local, mpi: the collective runs on the calling
// goroutine, on the buffers' host memory) needs compute synchronised,
// which this does. A nil device is an error wrapping ErrInvalid.
func BeforeCollective(c comm.Communicator, d Device) error {
	if d == nil {
		return fmt.Errorf("device: BeforeCollective: %w: nil device", ErrInvalid)
	}
	compute := d.Compute()
	sc, ok := c.(StreamComm)
	if !ok {
		if err := compute.Synchronize(); err != nil {
			return fmt.Errorf("device: BeforeCollective: synchronising compute: %w", err)
		}
		return nil
	}
	ev, err := d.NewEvent(false)
	if err != nil {
		return fmt.Errorf("device: BeforeCollective: %w", err)
	}
	// The stream's wait captures the record, so the event can go at once.
	err = ev.Record(compute)
	if err == nil {
		err = sc.CommStream().WaitEvent(ev)
	}
	if cerr := ev.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("device: BeforeCollective: ordering the communicator's stream after compute: %w", err)
	}
	return nil
}

// AfterCollective orders the work queued on d's compute stream from now
// on after the collective of w, which wrote buffers that work reads. When
// w's completion is an event (EventWork), compute waits for it on the
// device and the host does not block; otherwise the host waits for w. A
// nil w (a blocking Do, complete on return) needs nothing. A nil device
// is an error wrapping ErrInvalid.
func AfterCollective(ctx context.Context, w comm.Work, d Device) error {
	if d == nil {
		return fmt.Errorf("device: AfterCollective: %w: nil device", ErrInvalid)
	}
	compute := d.Compute()
	if w == nil {
		return nil
	}
	if ew, ok := w.(EventWork); ok {
		if err := compute.WaitEvent(ew.Event()); err != nil {
			return fmt.Errorf("device: AfterCollective: compute waiting for the collective: %w", err)
		}
		return nil
	}
	return w.Wait(ctx)
}
