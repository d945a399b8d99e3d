package tp_test

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
)

// input returns a [rows, cols] float32 constant, Replicate on every axis
// of m, with the values 0.1·(i mod 7) in row-major order.
func input(tape *autograd.Tape, m *mesh.Mesh, rows, cols int) (*autograd.Value, error) {
	rep := make([]placement.Placement, m.NDim())
	for i := range rep {
		rep[i] = placement.Replicate()
	}
	spec, err := placement.NewSpec(m, []int{rows, cols}, comm.Float32, rep)
	if err != nil {
		return nil, err
	}
	data := make([]float32, rows*cols)
	for i := range data {
		data[i] = 0.1 * float32(i%7)
	}
	dt, err := placement.NewLocal(spec, data)
	if err != nil {
		return nil, err
	}
	return tape.Constant(dt)
}

// Build an MLP from the constructors and lay it out for tensor parallelism
// over two in-process ranks: fc colwise, proj rowwise (Megatron's MLP).
// Each rank then holds half of each weight, and the forward pass gives the
// serial model's output with one all-reduce.
func ExampleParallelize() {
	ctx := context.Background()
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"tp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		mlp, err := parallel.NewMLP(tape, m, 4, 8, parallel.WithName("mlp"), parallel.WithInit(parallel.Normal(0.5, 1)))
		if err != nil {
			return err
		}
		plan := tp.Plan{
			{Pattern: "fc", Style: tp.ColwiseParallel{}},
			{Pattern: "proj", Style: tp.RowwiseParallel{}},
		}
		if err := tp.Parallelize(ctx, mlp, "tp", plan); err != nil {
			return err
		}
		x, err := input(tape, m, 2, 4)
		if err != nil {
			return err
		}
		y, err := mlp.Forward(ctx, x)
		if err != nil {
			return err
		}
		if m.Rank() != 0 {
			return nil
		}
		params, err := parallel.Params(mlp)
		if err != nil {
			return err
		}
		for _, p := range params {
			fmt.Printf("%-15s global %v, local %v, %v\n", p.Name(), p.Spec().Shape(), p.Spec().LocalShape(), p.Spec().Placements())
		}
		out := y.Data().LocalData().([]float32)
		fmt.Printf("output %v %v, first row %.4f\n", y.Spec().Shape(), y.Spec().Placements(), slices.Clone(out[:4]))
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// mlp.fc.weight   global [8 4], local [4 4], [S(0)]
	// mlp.fc.bias     global [8], local [4], [S(0)]
	// mlp.proj.weight global [4 8], local [4 4], [S(1)]
	// mlp.proj.bias   global [4], local [4], [R]
	// output [2 4] [R], first row [0.1150 -0.0477 -0.0181 -0.0589]
}
