//go:build mpi

package mpi_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/mpi"
)

// A call given a context that has already ended aborts the communicator
// whether its rank comes to the call last (its peer already waits in the
// collective) or first (its peer comes after the abort notice): the
// cancelled rank reports its context, the peer the abort naming rank 0.
func TestCancelledContextAtCallAnyArrivalOrder(t *testing.T) {
	needRanks(t, 2)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, first := range []bool{false, true} {
		t.Run(map[bool]string{false: "cancelled-last", true: "cancelled-first"}[first], func(t *testing.T) {
			c := fresh(t, comm.Options{Timeout: 5 * time.Second})
			x := []float32{1}
			start := time.Now()
			var err error
			switch {
			case c.Rank() == 0 && !first:
				time.Sleep(200 * time.Millisecond) // the peers wait in the allreduce
				err = comm.AllReduce(cancelled, c, comm.Host(x), comm.Host(x), comm.Sum)
			case c.Rank() == 0:
				err = comm.AllReduce(cancelled, c, comm.Host(x), comm.Host(x), comm.Sum)
				sync(t)
			case first:
				sync(t) // rank 0 has aborted
				for mpi.PollNotices(c) == nil && time.Since(start) < 2*time.Second {
					time.Sleep(time.Millisecond)
				}
				err = comm.AllReduce(context.Background(), c, comm.Host(x), comm.Host(x), comm.Sum)
			default:
				err = comm.AllReduce(context.Background(), c, comm.Host(x), comm.Host(x), comm.Sum)
			}
			if c.Rank() == 0 {
				if !errors.Is(err, context.Canceled) || c.Err() == nil {
					t.Errorf("cancelled rank: %v (Err %v), want a cancellation that aborts", err, c.Err())
				}
			} else {
				var ae *comm.AbortError
				if !errors.As(err, &ae) || ae.Rank != 0 || !strings.Contains(err.Error(), "rank 0: allreduce") {
					t.Errorf("peer: %v, want the abort of rank 0's allreduce", err)
				}
				if el := time.Since(start); el > 3*time.Second {
					t.Errorf("peer took %v to fail", el)
				}
			}
			if !first {
				// The peers' allreduce stays posted (MPI cannot cancel it):
				// rank 0 completes it with raw MPI.
				sync(t)
				if c.Rank() == 0 {
					if err := mpi.RawAllReduceSum(c, []float32{0}); err != nil {
						t.Fatal(err)
					}
				}
			}
			sync(t)
			expectNoOrphans(t, c)
			c.Free()
		})
	}
}
