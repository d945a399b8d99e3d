package placement_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// BenchmarkRedistributeConsistency times the Redistribute of a small
// tensor (a [16 16] float32 Shard(0) -> Replicate all-gather) on a 1-D
// mesh of p ranks, with and without WithCheckConsistency, to price the check:
// the difference is its one all-gather of 16 bytes per rank. Plans come
// from a cache in both, so only the check differs.
//
//	go test ./placement -run XXX -bench RedistributeConsistency
func BenchmarkRedistributeConsistency(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, check := range []bool{false, true} {
			b.Run(fmt.Sprintf("p=%d/check=%v", p, check), func(b *testing.B) {
				var opts []placement.PlannerOption
				if check {
					opts = append(opts, placement.WithCheckConsistency())
				}
				planner := placement.NewPlanner(nil, opts...)
				wd, err := local.NewWorld(p, local.WithCostModel(comm.BuiltinCostModel()))
				if err != nil {
					b.Fatal(err)
				}
				ctx := context.Background()
				ts := make([]*placement.DTensor, p)
				dsts := make([]*placement.Spec, p)
				errs := make([]error, p)
				// phase runs fn on every rank and waits for all of them.
				phase := func(fn func(r int) error) {
					var wg sync.WaitGroup
					for r := range p {
						wg.Go(func() {
							if err := fn(r); err != nil && errs[r] == nil {
								errs[r] = fmt.Errorf("rank %d: %w", r, err)
							}
						})
					}
					wg.Wait()
					if err := errors.Join(errs...); err != nil {
						b.Fatal(err)
					}
				}
				// Build the tensors and run once, so that the mesh's
				// communicator and the plan exist before timing.
				phase(func(r int) error {
					m, err := mesh.New(wd.Comm(r), []int{p}, []string{"x"})
					if err != nil {
						return err
					}
					src, err := placement.NewSpec(m, []int{16, 16}, comm.Float32, []placement.Placement{placement.Shard(0)})
					if err != nil {
						return err
					}
					if dsts[r], err = src.With([]placement.Placement{placement.Replicate()}); err != nil {
						return err
					}
					if ts[r], err = placement.FromFull(src, make([]float32, 16*16)); err != nil {
						return err
					}
					_, err = planner.Redistribute(ctx, ts[r], dsts[r])
					return err
				})
				b.ResetTimer()
				phase(func(r int) error {
					for range b.N {
						if _, err := planner.Redistribute(ctx, ts[r], dsts[r]); err != nil {
							return err
						}
					}
					return nil
				})
			})
		}
	}
}
