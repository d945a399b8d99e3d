package local

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/b7ea7098/loom/comm"
)

// threadCPUs lists the CPUs the calling thread may run on.
func threadCPUs(t *testing.T) []int {
	t.Helper()
	cpus, err := usableCPUs()
	if err != nil {
		t.Fatal(err)
	}
	return cpus
}

// TestCPUBinding runs as many ranks as there are CPUs (at most 4) bound,
// and checks that each rank's thread may run on exactly its share, stays
// that thread across a yield, and that unbound ranks keep every CPU.
func TestCPUBinding(t *testing.T) {
	all := threadCPUs(t)
	p := min(len(all), 4)
	for _, bind := range []bool{true, false} {
		t.Run(fmt.Sprint("bind=", bind), func(t *testing.T) {
			got := make([][]int, p)
			err := Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				tid := unix.Gettid()
				runtime.Gosched()
				if bind && unix.Gettid() != tid {
					return errors.New("a bound rank moved to another thread")
				}
				cpus, err := usableCPUs()
				got[c.Rank()] = cpus
				return err
			}, WithCPUBinding(bind))
			if err != nil {
				t.Fatal(err)
			}
			seen := map[int]bool{}
			for r, cpus := range got {
				want := all
				if bind {
					want = all[r*len(all)/p : (r+1)*len(all)/p]
				}
				if !slices.Equal(cpus, want) {
					t.Errorf("rank %d may run on CPUs %v, want %v", r, cpus, want)
				}
				for _, c := range cpus {
					if bind && seen[c] {
						t.Errorf("CPU %d is in two ranks' shares", c)
					}
					seen[c] = true
				}
			}
		})
	}
	if after := threadCPUs(t); !slices.Equal(after, all) {
		t.Errorf("after Run the test's thread may run on %v, want %v", after, all)
	}
}

// TestCPUBindingRefused checks that binding more ranks than CPUs, or a bad
// BindEnv, fails before any rank runs, and that BindEnv binds the runs
// whose ranks fit and runs larger ones unbound.
func TestCPUBindingRefused(t *testing.T) {
	n := len(threadCPUs(t))
	var runs atomic.Int32
	fn := func(context.Context, comm.Communicator) error { runs.Add(1); return nil }
	err := Run(context.Background(), n+1, fn, WithCPUBinding(true))
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("cannot bind %d ranks", n+1)) {
		t.Errorf("binding %d ranks to %d CPUs: err = %v, want one saying it cannot bind them", n+1, n, err)
	}
	t.Setenv(BindEnv, "sometimes")
	if err := Run(context.Background(), 1, fn); err == nil || !strings.Contains(err.Error(), BindEnv) {
		t.Errorf("%s=sometimes: err = %v, want one naming %s", BindEnv, err, BindEnv)
	}
	if runs.Load() != 0 {
		t.Error("a rank ran although binding was refused")
	}
	// The environment binds where the ranks fit and leaves larger runs be.
	t.Setenv(BindEnv, "1")
	if err := Run(context.Background(), n+1, fn); err != nil || int(runs.Load()) != n+1 {
		t.Errorf("%s=1 with %d ranks on %d CPUs: err = %v, %d ranks ran; want an unbound run", BindEnv, n+1, n, err, runs.Load())
	}
	var bound atomic.Int32
	err = Run(context.Background(), n, func(context.Context, comm.Communicator) error {
		if cpus, err := usableCPUs(); err == nil && len(cpus) == 1 {
			bound.Add(1)
		}
		return nil
	})
	if err != nil || int(bound.Load()) != n {
		t.Errorf("%s=1 with %d ranks on %d CPUs: err = %v, %d ranks bound to one CPU, want all", BindEnv, n, n, err, bound.Load())
	}
	if err := Run(context.Background(), n, fn, WithCPUBinding(false)); err != nil {
		t.Errorf("WithCPUBinding(false) with %s=1: %v", BindEnv, err)
	}
}
