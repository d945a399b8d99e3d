package placementtest_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Unit-testing a placement transition on a laptop: six simulated ranks as
// a 2x3 ("dp","tp") mesh take a 5x4 tensor from genuinely Partial(sum) on
// dp and row-sharded on tp (uneven: 2, 2 and 1 rows) to column-sharded on
// dp and replicated on tp, and compare the result with the serial tensor.
func Example() {
	shape := []int{5, 4}
	x := placementtest.Random(shape, comm.Float64, 42) // the serial reference
	err := placementtest.Simulate(context.Background(), []int{2, 3}, []string{"dp", "tp"},
		func(ctx context.Context, m *mesh.Mesh) error {
			src, err := placement.NewSpec(m, shape, comm.Float64,
				[]placement.Placement{placement.Partial(comm.Sum), placement.Shard(0)})
			if err != nil {
				return err
			}
			dst, err := src.With([]placement.Placement{placement.Shard(1), placement.Replicate()})
			if err != nil {
				return err
			}
			dt, err := placementtest.Distribute(src, x, 7) // random pieces that sum to x
			if err != nil {
				return err
			}
			planner := placement.NewPlanner(nil)
			out, err := planner.Redistribute(ctx, dt, dst)
			if err != nil {
				return err
			}
			if err := placementtest.CheckFull(ctx, out, x, 1e-12); err != nil {
				return err
			}
			if m.Rank() == 0 {
				pl, _ := planner.Plan(src, dst)
				fmt.Println(pl)
				fmt.Println(out)
			}
			return nil
		})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// plan [5 4] float64 on (dp=2, tp=3): [P(sum) S(0)]
	//   -> [5 4] float64 on (dp=2, tp=3): [S(1) R]
	//   1. dp(2)  reducescatter            P(sum)->S(1) op=sum dim 1  32 B/rank
	//   2. tp(3)  allgather                S(0)->R dim 0  64 B/rank
	// DTensor [5 4] float64 on (dp=2, tp=3): [S(1) R]
	//   rank 0 [0 0]: [0:5, 0:2] <- this rank
	//   rank 1 [0 1]: [0:5, 0:2]
	//   rank 2 [0 2]: [0:5, 0:2]
	//   rank 3 [1 0]: [0:5, 2:4]
	//   rank 4 [1 1]: [0:5, 2:4]
	//   rank 5 [1 2]: [0:5, 2:4]
}
