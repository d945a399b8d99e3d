package checkpoint_test

import (
	"context"
	"fmt"
	"os"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Save a tensor sharded over 2 ranks, then load it on 3 ranks with
// another placement: each rank reads only the rows it holds.
func Example() {
	root, err := os.MkdirTemp("", "ckpt")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(root)
	ctx := context.Background()
	weights := []float32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}

	// Two ranks, the tensor's columns split between them.
	err = placementtest.Simulate(ctx, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{5, 2}, comm.Float32, []placement.Placement{placement.Shard(1)})
		if err != nil {
			return err
		}
		w, err := placement.FromFull(spec, weights)
		if err != nil {
			return err
		}
		state := checkpoint.State{
			Tensors: map[string]*placement.DTensor{"w": w},
			Entries: map[string]any{"step": int64(100)},
		}
		_, err = checkpoint.Save(ctx, root, state, checkpoint.WithStep(100), checkpoint.WithKeep(3))
		return err
	})
	if err != nil {
		panic(err)
	}

	// Three ranks, rows split 2, 2, 1.
	err = placementtest.Simulate(ctx, []int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		path, err := checkpoint.Latest(root)
		if err != nil {
			return err
		}
		spec, err := placement.NewSpec(m, []int{5, 2}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		state, err := checkpoint.Load(ctx, path, map[string]*placement.Spec{"w": spec})
		if err != nil {
			return err
		}
		for r := range 3 {
			if m.Rank() == r {
				fmt.Printf("rank %d: rows %v, step %d\n", r, state.Tensors["w"].LocalData(), state.Entries["step"])
			}
			if err := comm.Barrier(ctx, m.World()); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		panic(err)
	}
	// Output:
	// rank 0: rows [0 1 2 3], step 100
	// rank 1: rows [4 5 6 7], step 100
	// rank 2: rows [8 9], step 100
}
