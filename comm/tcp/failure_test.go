package tcp_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/tcp"
)

func withTimeout(d time.Duration) tcp.Option {
	return tcp.WithOptions(comm.Options{Timeout: d})
}

// rounds bounds the loops of the fault tests, so that a backend that
// misses the fault ends them instead of looping forever.
const rounds = 100

var errNoFailure = errors.New("no call failed")

func allReduceOnce(ctx context.Context, c comm.Communicator) error {
	x := make([]float32, 1000)
	for i := range x {
		x[i] = float32(c.Rank())
	}
	return comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
}

// errsOf runs fn on p ranks and returns each rank's error, failing the test
// if the world took more than twice timeout.
func errsOf(t *testing.T, p int, timeout time.Duration, fn func(ctx context.Context, c *tcp.Comm) error) []error {
	t.Helper()
	errs := make([]error, p)
	start := time.Now()
	world(context.Background(), t, p, func(ctx context.Context, c *tcp.Comm) error {
		errs[c.Rank()] = fn(ctx, c)
		return nil
	}, withTimeout(timeout))
	if el := time.Since(start); el > 2*timeout+time.Second {
		t.Errorf("took %v, more than twice the timeout of %v", el, timeout)
	}
	return errs
}

// A peer whose connections drop mid-sequence (a killed process) ends every
// other rank with an error naming it, well within the timeout.
func TestPeerKilledMidCollective(t *testing.T) {
	const timeout = 3 * time.Second
	for _, p := range []int{2, 3, 5} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			dying := p - 1
			errs := errsOf(t, p, timeout, func(ctx context.Context, c *tcp.Comm) error {
				for i := range rounds {
					if c.Rank() == dying && i == 3 {
						tcp.KillConnections(c)
						return nil
					}
					if err := allReduceOnce(ctx, c); err != nil {
						return err
					}
				}
				return errNoFailure
			})
			for r, err := range errs {
				if r == dying {
					continue
				}
				if !errors.Is(err, comm.ErrAborted) || !errors.Is(err, tcp.ErrPeer) || !strings.Contains(err.Error(), fmt.Sprintf("rank %d: connection", dying)) {
					t.Errorf("rank %d: error %v does not name rank %d's lost connection", r, err, dying)
				}
			}
		})
	}
}

// A frame that is not of the protocol aborts every rank with an error
// naming the peer that sent it (rank 0 sees it, the others learn it from
// rank 0's notice).
func TestGarbageFrame(t *testing.T) {
	const timeout = 3 * time.Second
	errs := errsOf(t, 3, timeout, func(ctx context.Context, c *tcp.Comm) error {
		for i := range rounds {
			if c.Rank() == 1 && i == 2 {
				tcp.SendGarbage(c, 0)
			}
			if err := allReduceOnce(ctx, c); err != nil {
				return err
			}
		}
		return errNoFailure
	})
	for _, r := range []int{0, 2} {
		if err := errs[r]; !errors.Is(err, tcp.ErrPeer) || !strings.Contains(err.Error(), "rank 1: garbage frame") {
			t.Errorf("rank %d: error %v does not name rank 1's garbage frame", r, err)
		}
	}
	if errs[1] == nil {
		t.Error("rank 1 ended without an error")
	}
}

// A peer that stalls makes every rank time out within twice the timeout,
// each naming it (LateRanks), the stalled one too once it calls.
func TestStalledPeer(t *testing.T) {
	const timeout = time.Second
	for _, op := range []comm.Op{comm.OpBarrier, comm.OpAllToAll} {
		t.Run(op.String(), func(t *testing.T) {
			errs := errsOf(t, 3, timeout, func(ctx context.Context, c *tcp.Comm) error {
				if c.Rank() == 1 {
					time.Sleep(timeout * 3 / 2)
				}
				if op == comm.OpBarrier {
					return comm.Barrier(ctx, c)
				}
				x := make([]int32, 3)
				return comm.AllToAll(ctx, c, comm.Host(x), comm.Host(make([]int32, 3)))
			})
			for r, err := range errs {
				if !errors.Is(err, comm.ErrTimeout) || !slices.Equal(comm.LateRanks(err), []int{1}) {
					t.Errorf("rank %d: error %v: want a timeout blaming rank 1 (LateRanks %v)", r, err, comm.LateRanks(err))
				}
				if !strings.Contains(err.Error(), op.String()+" #0") {
					t.Errorf("rank %d: error %v does not name %v #0", r, err, op)
				}
			}
		})
	}
}

