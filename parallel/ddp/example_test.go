package ddp_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/placement"
)

// DDP over two data-parallel ranks: the batch is sharded on dp, so each
// rank's backward leaves its rows' contribution to the weight gradient
// (Partial(sum) on dp); Finish all-reduces the contributions (launched
// from the gradient hooks while backward runs) and installs their sum,
// Replicate on dp. The loss is the mean over the global batch, so the sum
// is the gradient of the mean: the average of the rows.
func ExampleNew() {
	ctx := context.Background()
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"dp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		lin, err := parallel.NewLinear(tape, m, 2, 1, parallel.WithName("lin"), parallel.WithBias(false),
			parallel.WithInit(parallel.Values([]float32{1, 1})))
		if err != nil {
			return err
		}
		d, err := ddp.New(ctx, []*autograd.Value{lin.Weight})
		if err != nil {
			return err
		}
		// The global batch is [[1, 2], [2, 4]]; rank r holds row r.
		spec, err := placement.NewSpec(m, []int{2, 2}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		r := float32(m.Rank() + 1)
		xd, err := placement.NewLocal(spec, []float32{r, 2 * r})
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		y, err := lin.Forward(ctx, x)
		if err != nil {
			return err
		}
		sum, err := autograd.Sum(y)
		if err != nil {
			return err
		}
		loss, err := autograd.Scale(sum, 0.5) // the mean over the 2 rows
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if err := d.Finish(ctx); err != nil {
			return err
		}
		if m.Rank() == 0 {
			g := lin.Weight.Grad()
			fmt.Println("gradient", g.LocalData(), g.Spec().Placements())
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// gradient [1.5 3] [R]
}
