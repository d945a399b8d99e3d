package local_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

func withTimeout(d time.Duration) local.Option {
	return local.WithOptions(comm.Options{Timeout: d})
}

// noLeaks fails the test if goroutines started during it are still alive
// shortly after it ends.
func noLeaks(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(2 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > before {
			buf := make([]byte, 1<<16)
			t.Errorf("%d goroutines leaked:\n%s", n-before, buf[:runtime.Stack(buf, true)])
		}
	})
}

func allReduceOnce(ctx context.Context, c comm.Communicator) error {
	x := []float32{float32(c.Rank())}
	return comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum)
}

// A rank that returns an error mid-sequence ends every other rank at once,
// with an error naming it.
func TestFailingRankEndsAllOthers(t *testing.T) {
	noLeaks(t)
	const timeout = 2 * time.Second
	for _, p := range []int{2, 3, 5} {
		t.Run(fmt.Sprint("p=", p), func(t *testing.T) {
			failing := p - 1
			boom := errors.New("boom")
			errs := make([]error, p)
			start := time.Now()
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				for i := 0; ; i++ {
					if c.Rank() == failing && i == 3 {
						return boom
					}
					if err := allReduceOnce(ctx, c); err != nil {
						errs[c.Rank()] = err
						return err
					}
				}
			}, withTimeout(timeout))
			if el := time.Since(start); el > 2*timeout {
				t.Fatalf("took %v, more than twice the timeout", el)
			}
			if !errors.Is(err, boom) {
				t.Fatalf("joined error %v does not carry the failing rank's error", err)
			}
			for r, e := range errs {
				if r == failing {
					continue
				}
				if !errors.Is(e, comm.ErrAborted) || !strings.Contains(e.Error(), fmt.Sprintf("aborted by rank %d", failing)) {
					t.Errorf("rank %d: error %v does not name rank %d", r, e, failing)
				}
				if !strings.Contains(e.Error(), "allreduce #4") {
					t.Errorf("rank %d: error %v does not name the op and sequence number", r, e)
				}
			}
		})
	}
}

// A rank that silently stops issuing collectives (stuck, still running)
// makes the others time out within twice the timeout, naming the rank they
// waited for, and the flight recorder is dumped.
func TestSilentRankTimesOut(t *testing.T) {
	noLeaks(t)
	const timeout = 300 * time.Millisecond
	dir := t.TempDir()
	const p, silent = 4, 2
	errs := make([]error, p)
	start := time.Now()
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		for i := 0; i < 5; i++ {
			if c.Rank() == silent && i == 2 {
				<-ctx.Done() // stays alive but never joins collective #3
				return nil
			}
			if err := allReduceOnce(ctx, c); err != nil {
				errs[c.Rank()] = err
				return err
			}
		}
		return nil
	}, local.WithOptions(comm.Options{Timeout: timeout, DumpDir: dir}))
	if el := time.Since(start); el > 2*timeout+time.Second/2 {
		t.Fatalf("took %v for a %v timeout", el, timeout)
	}
	if err == nil {
		t.Fatal("no error although a rank left")
	}
	timedOut := 0
	for r, e := range errs {
		if r == silent {
			continue
		}
		if e == nil {
			t.Fatalf("rank %d returned no error", r)
		}
		if !strings.Contains(e.Error(), fmt.Sprintf("rank %d", silent)) || !strings.Contains(e.Error(), "allreduce #3") {
			t.Errorf("rank %d: %v does not name rank %d and allreduce #3", r, e, silent)
		}
		if errors.Is(e, comm.ErrTimeout) {
			timedOut++
		}
	}
	if timedOut == 0 {
		t.Error("no rank reported a timeout")
	}
	dumps, _ := filepath.Glob(filepath.Join(dir, "loom_fr_*"))
	if len(dumps) < 2 {
		t.Fatalf("flight recorder dumps: %v, want a .txt and a .json", dumps)
	}
	for _, d := range dumps {
		data, err := os.ReadFile(d)
		if err != nil || !strings.Contains(string(data), "allreduce") {
			t.Errorf("dump %s: %v %q", d, err, data)
		}
	}
}

