package autograd_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Data parallelism on two simulated ranks: the batch x is sharded on dp,
// the weight w is replicated. The loss is Partial(sum) on dp (each rank
// sums its own rows), so w's gradient is Partial(sum) too; the hook sees it
// the moment it is final, and an explicit redistribute to Replicate is the
// all-reduce DDP would run.
func Example() {
	err := placementtest.Simulate(context.Background(), []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		xs, err := placement.NewSpec(m, []int{4, 3}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		ws, err := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		xd, err := placement.FromFull(xs, []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12})
		if err != nil {
			return err
		}
		wd, err := placement.FromFull(ws, []float64{1, 1, 1, 1, 1, 1})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		w, err := tape.Param("w", wd)
		if err != nil {
			return err
		}
		err = w.OnGradReady(func(_ context.Context, v *autograd.Value) error {
			if m.Rank() == 0 {
				fmt.Println("gradient of", v.Name(), "ready:", v.Grad().Spec().Placements())
			}
			return nil
		})
		if err != nil {
			return err
		}
		y, err := autograd.MatMul(x, w) // [4 2], S(0)
		if err != nil {
			return err
		}
		loss, err := autograd.Sum(y) // scalar, P(sum)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		g, err := w.Grad().Full(ctx) // the all-reduce
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			fmt.Println("loss placements:", loss.Spec().Placements())
			fmt.Println("dL/dw:", g)
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// gradient of w ready: [P(sum)]
	// loss placements: [P(sum)]
	// dL/dw: [22 22 26 26 30 30]
}
