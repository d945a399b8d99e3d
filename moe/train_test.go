package moe_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// trainResult is what a training run leaves: the loss of every step and
// the final parameters (Wr, W1, b1, W2, b2), gathered.
type trainResult struct {
	losses []float64
	params [][]float64
}

// trainMoE trains the fixture's MoE layer (dropless, the router of
// reference/MOE_LAYER.md) for steps SGD steps on mesh mc: step s uses the fixture's
// tokens and target G rolled by 8·s rows (a new batch each step) and the
// loss (1/N)·Σ (y − G)² + α·aux + β·zloss. Gradients that are Partial on the
// token-sharding axes are all-reduced before the update, as data
// parallelism would. The tape recycles each step's results, poisoned, so
// that a read of a result after its step would show as NaN.
func trainMoE(t *testing.T, fx *epFixture, mc epMesh, steps int, lr float64) trainResult {
	t.Helper()
	var res trainResult
	placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape(autograd.WithPoisonRecycled())
		tok := mc.tokenPlaces()
		wr, err := epValue(tape, m, "Wr", []int{fx.e, fx.d}, replicated(m), fx.wr, true)
		if err != nil {
			return err
		}
		router, err := moe.NewRouter(wr, moe.RouterConfig{K: fx.k, Renormalize: true, AuxCoef: fx.alpha, ZCoef: fx.beta})
		if err != nil {
			return err
		}
		experts, err := float32Experts(tape, m, fx)
		if err != nil {
			return err
		}
		layer := &moe.Layer{Router: router, Experts: experts}
		params := layer.OwnParams()
		opt, err := optim.NewSGD(params, lr)
		if err != nil {
			return err
		}
		roll := func(v []float32, rows, by int) []float32 {
			w := len(v) / rows
			by %= rows
			return append(slices.Clone(v[by*w:]), v[:by*w]...)
		}
		var losses []float64
		for s := range steps {
			tape.Recycle()
			x, err := epValue(tape, m, "x", []int{fx.n, fx.d}, tok, roll(fx.x, fx.n, 8*s), false)
			if err != nil {
				return err
			}
			g, err := epValue(tape, m, "G", []int{fx.n, fx.d}, tok, roll(fx.g, fx.n, 8*s), false)
			if err != nil {
				return err
			}
			out, err := layer.Forward(ctx, x)
			if err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			// (1/N)·Σ (y − G)²: a bounded regression objective.
			neg, err := autograd.Scale(g, -1)
			if err != nil {
				return err
			}
			diff, err := autograd.Add(out.Y, neg)
			if err != nil {
				return err
			}
			sq, err := autograd.Mul(diff, diff)
			if err != nil {
				return err
			}
			sum, err := autograd.Sum(sq)
			if err != nil {
				return err
			}
			task, err := autograd.Scale(sum, 1/float64(fx.n))
			if err != nil {
				return err
			}
			loss, err := out.AddLosses(task)
			if err != nil {
				return err
			}
			lv, err := epFull(ctx, loss.Data())
			if err != nil {
				return err
			}
			losses = append(losses, lv[0])
			for _, p := range params {
				p.ZeroGrad()
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			for _, p := range params {
				gs, err := placement.GradSpec(p.Grad().Spec())
				if err != nil {
					return err
				}
				red, err := placement.Redistribute(ctx, p.Grad(), gs)
				if err != nil {
					return err
				}
				if err := p.SetGrad(red); err != nil {
					return err
				}
			}
			if err := opt.Step(); err != nil {
				return err
			}
		}
		final := make([][]float64, len(params))
		for i, p := range params {
			if final[i], err = epFull(ctx, p.Data()); err != nil {
				return err
			}
		}
		if m.Rank() == 0 {
			res = trainResult{losses: losses, params: final}
		}
		return nil
	})
	return res
}

// TestEPTrainingMatchesSerial: dropless expert-parallel training equals
// one-rank MoE training over 20 SGD steps, loss by loss and parameter by
// parameter.
//
// Tolerance: 1e-5 relative on every loss and relative L2 on every final
// parameter. The runs route every token identically and compute the same
// float32 formulas; they differ only in rounding: the router weight's
// gradient is summed over ranks in another order, and each GEMM sees
// another number of rows (another blocking). Such differences are about
// float32's epsilon (6e-8) per operation and grow slowly over the steps
// (measured: at most 1.4e-6 after 20 steps, on ep = 4, 8 and dp = 2 ×
// ep = 4), so 1e-5 leaves a margin of about 7, while a wrong gradient, a
// lost or doubled token, or a different routing moves the loss or the
// weights by 1e-3 or more within a step or two.
func TestEPTrainingMatchesSerial(t *testing.T) {
	if testing.Short() {
		t.Skip("20 training steps on simulated meshes")
	}
	fx := epLoadFixture(t)
	const steps, lr, tol = 20, 0.01, 1e-5
	serial := trainMoE(t, fx, epMesh{"ep=1", []int{1}, []string{"ep"}}, steps, lr)
	if len(serial.losses) != steps {
		t.Fatalf("serial run: %d losses", len(serial.losses))
	}
	t.Logf("serial losses: %.6g", serial.losses)
	if d := serial.losses[0] - serial.losses[steps-1]; d < 0.05*serial.losses[0] {
		t.Errorf("the loss barely moved over %d steps (%v -> %v): the test would not see training", steps, serial.losses[0], serial.losses[steps-1])
	}
	names := []string{"Wr", "W1", "b1", "W2", "b2"}
	for _, mc := range []epMesh{{"ep=4", []int{4}, []string{"ep"}}, {"ep=8", []int{8}, []string{"ep"}}, {"dp=2,ep=4", []int{2, 4}, []string{"dp", "ep"}}} {
		t.Run(mc.name, func(t *testing.T) {
			got := trainMoE(t, fx, mc, steps, lr)
			if len(got.losses) != steps {
				t.Fatalf("%d losses", len(got.losses))
			}
			worst := 0.0
			for s := range steps {
				e := math.Abs(got.losses[s]-serial.losses[s]) / math.Abs(serial.losses[s])
				worst = max(worst, e)
				if e > tol {
					t.Errorf("step %d: loss %v, serial %v (relative error %.3g > %g)", s, got.losses[s], serial.losses[s], e, tol)
				}
			}
			for i, p := range got.params {
				e := relL2(p, serial.params[i])
				worst = max(worst, e)
				if e > tol {
					t.Errorf("final %s: relative L2 error %.3g > %g", names[i], e, tol)
				}
			}
			t.Logf("largest relative difference from the serial run over %d steps: %.3g", steps, worst)
		})
	}
}
