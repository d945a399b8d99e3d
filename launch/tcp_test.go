package launch

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
)

// tcpJobs returns the TCP jobs of ranks 0..size-1 of one world, as
// loomrun's environment gives them to its processes, and the rendezvous
// server they meet at.
func tcpJobs(t *testing.T, size int) []*Job {
	t.Helper()
	srv, err := rendezvous.Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	host, port, err := net.SplitHostPort(srv.Addr())
	if err != nil {
		t.Fatal(err)
	}
	jobs := make([]*Job, size)
	for r := range size {
		e := env("RANK", fmt.Sprint(r), "WORLD_SIZE", fmt.Sprint(size), "LOCAL_RANK", fmt.Sprint(r), "LOCAL_WORLD_SIZE", fmt.Sprint(size), "MASTER_ADDR", host, "MASTER_PORT", port)
		if jobs[r], err = detect(e, "", size, func(func(string) string) bool { return false }); err != nil {
			t.Fatal(err)
		}
		if jobs[r].Backend != TCP {
			t.Fatalf("rank %d: Detect chose %s, want tcp", r, jobs[r].Backend)
		}
	}
	return jobs
}

// runJobs runs fn on every job (one goroutine per process) and returns
// each process's error.
func runJobs(jobs []*Job, fn Func) []error {
	errs := make([]error, len(jobs))
	var wg sync.WaitGroup
	for r, j := range jobs {
		wg.Go(func() { errs[r] = j.Run(context.Background(), fn) })
	}
	wg.Wait()
	return errs
}

// TestRunTCP: processes that loomrun started on a host without GPUs form
// one TCP world; a rank's failure ends every other rank with an error
// naming it; a rank that never comes fails the setup within the timeout,
// naming the rank.
func TestRunTCP(t *testing.T) {
	const size = 3
	t.Run("all-reduce", func(t *testing.T) {
		errs := runJobs(tcpJobs(t, size), func(ctx context.Context, c comm.Communicator) error {
			x := []float64{float64(c.Rank() + 1)}
			if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
				return err
			}
			if c.Backend() != "tcp" || c.Size() != size || x[0] != 6 {
				return fmt.Errorf("backend %s, size %d, sum %v; want tcp, %d, 6", c.Backend(), c.Size(), x[0], size)
			}
			return nil
		})
		for r, err := range errs {
			if err != nil {
				t.Errorf("rank %d: %v", r, err)
			}
		}
	})
	t.Run("a rank fails", func(t *testing.T) {
		boom := errors.New("boom")
		start := time.Now()
		errs := runJobs(tcpJobs(t, size), func(ctx context.Context, c comm.Communicator) error {
			if c.Rank() == 1 {
				return boom
			}
			for {
				x := []float32{1}
				if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
					return err
				}
			}
		})
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("the ranks took %v to end", el)
		}
		if !errors.Is(errs[1], boom) || !strings.HasPrefix(errs[1].Error(), "rank 1: ") {
			t.Errorf("rank 1: %v; want its own error, naming it", errs[1])
		}
		for _, r := range []int{0, 2} {
			if !errors.Is(errs[r], comm.ErrAborted) || !strings.Contains(errs[r].Error(), "aborted by rank 1") || !strings.HasPrefix(errs[r].Error(), fmt.Sprintf("rank %d: ", r)) {
				t.Errorf("rank %d: %v; want an abort naming rank 1", r, errs[r])
			}
		}
	})
	t.Run("a rank never comes", func(t *testing.T) {
		t.Setenv(comm.TimeoutEnv, "1s")
		start := time.Now()
		errs := runJobs(tcpJobs(t, size)[:2], func(context.Context, comm.Communicator) error { return nil })
		if el := time.Since(start); el > 2*time.Second+500*time.Millisecond {
			t.Errorf("the setup took %v; want it bounded by the 1s timeout: %v", el, errs)
		}
		for r, err := range errs {
			if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("launch: tcp (RANK=%d)", r)) || !strings.Contains(err.Error(), "rank 2") {
				t.Errorf("rank %d: %v; want a setup error naming this rank and the missing rank 2", r, err)
			}
		}
	})
}
