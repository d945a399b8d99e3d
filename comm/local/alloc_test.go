package local_test

import (
	"context"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// The steady state of a collective allocates nothing: allocations feed the
// garbage collector, whose pauses cost tens of microseconds to ranks that
// are waiting on each other.
func TestCollectivesDoNotAllocate(t *testing.T) {
	if testing.Short() {
		t.Skip("counts every allocation in the process; run without -short (and without -race)")
	}
	const runs = 200
	for _, algo := range local.Algorithms(comm.OpAllReduce) {
		for _, n := range []int{2, 1 << 12} {
			wd, err := local.NewWorld(2)
			if err != nil {
				t.Fatal(err)
			}
			call := func(r int) comm.Call {
				x := make([]float32, n)
				return comm.Call{Op: comm.OpAllReduce, Send: comm.Host(x), Recv: comm.Host(x), Reduce: comm.Sum, Algorithm: algo}
			}
			c0, c1 := call(0), call(1)
			ctx := context.Background()
			// Warm the schedule caches first.
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < runs+2; i++ {
					if err := wd.Comm(1).Do(ctx, c1); err != nil {
						t.Error(err)
						return
					}
				}
			}()
			if err := wd.Comm(0).Do(ctx, c0); err != nil {
				t.Fatal(err)
			}
			allocs := testing.AllocsPerRun(runs, func() {
				if err := wd.Comm(0).Do(ctx, c0); err != nil {
					t.Error(err)
				}
			})
			wg.Wait()
			if allocs > 0.05 { // both ranks together, per call
				t.Errorf("%v n=%d: %.2f allocations per call", algo, n, allocs)
			}
		}
	}
}
