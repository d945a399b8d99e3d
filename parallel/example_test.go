package parallel_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
)

// Build a small model from the module tree on one rank. Sequential names
// its layers "0", "1", "2": the paths that tp.Plan rules, fsdp.FullyShard
// and Checkpoint patterns name. Walk visits every module with its path and
// Params collects the parameters for an optimizer.
func ExampleNewSequential() {
	ctx := context.Background()
	err := local.Run(ctx, 1, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{1}, []string{"dp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		fc1, err := parallel.NewLinear(tape, m, 2, 3, parallel.WithName("0"),
			parallel.WithInit(parallel.Values([]float32{1, 0, 0, 1, -1, -1})))
		if err != nil {
			return err
		}
		fc2, err := parallel.NewLinear(tape, m, 3, 1, parallel.WithName("2"),
			parallel.WithInit(parallel.Values([]float32{1, 1, 1})))
		if err != nil {
			return err
		}
		model, err := parallel.NewSequential(fc1, parallel.NewReLU(), fc2)
		if err != nil {
			return err
		}
		if err := parallel.Walk(model, func(path string, mod parallel.Module) error {
			fmt.Printf("module %q %T\n", path, mod)
			return nil
		}); err != nil {
			return err
		}
		params, err := parallel.Params(model)
		if err != nil {
			return err
		}
		for _, p := range params {
			fmt.Println("parameter", p.Name(), p.Spec().Shape())
		}
		// One row, x = [1, 2]: fc1 gives [1, 2, -3], ReLU [1, 2, 0], fc2 3.
		spec, err := placement.NewSpec(m, []int{1, 2}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		xd, err := placement.NewLocal(spec, []float32{1, 2})
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		y, err := model.Forward(ctx, x)
		if err != nil {
			return err
		}
		fmt.Println("output", y.Data().LocalData())
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// module "" *parallel.Sequential
	// module "0" *parallel.Linear
	// module "1" *parallel.Activation
	// module "2" *parallel.Linear
	// parameter 0.weight [3 2]
	// parameter 0.bias [3]
	// parameter 2.weight [1 3]
	// parameter 2.bias [1]
	// output [3]
}
