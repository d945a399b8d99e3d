package tests

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// warmupSteps are the steps a benchmark runs before it times any: the
// first allocates the optimizer state and the buffers a step reuses.
const warmupSteps = 2

// medianStepRate runs warmupSteps+n steps (step(i) is step i) and returns
// the tokens per second of the median timed step, tokens being one step's.
func medianStepRate(n, tokens int, step func(i int) error) (float64, error) {
	times := make([]time.Duration, 0, n)
	for i := range warmupSteps + n {
		t0 := time.Now()
		if err := step(i); err != nil {
			return 0, err
		}
		if i >= warmupSteps {
			times = append(times, time.Since(t0))
		}
	}
	slices.Sort(times)
	return float64(tokens) / times[len(times)/2].Seconds(), nil
}

// trainLosses trains the reference's tiny GPT from its initial parameters
// for its steps on a simulated mesh of shape and names, on loom's own GEMM
// (whose summation order is the same on every machine), and returns rank
// 0's loss at every step; a loss that is not finite is an error.
func trainLosses(t *testing.T, ref *reference, shape []int, names []string, opts ...gpt.TrainOption) []float64 {
	t.Helper()
	cfg := ref.cfg
	bl, err := kernels.Load(kernels.WithLibrary("go"), kernels.WithThreads(1))
	if err != nil {
		t.Fatal(err)
	}
	losses := make([]float64, 0, cfg.Steps)
	err = placementtest.Simulate(context.Background(), shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		all := append([]gpt.TrainOption{gpt.WithRun(cfg), gpt.WithModel(gpt.WithParams(ref.init)), gpt.WithTape(autograd.WithBLAS(bl))}, opts...)
		tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), all...)
		if err != nil {
			return err
		}
		for range cfg.Steps {
			step, loss, err := tr.Step(ctx)
			if err != nil {
				return fmt.Errorf("step %d: %w", step, err)
			}
			if math.IsNaN(loss) || math.IsInf(loss, 0) {
				return fmt.Errorf("step %d: loss %v", step, loss)
			}
			if m.Rank() == 0 {
				losses = append(losses, loss)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return losses
}
