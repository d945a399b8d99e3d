package mesh_test

import (
	"context"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
)

// Eight in-process ranks laid out as a 2x4 ("dp","tp") mesh. Every rank
// builds the mesh and asks for its dp and tp communicators in the same order
// (their first use is collective over the world); rank 5 prints its place
// and the members of its groups, found by an AllGather of world ranks.
func Example() {
	err := local.Run(context.Background(), 8, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, []int{2, 4}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		lines := []string{m.String()}
		for _, axis := range m.Names() {
			c, err := m.Comm(ctx, axis)
			if err != nil {
				return err
			}
			members := make([]int64, c.Size())
			if err := comm.AllGather(ctx, c, comm.Host([]int64{int64(m.WorldRank())}), comm.Host(members)); err != nil {
				return err
			}
			lines = append(lines, fmt.Sprintf("%s group: world ranks %v, this rank is member %d", axis, members, c.Rank()))
		}
		tp, err := m.Sub("tp")
		if err != nil {
			return err
		}
		lines = append(lines, "sub-mesh: "+tp.String())
		if m.WorldRank() == 5 {
			for _, l := range lines {
				fmt.Println(l)
			}
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// Mesh(dp=2, tp=4) rank 5 (world 5) at [1 1]
	// dp group: world ranks [1 5], this rank is member 1
	// tp group: world ranks [4 5 6 7], this rank is member 1
	// sub-mesh: Mesh(tp=4) rank 1 (world 5) at [1]
}

// The first program of the README: four in-process ranks as a 2x2
// ("dp","tp") mesh; each rank sums its rank over its tensor-parallel group.
func ExampleMesh_Comm() {
	sums := make([]float32, 4)
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2, 2}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		tp, err := m.Comm(ctx, "tp") // this rank's tensor-parallel group
		if err != nil {
			return err
		}
		x := []float32{float32(c.Rank())}
		if err := comm.AllReduce(ctx, tp, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		sums[c.Rank()] = x[0]
		return nil
	})
	fmt.Println(sums, err)
	// Output: [1 1 5 5] <nil>
}