// Mismatched collectives under the consistency check fail on every rank
// with an error showing each rank's call and where it was issued.
func TestConsistencyCheckShowsBothCalls(t *testing.T) {
	noLeaks(t)
	errs := make([]error, 2)
	_ = local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		buf := comm.Host(make([]float32, 8))
		var err error
		if c.Rank() == 0 {
			err = comm.AllReduce(ctx, c, buf, buf, comm.Sum)
		} else {
			err = comm.Broadcast(ctx, c, buf, 0)
		}
		errs[c.Rank()] = err
		if err == nil {
			return errors.New("mismatch not detected")
		}
		// The communicator stays usable: the next matched call works.
		return allReduceOnce(ctx, c)
	}, local.WithOptions(comm.Options{Timeout: 5 * time.Second, ConsistencyCheck: true}))
	for r, e := range errs {
		var m *comm.MismatchError
		if !errors.As(e, &m) {
			t.Fatalf("rank %d: %v is not a MismatchError", r, e)
		}
		msg := e.Error()
		for _, want := range []string{"rank 0: allreduce #1", "rank 1: broadcast #1", "differs from rank 0", "failure_test.go:"} {
			if !strings.Contains(msg, want) {
				t.Errorf("rank %d: message lacks %q:\n%s", r, want, msg)
			}
		}
	}
}

// Inconsistent AllToAllV counts are rejected on every rank before any data
// moves, and the error lists the disagreeing pairs.
func TestAllToAllVCountsRejectedBeforeDataMoves(t *testing.T) {
	noLeaks(t)
	const p = 3
	errs := make([]error, p)
	untouched := make([]bool, p)
	_ = local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		send := comm.Host([]int32{1, 2, 3, 4, 5, 6})
		recv := make([]int32, 6)
		for i := range recv {
			recv[i] = -7
		}
		sc, rc := []int{1, 1, 1}, []int{1, 1, 1}
		if c.Rank() == 1 {
			sc = []int{1, 2, 1} // rank 2 expects 1 element from rank 1, not 2
		}
		errs[c.Rank()] = comm.AllToAllV(ctx, c, send, comm.Host(recv), sc, rc)
		untouched[c.Rank()] = true
		for _, v := range recv {
			if v != -7 {
				untouched[c.Rank()] = false
			}
		}
		return nil
	}, withTimeout(5*time.Second))
	for r := 0; r < p; r++ {
		if !errors.Is(errs[r], comm.ErrInvalid) || !strings.Contains(errs[r].Error(), "rank 1 sends 2 elements to rank 1, which expects 1") {
			t.Errorf("rank %d: %v", r, errs[r])
		}
		if !untouched[r] {
			t.Errorf("rank %d: receive buffer was written", r)
		}
	}
}

// Bad arguments on one rank fail the call on every rank, naming the rank
// and the problem, without moving data or breaking the communicator.
func TestBadInputOnOneRankFailsAllCleanly(t *testing.T) {
	noLeaks(t)
	const p = 3
	errs := make([]error, p)
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		recv := comm.Host(make([]float32, 6))
		send := comm.Host(make([]float32, 2))
		if c.Rank() == 2 {
			recv = comm.Host(make([]float32, 5)) // too short
		}
		errs[c.Rank()] = comm.AllGather(ctx, c, send, recv)
		return allReduceOnce(ctx, c)
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatalf("communicator unusable after a rejected call: %v", err)
	}
	for r, e := range errs {
		if !errors.Is(e, comm.ErrInvalid) || !strings.Contains(e.Error(), "rank 2: invalid call: allgather: recv buffer has 5 elements, want 6") {
			t.Errorf("rank %d: %v", r, e)
		}
	}
}

