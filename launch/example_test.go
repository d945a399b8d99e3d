package launch_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
)

// One program for every way of starting it: Auto reads the environment.
// Run by hand (or by go run, as here) it holds both ranks as goroutines of
// this process; under `loomrun -n 2` each of two processes holds one rank,
// the two connected over TCP (NCCL on GPUs), and only world rank 0 prints.
func ExampleAuto() {
	job, err := launch.Auto(2)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		x := []float32{float32(c.Rank() + 1)}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		if c.Rank() == 0 {
			fmt.Printf("%v: sum %v\n", job, x[0])
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output: 2 in-process rank(s): sum 3
}
