package local_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// ExampleNewWorld drives a world's ranks by hand, each from its own
// goroutine, where Run would do it for you. WithCostModel with the built-in
// model skips measuring the machine.
func ExampleNewWorld() {
	wd, err := local.NewWorld(3, local.WithCostModel(comm.BuiltinCostModel()))
	if err != nil {
		fmt.Println(err)
		return
	}
	sums := make([]float32, wd.Size())
	errs := make([]error, wd.Size())
	var wg sync.WaitGroup
	for r := range wd.Size() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer wd.Leave(r)
			x := []float32{float32(r + 1)}
			errs[r] = comm.AllReduce(context.Background(), wd.Comm(r), comm.Host(x), comm.Host(x), comm.Sum)
			sums[r] = x[0]
		}()
	}
	wg.Wait()
	fmt.Println(wd.Size(), "ranks, sums", sums, errs)
	// Output: 3 ranks, sums [6 6 6] [<nil> <nil> <nil>]
}
