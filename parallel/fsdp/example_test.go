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

// Drive FSDP as a pipeline stage does: gradient sync and
// reshard-after-backward off, the units gathered once before two
// micro-batches whose forwards run before either backward (each in its
// own autograd.Graph), and one Finish that reduce-scatters their summed
// gradients: one all-gather and one reduce-scatter per unit for the step.
func ExampleFSDP_SetRequiresGradientSync() {
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
		f, err := fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"}, fsdp.WithReshard(false))
		if err != nil {
			return err
		}
		f.SetRequiresGradientSync(false)
		f.SetReshardAfterBackward(false)
		h, err := f.UnshardAsync(ctx) // a schedule's UNSHARD
		if err != nil {
			return err
		}
		if err := h.Wait(ctx); err != nil { // before the first compute
			return err
		}
		spec, err := placement.NewSpec(m, []int{2, 4}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		var losses [2]*autograd.Value
		var graphs [2]*autograd.Graph
		for mb := range 2 { // both forwards first, as GPipe runs them
			xd, err := placement.FromFull(spec, slices.Repeat([]float32{0.1 * float32(mb+1), 0.2, 0.3, 0.4}, 2))
			if err != nil {
				return err
			}
			if graphs[mb], err = tape.NewGraph(); err != nil {
				return err
			}
			err = graphs[mb].Do(func() error {
				x, err := tape.Constant(xd)
				if err != nil {
					return err
				}
				y, err := mlp.Forward(ctx, x)
				if err != nil {
					return err
				}
				losses[mb], err = autograd.Sum(y)
				return err
			})
			if err != nil {
				return err
			}
		}
		for mb := range 2 {
			err := graphs[mb].Do(func() error { return tape.BackwardFrom(ctx, []*autograd.Value{losses[mb]}, nil) })
			if err != nil {
				return err
			}
		}
		if err := f.Finish(ctx); err != nil { // REDUCE_GRAD
			return err
		}
		if err := f.Reshard(ctx); err != nil { // RESHARD
			return err
		}
		if m.Rank() == 0 {
			var chunks int64
			for _, u := range f.Units() {
				chunks += 4 * int64(u.Chunk)
			}
			tr := f.Traffic()
			fmt.Println("all-gathers per unit:", tr.AllGather/chunks, "reduce-scatters per unit:", tr.ReduceScatter/chunks)
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// all-gathers per unit: 1 reduce-scatters per unit: 1
}