// A cancelled context returns promptly, aborts the communicator for the
// peers, and leaves no goroutine behind.
func TestCancelledContextReturnsPromptly(t *testing.T) {
	noLeaks(t)
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprint("async=", async), func(t *testing.T) {
			wd, err := local.NewWorld(3, withTimeout(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			errs := make([]error, 3)
			took := make([]time.Duration, 3)
			for r := 0; r < 2; r++ { // rank 2 never arrives
				wg.Add(1)
				go func(r int) {
					defer wg.Done()
					start := time.Now()
					x := comm.Host(make([]float64, 1000))
					if async {
						var w comm.Work
						w, errs[r] = comm.AllReduceAsync(ctx, wd.Comm(r), x, x, comm.Sum)
						if errs[r] == nil {
							errs[r] = w.Wait(ctx)
						}
					} else {
						errs[r] = comm.AllReduce(ctx, wd.Comm(r), x, x, comm.Sum)
					}
					took[r] = time.Since(start)
				}(r)
			}
			time.Sleep(50 * time.Millisecond)
			cancel()
			wg.Wait()
			for r := 0; r < 2; r++ {
				if !errors.Is(errs[r], context.Canceled) && !errors.Is(errs[r], comm.ErrAborted) {
					t.Errorf("rank %d: %v", r, errs[r])
				}
				if took[r] > 50*time.Millisecond+time.Second {
					t.Errorf("rank %d took %v after cancel", r, took[r])
				}
			}
			// The late rank finds the communicator aborted.
			if err := allReduceOnce(context.Background(), wd.Comm(2)); !errors.Is(err, comm.ErrAborted) {
				t.Errorf("late rank: %v", err)
			}
		})
	}
}

// Point-to-point messages match by tag in posting order; a length
// mismatch is an error on both sides.
func TestSendRecvTagsAndMismatch(t *testing.T) {
	noLeaks(t)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		if c.Rank() == 0 {
			var ws []comm.Work
			for i, tag := range []int{7, 8, 7} {
				w, err := comm.SendAsync(ctx, c, comm.Host([]int64{int64(i)}), 1, tag)
				if err != nil {
					return err
				}
				ws = append(ws, w)
			}
			if err := comm.WaitAll(ctx, ws...); err != nil {
				return err
			}
			err := comm.Send(ctx, c, comm.Host([]int64{1, 2}), 1, 9)
			if !errors.Is(err, comm.ErrInvalid) {
				return fmt.Errorf("length mismatch on the send side: %v", err)
			}
			return nil
		}
		got := make([]int64, 3)
		for i, tag := range []int{8, 7, 7} {
			if err := comm.Recv(ctx, c, comm.Host(got[i:i+1]), 0, tag); err != nil {
				return err
			}
		}
		if got[0] != 1 || got[1] != 0 || got[2] != 2 {
			return fmt.Errorf("tag matching: got %v, want [1 0 2]", got)
		}
		err := comm.Recv(ctx, c, comm.Host(make([]int64, 3)), 0, 9)
		if !errors.Is(err, comm.ErrInvalid) || !strings.Contains(err.Error(), "send of 2 elements") {
			return fmt.Errorf("length mismatch on the receive side: %v", err)
		}
		return nil
	}, withTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

// Async collectives run in issue order behind each other, and a blocking
// call after them waits its turn.
func TestAsyncOrder(t *testing.T) {
	noLeaks(t)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		var ws []comm.Work
		bufs := make([][]float64, 20)
		for i := range bufs {
			bufs[i] = []float64{float64(i * (c.Rank() + 1))}
			w, err := comm.AllReduceAsync(ctx, c, comm.Host(bufs[i]), comm.Host(bufs[i]), comm.Sum)
			if err != nil {
				return err
			}
			ws = append(ws, w)
		}
		last := []float64{1}
		if err := comm.AllReduce(ctx, c, comm.Host(last), comm.Host(last), comm.Max); err != nil {
			return err
		}
		if err := comm.WaitAll(ctx, ws...); err != nil {
			return err
		}
		for i, b := range bufs {
			if b[0] != float64(6*i) {
				return fmt.Errorf("async #%d = %v, want %v", i, b[0], 6*i)
			}
		}
		rec := c.Recorder().Entries()
		if len(rec) != 21 || rec[20].State != comm.Completed {
			return fmt.Errorf("flight recorder holds %d entries, last %+v", len(rec), rec[len(rec)-1])
		}
		return nil
	}, withTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
}

// A panicking rank is an error, not a crash, and ends the others.
func TestPanickingRank(t *testing.T) {
	noLeaks(t)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		if c.Rank() == 1 {
			panic("kaboom")
		}
		return allReduceOnce(ctx, c)
	}, withTimeout(time.Minute))
	if err == nil || !strings.Contains(err.Error(), "rank 1: panic: kaboom") || !strings.Contains(err.Error(), "aborted by rank 1") {
		t.Fatalf("got %v", err)
	}
}
