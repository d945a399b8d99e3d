package tests

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/internal/gpt"
	"github.com/b7ea7098/loom/internal/tinygpt"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// trainer runs training steps of the tiny GPT on a 1-rank mesh: forward and
// backward on the sampler's next batch, one AdamW step, gradients dropped.
// The sampler's stream and the optimizer's moments carry across steps.
type trainer struct {
	tape    *autograd.Tape
	md      *gpt.Model
	opt     *optim.AdamW
	sampler *tinygpt.Sampler
}

func newTrainer(m *mesh.Mesh, cfg tinygpt.Config, init map[string][]float32) (*trainer, error) {
	tape := autograd.NewTape()
	md, err := gpt.New(tape, m, cfg, init)
	if err != nil {
		return nil, err
	}
	opt, err := optim.NewAdamW(md.Params(), cfg.LR, cfg.WD, cfg.Beta1, cfg.Beta2, cfg.Eps)
	if err != nil {
		return nil, err
	}
	sampler, err := tinygpt.NewSampler(cfg, tinygpt.Corpus(cfg))
	if err != nil {
		return nil, err
	}
	return &trainer{tape: tape, md: md, opt: opt, sampler: sampler}, nil
}

// step runs one training step and returns its loss (the loss of the batch
// before the update) and the batch's step number.
func (tr *trainer) step(ctx context.Context) (step int, loss float64, err error) {
	b := tr.sampler.Next()
	x, y, err := tr.md.Inputs(b, nil)
	if err != nil {
		return b.Step, 0, err
	}
	l, err := tr.md.Forward(tr.tape, x, y)
	if err != nil {
		return b.Step, 0, err
	}
	if loss, err = gpt.Loss(l); err != nil {
		return b.Step, 0, err
	}
	if err := tr.tape.Backward(ctx, l); err != nil {
		return b.Step, loss, err
	}
	if err := tr.opt.Step(); err != nil {
		return b.Step, loss, err
	}
	tr.md.ZeroGrad()
	return b.Step, loss, nil
}

// Test 6: 200 training steps from init.*; the loss at every step of the
// fixture's curve (and at steps 1 and 2) within the §7 tolerances.
func TestParityTraining(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: test 6 trains 200 steps (about 40 s on 2 cores); run without -short")
	}
	ref := loadReference(t)
	cfg, fx := ref.cfg, ref.fx
	losses := make([]float64, 0, cfg.Steps)
	start := time.Now()
	err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := newTrainer(m, cfg, ref.init)
		if err != nil {
			return err
		}
		for range cfg.Steps {
			step, loss, err := tr.step(ctx)
			if err != nil {
				return fmt.Errorf("step %d: %w", step, err)
			}
			if math.IsNaN(loss) || math.IsInf(loss, 0) {
				return fmt.Errorf("step %d: loss %v", step, loss)
			}
			losses = append(losses, loss)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
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
		tr, err := newTrainer(m, cfg, gpt.RandomInit(cfg, 1))
		if err != nil {
			return err
		}
		// One warm-up step allocates the optimizer state.
		if _, _, err := tr.step(ctx); err != nil {
			return err
		}
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if _, _, err := tr.step(ctx); err != nil {
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
