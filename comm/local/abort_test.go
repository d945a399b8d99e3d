package local_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// These tests pin down which error a rank sees when its communicator is
// aborted while it waits: the abort's cause, on every rank, whether the
// wait is blocking or async, and whatever the local context does
// meanwhile (local.Run cancels it right after the abort).

// abortTimeout makes a world whose calls time out after d.
func abortTimeout(d time.Duration) local.Option {
	return local.WithOptions(comm.Options{Timeout: d})
}

// wantAbortBy checks that err is the abort of rank by, carrying msg.
func wantAbortBy(err error, by int, msg string) error {
	switch {
	case err == nil:
		return errors.New("no error")
	case !errors.Is(err, comm.ErrAborted):
		return fmt.Errorf("not ErrAborted: %v", err)
	case !strings.Contains(err.Error(), fmt.Sprintf("aborted by rank %d", by)):
		return fmt.Errorf("does not name rank %d: %v", by, err)
	case !strings.Contains(err.Error(), msg):
		return fmt.Errorf("does not carry %q: %v", msg, err)
	case strings.Contains(err.Error(), "cancelled while waiting"):
		return fmt.Errorf("reports the cancellation, not the abort: %v", err)
	}
	return nil
}

// The case: the last rank returns "boom" while the others wait on
// an async call; each waiter must report that abort, not the context that
// Run cancels after it. The async forms wait in task.Wait, Split waits for
// earlier async work; each is run 20 times, as the wrong answer came in
// 40 runs of 40 but depends on scheduling.
func TestAbortCauseWinsOverCancel(t *testing.T) {
	noLeaks(t)
	waits := map[string]func(ctx context.Context, c comm.Communicator) error{
		"allreduce-async": func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host(make([]float32, 64))
			w, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum)
			if err != nil {
				return err
			}
			return w.Wait(ctx)
		},
		"barrier-async": func(ctx context.Context, c comm.Communicator) error {
			w, err := comm.BarrierAsync(ctx, c)
			if err != nil {
				return err
			}
			return w.Wait(ctx)
		},
		"queued-blocking": func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host(make([]float32, 64))
			if _, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum); err != nil {
				return err
			}
			return comm.Barrier(ctx, c) // queued behind the async call
		},
		"split-after-async": func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host(make([]float32, 64))
			if _, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum); err != nil {
				return err
			}
			_, err := c.Split(ctx, 0, c.Rank())
			return err
		},
		"blocking": func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host(make([]float32, 64))
			return comm.AllReduce(ctx, c, x, x, comm.Sum)
		},
	}
	for _, p := range []int{2, 3, 4} {
		for name, wait := range waits {
			t.Run(fmt.Sprintf("p=%d/%s", p, name), func(t *testing.T) {
				failing := p - 1
				for run := range 20 {
					errs := make([]error, p)
					err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
						if c.Rank() == failing {
							return errors.New("boom")
						}
						errs[c.Rank()] = wait(ctx, c)
						return errs[c.Rank()]
					}, abortTimeout(10*time.Second))
					if err == nil {
						t.Fatalf("run %d: Run returned nil", run)
					}
					for r := range failing {
						if e := wantAbortBy(errs[r], failing, "boom"); e != nil {
							t.Fatalf("run %d: rank %d: %v", run, r, e)
						}
					}
				}
			})
		}
	}
}

