package tests

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/gpt"
	"github.com/b7ea7098/loom/internal/tinygpt"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

func BenchmarkZZPair(b *testing.B) {
	for _, pair := range []int{1, 2} {
		b.Run(map[int]string{1: "alone", 2: "pair"}[pair], func(b *testing.B) {
			cfg := tinygpt.Default()
			cfg.B /= 2
			init := gpt.RandomInit(cfg, 1)
			bl, _ := kernels.Load(kernels.WithThreads(1))
			var wg sync.WaitGroup
			meds := make([]time.Duration, pair)
			for p := range pair {
				wg.Add(1)
				go func() {
					defer wg.Done()
					placementtest.Simulate(context.Background(), []int{1, 1}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
						tr, err := gpt.NewTrainer(ctx, m, cfg, init, gpt.TrainOptions{DP: "dp", TP: "tp", Tape: []autograd.Option{autograd.WithBLAS(bl)}})
						if err != nil {
							b.Error(err)
							return err
						}
						var steps []time.Duration
						for i := range b.N + 2 {
							t0 := time.Now()
							tr.Step(ctx)
							if i >= 2 {
								steps = append(steps, time.Since(t0))
							}
						}
						slices.Sort(steps)
						meds[p] = steps[len(steps)/2]
						return nil
					})
				}()
			}
			wg.Wait()
			b.ReportMetric(float64(cfg.B*cfg.T)/meds[0].Seconds(), "tok/s/rank")
		})
	}
}
