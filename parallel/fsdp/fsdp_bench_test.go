package fsdp

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
)

// BenchmarkFSDPStep times one training step (forward, backward, gradient
// reduction, AdamW) of a float32 residual MLP net (width 128, hidden 512,
// 4 blocks, 64 rows) on two in-process ranks: FSDP (fsdp=2, ZeRO-3,
// prefetch) against DDP (dp=2).
func BenchmarkFSDPStep(b *testing.B) {
	const d, h, v, blocks, rows = 128, 512, 16, 4, 64
	for _, mode := range []string{"fsdp2", "ddp2"} {
		b.Run(mode, func(b *testing.B) {
			axis := "fsdp"
			if mode == "ddp2" {
				axis = "dp"
			}
			err := local.Run(context.Background(), 2, func(ctx context.Context, world comm.Communicator) error {
				m, err := mesh.New(world, []int{2}, []string{axis})
				if err != nil {
					return err
				}
				n, err := newFnetSized(m, comm.Float32, d, h, v, blocks, autograd.WithRecycling())
				if err != nil {
					return err
				}
				var f *FSDP
				var dp *ddp.DDP
				params, err := parallel.Params(n)
				if err != nil {
					return err
				}
				if mode == "fsdp2" {
					if f, err = FullyShard(ctx, n, []string{"h.*"}); err != nil {
						return err
					}
					params = f.Params()
				} else {
					params = params[:len(params)-2] // the spare Linear is never used
					if dp, err = ddp.New(ctx, params); err != nil {
						return err
					}
				}
				opt, err := optim.NewAdamW(params, optim.WithAllowFrozen()) // FSDP's list holds the unused spare
				if err != nil {
					return err
				}
				step := func() error {
					n.tape.Recycle()
					for _, p := range params {
						p.ZeroGrad()
					}
					l, err := n.forward(ctx, m, 1, rows)
					if err != nil {
						return err
					}
					if err := n.tape.Backward(ctx, l); err != nil {
						return err
					}
					if f != nil {
						err = f.Finish(ctx)
					} else {
						err = dp.Finish(ctx)
					}
					if err != nil {
						return err
					}
					return opt.Step()
				}
				if err := step(); err != nil {
					return err
				}
				if err := comm.Barrier(ctx, world); err != nil {
					return err
				}
				if world.Rank() == 0 {
					b.ResetTimer()
				}
				for range b.N {
					if err := step(); err != nil {
						return err
					}
				}
				return nil
			})
			if err != nil {
				b.Fatal(err)
			}
		})
	}
}
