package device

import (
	"context"
	"errors"
	"fmt"
	"sync"

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

// CollectiveDevice is a Device that keeps the state of [BeforeCollective]
// and [AfterCollective] ([Collectives]): their events come from its pool
// instead of one made and closed per call, and the works whose events
// compute waits for stay in it until their errors are taken. Its
// Synchronize returns Collectives().Wait's errors after its streams',
// and its Close calls Collectives().Close. The emulated device is one;
// a Device that is not gets a blocking Wait in AfterCollective, so that
// no collective's error is lost.
type CollectiveDevice interface {
	Device
	// Collectives is the device's state for the collective glue; the
	// same value at every call.
	Collectives() *Collectives
}

// Collectives is what a [CollectiveDevice] keeps for [BeforeCollective]
// and [AfterCollective]: a pool of events (one event serves every
// collective in turn, since a stream's WaitEvent captures the record it
// waits for) and the works that compute waits for on the device, whose
// errors nobody has taken yet. The zero value is ready; it is safe for
// concurrent use.
//
// A collective's error (a *comm.Error naming the rank, op and sequence
// number) is returned once: by the first BeforeCollective or
// AfterCollective on the device after the work has completed, or by the
// device's Synchronize (Wait), which waits for it. Every rank
// synchronises its device before it reads a result on the host
// (CopyToHost), so each rank whose collective failed reports it there
// at the latest.
type Collectives struct {
	mu     sync.Mutex
	events []Event
	made   int
	works  []comm.Work
}

// event returns a pooled event, making one on d when the pool is empty.
func (c *Collectives) event(d Device) (Event, error) {
	c.mu.Lock()
	if n := len(c.events); n > 0 {
		ev := c.events[n-1]
		c.events = c.events[:n-1]
		c.mu.Unlock()
		return ev, nil
	}
	c.mu.Unlock()
	ev, err := d.NewEvent(false)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.made++
	c.mu.Unlock()
	return ev, nil
}

// put returns ev to the pool.
func (c *Collectives) put(ev Event) {
	c.mu.Lock()
	c.events = append(c.events, ev)
	c.mu.Unlock()
}

// EventsMade is the number of events the pool has made: as many as
// collectives were ordered at once, not one per call.
func (c *Collectives) EventsMade() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.made
}

// keep adds w to the works whose errors are still to be taken.
func (c *Collectives) keep(w comm.Work) {
	c.mu.Lock()
	c.works = append(c.works, w)
	c.mu.Unlock()
}

// take removes and returns the kept works, all of them or only those
// whose Done is closed.
func (c *Collectives) take(all bool) []comm.Work {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []comm.Work
	kept := c.works[:0]
	for _, w := range c.works {
		if all || isDone(w) {
			out = append(out, w)
		} else {
			kept = append(kept, w)
		}
	}
	clear(c.works[len(kept):])
	c.works = kept
	return out
}

// isDone reports whether w has completed or failed, without blocking.
func isDone(w comm.Work) bool {
	select {
	case <-w.Done():
		return true
	default:
		return false
	}
}

// Check returns the errors of the kept works that have completed, each
// once, without blocking; the works still running stay kept.
func (c *Collectives) Check(ctx context.Context) error {
	return waitAll(ctx, c.take(false))
}

// Wait waits for every kept work and returns their errors (each once).
// The device calls it from Synchronize, after its streams, when compute
// has waited for the works' events, so it returns at once unless a
// collective failed or hangs (then the communicator's timeout ends it).
func (c *Collectives) Wait(ctx context.Context) error {
	return waitAll(ctx, c.take(true))
}

func waitAll(ctx context.Context, ws []comm.Work) error {
	var errs []error
	for _, w := range ws {
		if err := w.Wait(ctx); err != nil {
			errs = append(errs, fmt.Errorf("device: a collective compute waited for: %w", err))
		}
	}
	return errors.Join(errs...)
}

// Close closes the pooled events; the device calls it from Close.
func (c *Collectives) Close() error {
	c.mu.Lock()
	evs := c.events
	c.events = nil
	c.mu.Unlock()
	var errs []error
	for _, ev := range evs {
		errs = append(errs, ev.Close())
	}
	return errors.Join(errs...)
}

// BeforeCollective orders a collective of c after the work queued on d's
// compute stream so far, since the collective reads and writes buffers
// that work produces. A communicator with a stream (StreamComm) has its
// stream wait for an event recorded on compute, without blocking the
// host (the event is pooled on a CollectiveDevice); one without (local,
// mpi: the collective runs on the calling goroutine, on the buffers' host
// memory) needs compute synchronised, which this does. On a
// CollectiveDevice it first returns the errors of earlier collectives
// that have completed (Collectives.Check). A nil device is an error
// wrapping ErrInvalid.
func BeforeCollective(c comm.Communicator, d Device) error {
	if d == nil {
		return fmt.Errorf("device: BeforeCollective: %w: nil device", ErrInvalid)
	}
	cd, pooled := d.(CollectiveDevice)
	if pooled {
		if err := cd.Collectives().Check(context.Background()); err != nil {
			return fmt.Errorf("device: BeforeCollective: %s: %w", d.Name(), err)
		}
	}
	compute := d.Compute()
	sc, ok := c.(StreamComm)
	if !ok {
		if err := compute.Synchronize(); err != nil {
			return fmt.Errorf("device: BeforeCollective: synchronising compute: %w", err)
		}
		return nil
	}
	var ev Event
	var err error
	if pooled {
		ev, err = cd.Collectives().event(d)
	} else {
		ev, err = d.NewEvent(false)
	}
	if err != nil {
		return fmt.Errorf("device: BeforeCollective: %w", err)
	}
	// The stream's wait captures the record, so the event is free again
	// at once.
	err = ev.Record(compute)
	if err == nil {
		err = sc.CommStream().WaitEvent(ev)
	}
	if pooled {
		cd.Collectives().put(ev)
	} else if cerr := ev.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("device: BeforeCollective: ordering the communicator's stream after compute: %w", err)
	}
	return nil
}

// AfterCollective orders the work queued on d's compute stream from now
// on after the collective of w, which wrote buffers that work reads. When
// w's completion is an event (EventWork) and d is a CollectiveDevice,
// compute waits for it on the device and the host does not block: w is
// kept, and its error is returned by a later BeforeCollective or
// AfterCollective once it has completed, or by d.Synchronize. Otherwise
// the host waits for w here (after compute's wait for an EventWork's
// event, which then orders nothing more but is harmless). A nil w (a blocking Do, complete on return)
// needs nothing, but the errors of earlier collectives that have
// completed are returned as by BeforeCollective. A nil device is an error
// wrapping ErrInvalid.
func AfterCollective(ctx context.Context, w comm.Work, d Device) error {
	if d == nil {
		return fmt.Errorf("device: AfterCollective: %w: nil device", ErrInvalid)
	}
	cd, pooled := d.(CollectiveDevice)
	if pooled {
		if err := cd.Collectives().Check(ctx); err != nil {
			return fmt.Errorf("device: AfterCollective: %s: %w", d.Name(), err)
		}
	}
	if w == nil {
		return nil
	}
	ew, ok := w.(EventWork)
	if !ok {
		return w.Wait(ctx)
	}
	if err := d.Compute().WaitEvent(ew.Event()); err != nil {
		return fmt.Errorf("device: AfterCollective: compute waiting for the collective: %w", err)
	}
	if !pooled {
		// Without a device to keep w, waiting here is the only way its
		// error reaches the caller.
		return w.Wait(ctx)
	}
	cd.Collectives().keep(w)
	return nil
}
