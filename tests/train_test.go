package tests

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Test 6: 200 training steps from init.*; the loss at every step of the
// fixture's curve (and at steps 1 and 2) within the §7 tolerances.
func TestParityTraining(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: test 6 trains 200 steps (about 40 s on 2 cores); run without -short")
	}
	ref := loadReference(t)
	cfg, fx := ref.cfg, ref.fx
	// The curve is chaotic after about step 120: its last loss moves by
	// several hundredths with the GEMM's summation order alone (measured:
	// 1.856 on OpenBLAS 0.3.21's Zen kernels, 1.910 on its Prescott
	// kernels, which it picks on CPUs it does not recognise, 1.875 on
	// loom's own GEMM; PyTorch's is 1.857, the tolerance 0.05). So the test
	// pins loom's GEMM, whose order is the same on every machine, and the
	// result does not depend on which BLAS a machine has installed.
	start := time.Now()
	losses := trainLosses(t, ref, []int{1}, []string{"dp"})
	elapsed := time.Since(start)
	t.Logf("%d steps in %v (%.0f tokens/s)", cfg.Steps, elapsed.Round(time.Millisecond), float64(cfg.Steps*cfg.B*cfg.T)/elapsed.Seconds())

	// Steps 1 and 2 are covered tightly by tests 2 and 5; here they are
	// only reported. The curve's steps carry the test-6 tolerances.
	for _, s := range []int{1, 2} {
		want, _ := fx.LossAt(s)
		t.Logf("step %3d: loss %.6f, reference %.6f, Δ %+.2e", s, losses[s-1], want, losses[s-1]-want)
	}
	for i, s := range fx.LossCurveEvery20Steps {
		if s < 1 || s > len(losses) {
			t.Errorf("curve step %d is outside the %d-step run", s, len(losses))
			continue
		}
		got, want := losses[s-1], fx.LossCurveEvery20[i]
		tol := fx.Tolerances.LossCurve(s, cfg.Steps)
		d := got - want
		t.Logf("step %3d: loss %.6f, reference %.6f, Δ %+.2e (tolerance %g)", s, got, want, d, tol)
		if !(math.Abs(d) <= tol) {
			t.Errorf("step %d: loss %.6f, reference %.6f: |Δ| = %.3g > %g", s, got, want, math.Abs(d), tol)
		}
	}
}

// BenchmarkTrainStep measures full training steps (forward, backward,
// AdamW) of the default tiny GPT on a 1-rank mesh from a random init, and
// reports tokens/s (B·T tokens per step). The BLAS is kernels.Default():
// set LOOM_BLAS=go|openblas|blis to choose it.
func BenchmarkTrainStep(b *testing.B) {
	cfg := tinygpt.Default()
	bl, err := kernels.Default()
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("BLAS %s, %s, %d threads", bl.Name(), bl.Config(), bl.Threads())
	err = placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), gpt.WithModel(gpt.WithSeed(1)))
		if err != nil {
			return err
		}
		// One warm-up step allocates the optimizer state.
		if _, _, err := tr.Step(ctx); err != nil {
			return err
		}
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if _, _, err := tr.Step(ctx); err != nil {
				return err
			}
		}
		b.ReportMetric(float64(cfg.B*cfg.T)*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
}

// BenchmarkTrain200 trains the tiny GPT for 200 steps (the reference run's
// length) on one rank from init per iteration, and reports tokens/s, the
// rate of the step's matrix products (tinygpt.Config.TrainFLOPs over the
// whole step time: a lower bound on the GEMM rate) and that rate as a
// percentage of the estimated single-precision peak of the cores GEMM
// may use (the BLAS's thread count, at most the CPU count). The BLAS is
// kernels.Default() (LOOM_BLAS=go|openblas|blis chooses it); its name and
// the peak's derivation are logged.
//
//	go test ./tests -run XXX -bench Train200 -benchtime 1x -count 5
func BenchmarkTrain200(b *testing.B) {
	cfg := tinygpt.Default()
	bl, err := kernels.Default()
	if err != nil {
		b.Fatal(err)
	}
	// The peak of the cores the run computes on: a 1-thread run is held
	// to one core's.
	peak := kernels.EstimatePeak()
	peak.Cores = min(peak.Cores, max(1, bl.Threads()))
	b.Logf("BLAS %s, %s, %d threads; peak %s", bl.Name(), bl.Config(), bl.Threads(), peak)
	init := gpt.RandomInit(gpt.FromReference(cfg), 1)
	var elapsed float64
	for b.Loop() {
		err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), gpt.WithModel(gpt.WithParams(init)), gpt.WithTape(autograd.WithBLAS(bl)))
			if err != nil {
				return err
			}
			start := time.Now()
			for range cfg.Steps {
				if _, _, err := tr.Step(ctx); err != nil {
					return err
				}
			}
			elapsed += time.Since(start).Seconds()
			return nil
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	steps := float64(cfg.Steps * b.N)
	flops := cfg.TrainFLOPs() * steps / elapsed
	b.ReportMetric(float64(cfg.B*cfg.T)*steps/elapsed, "tokens/s")
	b.ReportMetric(flops/1e9, "GFLOP/s")
	b.ReportMetric(100*flops/peak.FLOPS(), "%peak")
}
