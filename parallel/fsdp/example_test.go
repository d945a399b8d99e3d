package fsdp_test

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement"
)

// Shard an MLP's two Linears over two in-process ranks with FullyShard,
// run one training step's forward and backward, and reduce-scatter the
// gradients: each rank holds half of every parameter and of its gradient.
func ExampleFullyShard() {
	ctx := context.Background()
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"fsdp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		mlp, err := parallel.NewMLP(tape, m, 4, 8, parallel.WithName("mlp"))
		if err != nil {
			return err
		}
		f, err := fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"})
		if err != nil {
			return err
		}
		// The batch: 3 rows of 4 features, the same on both ranks.
		spec, err := placement.NewSpec(m, []int{3, 4}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		xd, err := placement.FromFull(spec, slices.Repeat([]float32{0.1, 0.2, 0.3, 0.4}, 3))
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		y, err := mlp.Forward(ctx, x)
		if err != nil {
			return err
		}
		loss, err := autograd.Sum(y)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if err := f.Finish(ctx); err != nil {
			return err
		}
		if m.Rank() == 0 {
			for _, u := range f.Units() {
				fmt.Println("unit", u.Path, u.Params, "reshard", u.Reshard)
			}
			for _, p := range f.Params() {
				fmt.Println(p.Name(), p.Spec().Shape(), "local", p.Spec().LocalShape(), "grad", p.Grad().Spec().Placements())
			}
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// unit fc [mlp.fc.weight mlp.fc.bias] reshard -1
	// unit proj [mlp.proj.weight mlp.proj.bias] reshard -1
	// mlp.fc.weight [8 4] local [4 4] grad [S(0)]
	// mlp.fc.bias [8] local [4] grad [S(0)]
	// mlp.proj.weight [4 8] local [2 8] grad [S(0)]
	// mlp.proj.bias [4] local [2] grad [S(0)]
}
