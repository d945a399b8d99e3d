package checkpoint_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

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

// Save in the background while training goes on: Save returns once the
// state is copied to host memory, so the next step may update it; the
// next Save (or Close) waits for the files.
func ExampleSaver() {
	root, err := os.MkdirTemp("", "ckpt")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(root)
	err = placementtest.Simulate(context.Background(), []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		w, err := placement.FromFull(spec, []float32{1, 2, 3, 4})
		if err != nil {
			return err
		}
		saver, err := checkpoint.NewSaver(root, checkpoint.WithKeep(2), checkpoint.WithMemoryLimit(64<<20))
		if err != nil {
			return err
		}
		for step := 1; step <= 3; step++ {
			for i := range w.LocalData().([]float32) {
				w.LocalData().([]float32)[i] *= 2 // a training step
			}
			state := checkpoint.State{Tensors: map[string]*placement.DTensor{"w": w}}
			save, err := saver.Save(ctx, state, checkpoint.WithStep(step))
			if err != nil {
				return err // the previous save's error, or this one's
			}
			_ = save.Blocked() // the time the step was held, save.PeakBytes() the memory
		}
		return saver.Close() // waits for the last save
	})
	if err != nil {
		panic(err)
	}
	path, err := checkpoint.Latest(root)
	if err != nil {
		panic(err)
	}
	fmt.Println(filepath.Base(path))
	// Output:
	// step-0000000003
}

// Export a model sharded over 2 ranks as one safetensors file, which
// PyTorch and numpy read, and import it on 3 ranks.
func ExampleExport() {
	dir, err := os.MkdirTemp("", "export")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "model.safetensors")
	ctx := context.Background()
	err = placementtest.Simulate(ctx, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float32, []placement.Placement{placement.Shard(1)})
		if err != nil {
			return err
		}
		w, err := placement.FromFull(spec, []float32{0, 1, 2, 3, 4, 5})
		if err != nil {
			return err
		}
		return checkpoint.Export(ctx, path, checkpoint.State{Tensors: map[string]*placement.DTensor{"lm_head.weight": w}})
	})
	if err != nil {
		panic(err)
	}
	err = placementtest.Simulate(ctx, []int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		state, err := checkpoint.Import(ctx, path, map[string]*placement.Spec{"lm_head.weight": spec})
		if err != nil {
			return err
		}
		for r := range 3 {
			if m.Rank() == r {
				fmt.Printf("rank %d: %v\n", r, state.Tensors["lm_head.weight"].LocalData())
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
	// rank 0: [0 1]
	// rank 1: [2 3]
	// rank 2: [4 5]
}
