package placement_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Six in-process ranks as a 2x3 ("dp", "tp") mesh move a 5x4 tensor from
// Partial(sum) on dp and row-sharded on tp (2, 2 and 1 rows) to
// column-sharded on dp and replicated on tp: a reduce-scatter on dp, then
// an all-gather on tp.
func ExamplePlanner_Redistribute() {
	err := local.Run(context.Background(), 6, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, []int{2, 3}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		src, err := placement.NewSpec(m, []int{5, 4}, comm.Float64,
			[]placement.Placement{placement.Partial(comm.Sum), placement.Shard(0)})
		if err != nil {
			return err
		}
		dst, err := src.With([]placement.Placement{placement.Shard(1), placement.Replicate()})
		if err != nil {
			return err
		}
		full := make([]float64, 5*4) // row-major; dp rank 0 holds it, dp rank 1 zeros
		for i := range full {
			full[i] = float64(i)
		}
		x, err := placement.FromFull(src, full)
		if err != nil {
			return err
		}
		planner := placement.NewPlanner(nil)
		y, err := planner.Redistribute(ctx, x, dst)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			plan, err := planner.Plan(src, dst) // cached by Redistribute
			if err != nil {
				return err
			}
			fmt.Println(plan)
			fmt.Println("rank 0 holds", y.LocalShape(), y.LocalData())
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
	// rank 0 holds [5 2] [0 1 4 5 8 9 12 13 16 17]
}
