//go:build linux && (amd64 || arm64)

package nccl

import (
	"context"
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// The order of an abort: pending work and calls that the abort fails
// report it only once ncclCommAbort has returned, and nothing that waits
// for another goroutine's abort outlives its context. The fake's abort
// delay stands for a real abort that takes a while to stop the kernels.

// rank0 returns the fake and rank 0 of a new two-rank world, which is
// closed when the test ends; rank 1 issues nothing.
func rank0(t *testing.T) (*fake, *Comm) {
	t.Helper()
	f := useFake(t)
	w := newWorld(t, f.load(t), 2)
	t.Cleanup(func() { _ = w.close() })
	return f, w.comms[0]
}

// TestWaitBoundedDuringAbort: a wait whose context ends while another
// goroutine's abort is still inside ncclCommAbort returns then, with the
// abort's cause (which wins over the context's), and does not flush
// pending sends meanwhile; the work fails, with that cause, once the
// abort is done.
func TestWaitBoundedDuringAbort(t *testing.T) {
	cases := []struct {
		name  string
		start func(c *Comm) (comm.Work, error)
		abort func(f *fake, c *Comm) // starts another goroutine's abort
		op    string
	}{
		{
			name: "async error found by the driver",
			start: func(c *Comm) (comm.Work, error) {
				return comm.BroadcastAsync(context.Background(), c, comm.Host([]int64{5}), 0)
			},
			abort: func(f *fake, c *Comm) { f.setAsync(0, int32(SystemError)) },
			op:    "broadcast #1",
		},
		{
			name: "send not yet flushed, Abort",
			start: func(c *Comm) (comm.Work, error) {
				return comm.SendAsync(context.Background(), c, comm.Host([]float32{1}), 1, 0)
			},
			abort: func(f *fake, c *Comm) { go c.Abort(errors.New("elsewhere")) },
			op:    "send #1",
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f, c0 := rank0(t)
			wk, err := tc.start(c0)
			if err != nil {
				t.Fatal(err)
			}
			const abortTime = 400 * time.Millisecond
			f.abortDelay(int32(abortTime.Microseconds()))
			defer f.setAsync(-1, 0)
			tc.abort(f, c0)
			for c0.Err() == nil { // the failure is recorded before the abort starts
				time.Sleep(time.Millisecond)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
			defer cancel()
			start := time.Now()
			err = wk.Wait(ctx)
			if took := time.Since(start); took > abortTime/2 {
				t.Errorf("Wait returned after %v: it waited for the abort, not its context", took)
			}
			if !errors.Is(err, comm.ErrAborted) || errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), tc.op) {
				t.Errorf("err = %v, want the abort, not the context's deadline, naming %s", err, tc.op)
			}
			select {
			case <-wk.Done():
				t.Error("the work failed before ncclCommAbort returned")
			default:
			}
			<-wk.Done()
			if got := wk.Wait(context.Background()); got == nil || got.Error() != err.Error() {
				t.Errorf("after the abort the work failed with %v, want what Wait returned: %v", got, err)
			}
			aborted(t, f, c0)
		})
	}
}

// TestCallFailsAfterAbort: a collective that another goroutine's abort
// fails while NCCL is still settling it returns only after ncclCommAbort.
func TestCallFailsAfterAbort(t *testing.T) {
	f, c0 := rank0(t)
	f.setSettle(1 << 30) // the collective stays in progress
	defer f.setSettle(2)
	f.abortDelay(int32((200 * time.Millisecond).Microseconds()))
	go func() {
		time.Sleep(50 * time.Millisecond)
		c0.Abort(errors.New("elsewhere"))
	}()
	buf := comm.Host([]float32{1})
	err := comm.AllReduce(context.Background(), c0, buf, buf, comm.Sum)
	if n := len(f.lines("ncclCommAbort comm=" + ptr(c0.h))); n != 1 {
		t.Errorf("AllReduce returned with ncclCommAbort called %d times, want 1", n)
	}
	if !errors.Is(err, comm.ErrAborted) || !strings.Contains(err.Error(), "elsewhere") {
		t.Errorf("err = %v, want the abort", err)
	}
}

// TestFlushFailureFailsWholeBatch: when the event after a flushed group
// cannot be recorded, every work of the group fails, not only the first.
func TestFlushFailureFailsWholeBatch(t *testing.T) {
	f, c0 := rank0(t)
	ctx := context.Background()
	var works []comm.Work
	for tag := range 3 {
		wk, err := comm.SendAsync(ctx, c0, comm.Host([]float32{1}), 1, tag)
		if err != nil {
			t.Fatal(err)
		}
		works = append(works, wk)
	}
	f.fail("cuEventRecord", 400, 1)
	if err := c0.Flush(ctx); !errors.Is(err, comm.ErrAborted) {
		t.Errorf("Flush: %v, want an abort", err)
	}
	for i, wk := range works {
		select {
		case <-wk.Done():
			if err := wk.Wait(ctx); err == nil || !strings.Contains(err.Error(), "cuEventRecord") {
				t.Errorf("send %d: %v, want the failed cuEventRecord", i, err)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("send %d never completed after the abort", i)
		}
	}
	aborted(t, f, c0)
}

// TestCollectiveAfterFailedFlush: a collective whose implicit flush of
// batched sends fails, aborting the communicator, fails without calling
// NCCL on the freed communicator.
func TestCollectiveAfterFailedFlush(t *testing.T) {
	f, c0 := rank0(t)
	ctx := context.Background()
	if _, err := comm.SendAsync(ctx, c0, comm.Host([]float32{1}), 1, 0); err != nil {
		t.Fatal(err)
	}
	f.fail("ncclGroupEnd", int32(SystemError), 1)
	err := comm.AllReduce(ctx, c0, comm.Host([]float32{1}), comm.Host([]float32{0}), comm.Sum)
	if !errors.Is(err, SystemError) || !strings.Contains(err.Error(), "allreduce #1") {
		t.Errorf("err = %v, want the failed group, naming allreduce #1", err)
	}
	f.clean(t)
}

// TestDriverIdleWhileAborting: async work that expires while another
// goroutine's abort runs is left to that abort; the background driver
// does not spin on it meanwhile.
func TestDriverIdleWhileAborting(t *testing.T) {
	f, c0 := rank0(t)
	ctx, cancel := context.WithCancel(context.Background())
	wk, err := comm.BroadcastAsync(ctx, c0, comm.Host([]int64{5}), 0) // rank 1 never joins
	if err != nil {
		t.Fatal(err)
	}
	f.abortDelay(int32((500 * time.Millisecond).Microseconds()))
	// With mu held the driver's next pass sees both the ended context and
	// the recorded failure.
	c0.mu.Lock()
	cancel()
	go c0.Abort(errors.New("elsewhere"))
	for c0.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	c0.mu.Unlock()
	cpu0, wall0 := cpuTime(t), time.Now()
	time.Sleep(300 * time.Millisecond)
	if cpu, wall := cpuTime(t)-cpu0, time.Since(wall0); cpu > wall/2 {
		t.Errorf("%v of CPU in %v while the abort ran: the driver spun", cpu, wall)
	}
	<-wk.Done()
	if err := wk.Wait(context.Background()); !strings.Contains(err.Error(), "broadcast #1") {
		t.Errorf("err = %v, want one naming broadcast #1", err)
	}
}

// cpuTime is the CPU time this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
