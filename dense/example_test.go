package dense_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/dense"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"gorgonia.org/tensor"
)

// A gorgonia tensor that every rank holds is row-sharded over two ranks
// and gathered back.
func ExampleToDTensor() {
	err := local.Run(context.Background(), 2, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, []int{2}, []string{"dp"})
		if err != nil {
			return err
		}
		spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		w := tensor.New(tensor.WithShape(3, 2), tensor.WithBacking([]float64{1, 2, 3, 4, 5, 6}))
		dt, err := dense.ToDTensor(spec, w)
		if err != nil {
			return err
		}
		back, err := dense.FromDTensor(ctx, dt)
		if err != nil {
			return err
		}
		if m.Rank() == 1 {
			fmt.Println("rank 1 holds", dt.LocalShape(), dt.LocalData())
			fmt.Println("gathered", back.Shape(), back.Data())
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// rank 1 holds [1 2] [5 6]
	// gathered (3, 2) [1 2 3 4 5 6]
}
