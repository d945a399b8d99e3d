//go:build mpi

package mpi_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/mpi"
)

// A blocking call that cannot finish is taken in hand by its watchdog: on
// rank 1's timeout, its cancelled context or an Abort from another
// goroutine, rank 1 aborts the communicator and tells its peers, and every
// rank blocked in the call hands the job-ending hook (MPI_Abort in real
// use) an error naming its rank, the op and the sequence number. Here rank
// 0 joins the collective late instead of never, so that the calls return
// and the test can check what they returned.
func TestBlockingWatchdog(t *testing.T) {
	needRanks(t, 2)
	boom := errors.New("boom")
	cases := []struct {
		name       string
		timeout    time.Duration // rank 1's communicator timeout
		ctxTimeout time.Duration // rank 1's context, if set
		abortAfter time.Duration // rank 1 calls Abort from another goroutine, if set
		want       error         // in rank 1's error
	}{
		{name: "timeout", timeout: 200 * time.Millisecond, want: comm.ErrTimeout},
		{name: "cancelled", timeout: 20 * time.Second, ctxTimeout: 200 * time.Millisecond, want: context.DeadlineExceeded},
		{name: "abort", timeout: 20 * time.Second, abortAfter: 200 * time.Millisecond, want: boom},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			defer sync(t)
			opts := comm.Options{Timeout: 20 * time.Second}
			if world.Rank() == 1 {
				opts.Timeout = tc.timeout
			}
			c, err := mpi.World(mpi.WithOptions(opts), mpi.WithBlockingCalls(true))
			if err != nil {
				t.Fatal(err)
			}
			ended := make(chan error, 1)
			mpi.SetEndJob(c, func(err error) { ended <- err })
			x := []float32{1}
			if c.Rank() == 0 {
				time.Sleep(1500 * time.Millisecond)
				if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
					t.Fatal(err)
				}
				for deadline := time.Now().Add(5 * time.Second); mpi.PollNotices(c) == nil && time.Now().Before(deadline); {
					time.Sleep(time.Millisecond)
				}
				err := comm.AllReduce(context.Background(), c, comm.Host(x), comm.Host(x), comm.Sum)
				var ae *comm.AbortError
				if !errors.As(err, &ae) || ae.Rank != 1 {
					t.Fatalf("rank 0 after the watchdogs fired: got %v, want an AbortError from rank 1", err)
				}
			} else {
				ctx := context.Background()
				if c.Rank() == 1 && tc.ctxTimeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, tc.ctxTimeout)
					defer cancel()
				}
				if c.Rank() == 1 && tc.abortAfter > 0 {
					time.AfterFunc(tc.abortAfter, func() { c.Abort(boom) })
				}
				err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
				var ae *comm.AbortError
				if !errors.As(err, &ae) || ae.Rank != 1 {
					t.Errorf("rank %d: the call returned %v, want an AbortError from rank 1", c.Rank(), err)
				}
				if c.Rank() == 1 && !errors.Is(err, tc.want) {
					t.Errorf("rank 1: the call returned %v, want %v in it", err, tc.want)
				}
				select {
				case e := <-ended:
					if site := fmt.Sprintf("rank %d: allreduce #1", c.Rank()); !strings.Contains(e.Error(), site) {
						t.Errorf("the job-ending error %q does not name %q", e, site)
					}
					if c.Rank() == 1 && !errors.Is(e, tc.want) {
						t.Errorf("rank 1: the job-ending error %v does not carry %v", e, tc.want)
					}
				default:
					t.Errorf("rank %d: the watchdog did not end the job", c.Rank())
				}
			}
			if err := c.Free(); err != nil {
				t.Error(err)
			}
		})
	}
}

// Ranks that choose differently between blocking and nonblocking calls
// get an error from World on every rank, not a job that hangs later.
func TestBlockingDisagreement(t *testing.T) {
	needRanks(t, 2)
	defer sync(t)
	c, err := mpi.World(mpi.WithBlockingCalls(world.Rank() == 0))
	if err == nil || !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), mpi.BlockingEnv) {
		t.Errorf("got %v, want an ErrInvalid error naming %s", err, mpi.BlockingEnv)
	}
	if c != nil {
		c.Free()
	}
}

// A synchronous call on a blocking communicator first lets the async
// collectives issued before it post everything they have to post (here
// AllToAllV, which exchanges its counts first), so that every rank issues
// the collectives in one order; then both give their results.
func TestBlockingAfterAsync(t *testing.T) {
	c, err := mpi.World(mpi.WithBlockingCalls(true))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Free()
	ctx := context.Background()
	p, r := c.Size(), c.Rank()
	counts := make([]int, p)
	for j := range counts {
		counts[j] = 3
	}
	send := make([]float32, 3*p)
	for j := range send {
		send[j] = float32(100*r + j/3)
	}
	recv := make([]float32, 3*p)
	w, err := comm.AllToAllVAsync(ctx, c, comm.Host(send), comm.Host(recv), counts, counts)
	if err != nil {
		t.Fatal(err)
	}
	x := []float32{float32(r + 1)}
	if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if want := float32(p * (p + 1) / 2); x[0] != want {
		t.Errorf("allreduce: got %v, want %v", x[0], want)
	}
	if err := w.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	for j, v := range recv {
		if want := float32(100*(j/3) + r); v != want {
			t.Fatalf("alltoallv: recv[%d] = %v, want %v", j, v, want)
		}
	}
}

// A rank whose configuration is invalid (here a bad LOOM_MPI_BLOCKING)
// fails World with its own error, and the others fail too, instead of
// waiting in MPI for it.
func TestWorldBadConfigOnOneRank(t *testing.T) {
	needRanks(t, 2)
	defer sync(t)
	if world.Rank() == 1 {
		t.Setenv(mpi.BlockingEnv, "maybe")
	}
	c, err := mpi.World()
	switch {
	case world.Rank() == 1 && (err == nil || !strings.Contains(err.Error(), `"maybe"`)):
		t.Errorf("rank 1: got %v, want its own error about %q", err, "maybe")
	case world.Rank() != 1 && (err == nil || !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "another rank")):
		t.Errorf("rank %d: got %v, want an ErrInvalid error about another rank's configuration", world.Rank(), err)
	}
	if c != nil {
		c.Free()
	}
}