// An async barrier that one rank never joins times out; the timeout, not
// the cancellation of the context that follows it, is what every waiting
// rank reports: its own ErrTimeout, or the abort of the rank that timed
// out first, which carries that ErrTimeout.
func TestAbortAsyncBarrierTimeout(t *testing.T) {
	noLeaks(t)
	const timeout = 100 * time.Millisecond
	for _, p := range []int{3, 4} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			silent := p - 1
			for run := range 4 {
				errs := make([]error, p)
				start := time.Now()
				err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
					if c.Rank() == silent {
						<-ctx.Done() // alive, but never joins the barrier
						return nil
					}
					w, err := comm.BarrierAsync(ctx, c)
					if err == nil {
						err = w.Wait(ctx)
					}
					errs[c.Rank()] = err
					return err
				}, abortTimeout(timeout))
				if el := time.Since(start); el > 2*timeout+time.Second/2 {
					t.Fatalf("run %d took %v for a %v timeout", run, el, timeout)
				}
				if err == nil {
					t.Fatalf("run %d: Run returned nil", run)
				}
				for r := range silent {
					e := errs[r]
					if !errors.Is(e, comm.ErrTimeout) || strings.Contains(fmt.Sprint(e), "cancelled") {
						t.Fatalf("run %d: rank %d: want the timeout, got %v", run, r, e)
					}
					if !strings.Contains(e.Error(), fmt.Sprintf("rank %d", silent)) {
						t.Fatalf("run %d: rank %d: %v does not name the silent rank %d", run, r, e, silent)
					}
				}
			}
		})
	}
}

// A call given a context that is already cancelled aborts the
// communicator whether its rank arrives first or last: the cancelled rank
// reports its context, every peer the abort naming that rank and the op.
func TestCancelledContextAtCallAnyArrivalOrder(t *testing.T) {
	noLeaks(t)
	type op struct {
		name string // as it appears in the abort
		call func(ctx context.Context, c comm.Communicator) error
	}
	ops := []op{
		{"allreduce", func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host([]float64{1, 2})
			return comm.AllReduce(ctx, c, x, x, comm.Sum)
		}},
		{"allreduce", func(ctx context.Context, c comm.Communicator) error {
			x := comm.Host([]float64{1, 2})
			w, err := comm.AllReduceAsync(ctx, c, x, x, comm.Sum)
			if err != nil {
				return err
			}
			return w.Wait(context.Background()) // the call's context alone
		}},
		{"broadcast", func(ctx context.Context, c comm.Communicator) error {
			return comm.Broadcast(ctx, c, comm.Host([]float32{1}), 0)
		}},
		{"barrier", func(ctx context.Context, c comm.Communicator) error {
			return comm.Barrier(ctx, c)
		}},
		{"split", func(ctx context.Context, c comm.Communicator) error {
			_, err := c.Split(ctx, 0, 0)
			return err
		}},
		{"barrier", func(ctx context.Context, c comm.Communicator) error { // Share
			return c.(comm.SharedMemory).Share(ctx, c.Rank(), func([]any) error { return nil })
		}},
		{"send", func(ctx context.Context, c comm.Communicator) error {
			buf := comm.Host([]float32{1})
			if c.Rank() == 0 {
				return comm.Send(ctx, c, buf, 1, 7)
			}
			return comm.Recv(ctx, c, buf, 0, 7)
		}},
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	const p, late = 2, 30 * time.Millisecond
	for i, o := range ops {
		for _, first := range []bool{true, false} {
			t.Run(fmt.Sprintf("%d-%s/cancelled-first=%v", i, o.name, first), func(t *testing.T) {
				wd, err := local.NewWorld(p, abortTimeout(5*time.Second))
				if err != nil {
					t.Fatal(err)
				}
				errs := make([]error, p)
				took := make([]time.Duration, p)
				var wg sync.WaitGroup
				for r := range p {
					wg.Add(1)
					go func() {
						defer wg.Done()
						ctx := context.Background()
						if r == 0 {
							ctx = cancelled
						}
						if (r == 0) != first {
							time.Sleep(late)
						}
						start := time.Now()
						errs[r] = o.call(ctx, wd.Comm(r))
						took[r] = time.Since(start)
					}()
				}
				wg.Wait()
				if !errors.Is(errs[0], context.Canceled) {
					t.Errorf("cancelled rank: %v, want context.Canceled", errs[0])
				}
				if e := wantAbortBy(errs[1], 0, "rank 0: "+o.name); e != nil {
					t.Errorf("peer: %v", e)
				}
				for r, d := range took {
					if d > late+time.Second {
						t.Errorf("rank %d took %v", r, d)
					}
				}
				if wd.Comm(1).Err() == nil {
					t.Error("the communicator is not aborted")
				}
			})
		}
	}
}