// A peer that stalls in a communicator split from the world is named by
// both of its ranks, so that the process to look at is plain: world ranks
// 1 and 3 form one half, and world rank 1 waits for its rank 1 (world rank
// 3).
func TestStalledPeerInSplit(t *testing.T) {
	const timeout = time.Second
	errs := errsOf(t, 4, timeout, func(ctx context.Context, c *tcp.Comm) error {
		half, err := c.Split(ctx, c.Rank()%2, c.Rank())
		if err != nil {
			return err
		}
		if c.Rank() == 3 {
			time.Sleep(timeout * 3 / 2)
		}
		return comm.Barrier(ctx, half)
	})
	if err := errs[1]; !errors.Is(err, comm.ErrTimeout) || !strings.Contains(err.Error(), "waiting for rank 1 (world rank 3)") || !slices.Equal(comm.LateRanks(err), []int{3}) {
		t.Errorf("world rank 1: error %v; want a timeout waiting for rank 1 (world rank 3)", err)
	}
	for _, r := range []int{0, 2} {
		if errs[r] != nil {
			t.Errorf("world rank %d, in the other half: %v", r, errs[r])
		}
	}
}

// A cancelled context aborts the communicator: the cancelling rank's call
// matches context.Canceled, every peer's is an abort naming that rank.
func TestCancelledContext(t *testing.T) {
	const timeout = 5 * time.Second
	errs := errsOf(t, 3, timeout, func(ctx context.Context, c *tcp.Comm) error {
		switch c.Rank() {
		case 0:
			ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			defer cancel()
			ctx, stop := context.WithCancel(ctx)
			time.AfterFunc(50*time.Millisecond, stop)
			return allReduceOnce(ctx, c)
		case 2:
			time.Sleep(500 * time.Millisecond) // rank 0 cancels while waiting for this one
		}
		return allReduceOnce(ctx, c)
	})
	if !errors.Is(errs[0], context.Canceled) {
		t.Errorf("rank 0: error %v does not match context.Canceled", errs[0])
	}
	for _, r := range []int{1, 2} {
		if err := errs[r]; !errors.Is(err, comm.ErrAborted) || !strings.Contains(err.Error(), "aborted by rank 0") || !strings.Contains(err.Error(), "allreduce #0") {
			t.Errorf("rank %d: error %v is not an abort by rank 0 in allreduce #0", r, err)
		}
	}
}

// Ranks that issue different collectives fail on every rank with
// ErrMismatch, not a hang or wrong data: with the consistency check before
// any data moves, and without it as soon as a frame of the other
// collective arrives (its fingerprint hash differs).
func TestMismatchedCollectives(t *testing.T) {
	const timeout = 3 * time.Second
	for _, tc := range []struct {
		name  string
		check bool
		other func(ctx context.Context, c comm.Communicator, x []float32) error
	}{
		{"checked/broadcast", true, func(ctx context.Context, c comm.Communicator, x []float32) error {
			return comm.Broadcast(ctx, c, comm.Host(x), 0)
		}},
		{"frames/max", false, func(ctx context.Context, c comm.Communicator, x []float32) error {
			return comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Max)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, 3)
			world(context.Background(), t, 3, func(ctx context.Context, c *tcp.Comm) error {
				x := make([]float32, 8)
				if c.Rank() == 1 {
					errs[1] = tc.other(ctx, c, x)
				} else {
					errs[c.Rank()] = comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
				}
				return nil
			}, tcp.WithOptions(comm.Options{Timeout: timeout, ConsistencyCheck: tc.check}))
			for r, err := range errs {
				if !errors.Is(err, comm.ErrMismatch) {
					t.Errorf("rank %d: error %v does not match ErrMismatch", r, err)
				}
			}
		})
	}
}
