// Package tests holds end-to-end checks that span several packages: here,
// PyTorch parity of the tiny GPT (reference/TINY_GPT.md §7,
// tests 1–5) on a 1-rank mesh.
package tests

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// reference is the loaded fixture: the JSON and every tensor of the
// safetensors file.
type reference struct {
	fx     *tinygpt.Fixture
	cfg    tinygpt.Config
	x1, y1 []int64
	init   map[string][]float32 // by parameter name
	grad1  map[string][]float32
	after1 map[string][]float32
}

// loadReference loads the embedded fixture; a missing or damaged one fails
// the test.
func loadReference(t *testing.T) *reference {
	t.Helper()
	fx, err := tinygpt.LoadFixture()
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	f, err := fx.Tensors()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ref := &reference{fx: fx, cfg: cfg}
	for prefix, dst := range map[string]*map[string][]float32{tinygpt.PrefixInit: &ref.init, tinygpt.PrefixGrad1: &ref.grad1, tinygpt.PrefixAfter1: &ref.after1} {
		if *dst, err = fx.Params(prefix); err != nil {
			t.Fatal(err)
		}
	}
	ints := func(name string) []int64 {
		tn, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		v, err := tn.Int64s()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	ref.x1, ref.y1 = ints(tinygpt.TensorX1), ints(tinygpt.TensorY1)
	return ref
}

// relL2 returns ‖got − want‖₂ / ‖want‖₂ in float64.
func relL2(got, want []float32) float64 {
	var d, n float64
	for i := range want {
		e := float64(got[i]) - float64(want[i])
		d += e * e
		n += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(d) / math.Sqrt(n)
}

// maxAbs returns max |got − want|.
func maxAbs(got, want []float32) float64 {
	m := 0.0
	for i := range want {
		m = max(m, math.Abs(float64(got[i])-float64(want[i])))
	}
	return m
}

// Test 1: the corpus and batches 1 and 2 regenerate exactly.
func TestParityData(t *testing.T) {
	ref := loadReference(t)
	corpus := tinygpt.Corpus(ref.cfg)
	if got := tinygpt.CorpusSHA256(corpus); got != ref.fx.CorpusSHA256 {
		t.Fatalf("corpus SHA-256 %s, want %s", got, ref.fx.CorpusSHA256)
	}
	b1, err := tinygpt.BatchAt(ref.cfg, corpus, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b1.X, ref.x1) || !slices.Equal(b1.Y, ref.y1) {
		t.Error("batch 1 differs from the fixture's x1/y1")
	}
	if !slices.Equal(b1.Offsets, ref.fx.Batch1Offsets) {
		t.Errorf("batch-1 offsets %v, want %v", b1.Offsets, ref.fx.Batch1Offsets)
	}
	b2, err := tinygpt.BatchAt(ref.cfg, corpus, 2)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b2.Offsets, ref.fx.Batch2Offsets) {
		t.Errorf("batch-2 offsets %v, want %v", b2.Offsets, ref.fx.Batch2Offsets)
	}
}

// Test 4: one AdamW step from init.* with grad1.* reproduces after1.*
// (bit for bit with the §4 recipe; the tolerance is 1e-6).
func TestParityAdamWOnFixtureGradients(t *testing.T) {
	ref := loadReference(t)
	cfg := ref.cfg
	c := optim.Coefficients(cfg.LR, cfg.WD, cfg.Beta1, cfg.Beta2, cfg.Eps, 1)
	tol := ref.fx.Tolerances.After1MaxAbsGivenFixtureGrads
	worst, differ := 0.0, 0
	for _, p := range cfg.Params() {
		pv := slices.Clone(ref.init[p.Name])
		m, v := make([]float32, len(pv)), make([]float32, len(pv))
		if err := optim.Update(c, pv, ref.grad1[p.Name], m, v); err != nil {
			t.Fatal(err)
		}
		d := maxAbs(pv, ref.after1[p.Name])
		worst = max(worst, d)
		for i, x := range pv {
			if math.Float32bits(x) != math.Float32bits(ref.after1[p.Name][i]) {
				differ++
			}
		}
		if d > tol {
			t.Errorf("%s: max |p − after1| = %.3g > %g", p.Name, d, tol)
		}
	}
	t.Logf("AdamW on grad1.*: max |p − after1| = %.3g over all parameters; %d of %d elements not bit-identical", worst, differ, cfg.NumParams())
}

// stepResult is what one training step on the 1-rank mesh produced.
type stepResult struct {
	loss1     float64
	grads     map[string][]float32
	after     map[string][]float32
	loss2     float64
	fwdBwd    time.Duration // forward + backward of step 1
	fwd2      time.Duration // forward of step 2
	optimizer time.Duration
}

// runStep loads init.* into a Model on a 1-rank mesh, runs forward and
// backward on batch 1, one AdamW step with its own gradients, and the
// forward pass of batch 2.
func runStep(ref *reference) (*stepResult, error) {
	cfg := ref.cfg
	corpus := tinygpt.Corpus(cfg)
	b1, err := tinygpt.BatchAt(cfg, corpus, 1)
	if err != nil {
		return nil, err
	}
	b2, err := tinygpt.BatchAt(cfg, corpus, 2)
	if err != nil {
		return nil, err
	}
	res := &stepResult{grads: map[string][]float32{}, after: map[string][]float32{}}
	err = placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, gpt.FromReference(cfg), gpt.WithParams(ref.init))
		if err != nil {
			return err
		}
		x, y, err := md.Inputs(b1, nil)
		if err != nil {
			return err
		}
		start := time.Now()
		loss, err := md.Forward(ctx, tape, x, y)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		res.fwdBwd = time.Since(start)
		if res.loss1, err = gpt.Loss(loss); err != nil {
			return err
		}
		for _, p := range md.Params() {
			g := p.Grad()
			if g == nil {
				return fmt.Errorf("%s has no gradient", p.Name())
			}
			gd, ok := g.LocalData().([]float32)
			if !ok {
				return fmt.Errorf("%s: gradient block %T", p.Name(), g.LocalData())
			}
			res.grads[p.Name()] = slices.Clone(gd)
		}
		opt, err := optim.NewAdamW(md.Params(), optim.WithLR(cfg.LR), optim.WithWeightDecay(cfg.WD), optim.WithBetas(cfg.Beta1, cfg.Beta2), optim.WithEps(cfg.Eps))
		if err != nil {
			return err
		}
		start = time.Now()
		if err := opt.Step(); err != nil {
			return err
		}
		res.optimizer = time.Since(start)
		md.ZeroGrad()
		for _, p := range md.Params() {
			res.after[p.Name()] = slices.Clone(p.Data().LocalData().([]float32))
		}
		x2, y2, err := md.Inputs(b2, nil)
		if err != nil {
			return err
		}
		start = time.Now()
		err = tape.NoGrad(func() error {
			l2, err := md.Forward(ctx, tape, x2, y2)
			if err != nil {
				return err
			}
			res.loss2, err = gpt.Loss(l2)
			return err
		})
		res.fwd2 = time.Since(start)
		return err
	})
	return res, err
}

// Tests 2, 3 and 5: the step-1 loss and gradients at init.*, then one
// AdamW step with those gradients and the step-2 loss.
func TestParityModel(t *testing.T) {
	ref := loadReference(t)
	cfg, tol := ref.cfg, ref.fx.Tolerances
	res, err := runStep(ref)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("step 1 forward+backward %v, AdamW step %v, step-2 forward (no grad) %v", res.fwdBwd, res.optimizer, res.fwd2)

	t.Run("2_forward", func(t *testing.T) {
		rel := math.Abs(res.loss1-ref.fx.LossStep1) / ref.fx.LossStep1
		t.Logf("step-1 loss %.9f, reference %.9f, relative error %.3g (tolerance %g)", res.loss1, ref.fx.LossStep1, rel, tol.LossStep1Rel)
		if rel > tol.LossStep1Rel {
			t.Errorf("step-1 loss %.9f, want %.9f within %g relative (got %.3g)", res.loss1, ref.fx.LossStep1, tol.LossStep1Rel, rel)
		}
	})

	t.Run("3_backward", func(t *testing.T) {
		worst, worstName := 0.0, ""
		for _, p := range cfg.Params() {
			rel := relL2(res.grads[p.Name], ref.grad1[p.Name])
			if rel > worst {
				worst, worstName = rel, p.Name
			}
			if rel > tol.GradRelL2PerParam {
				t.Errorf("%s: ‖g − grad1‖/‖grad1‖ = %.3g > %g", p.Name, rel, tol.GradRelL2PerParam)
			}
		}
		t.Logf("worst per-parameter relative gradient error %.3g (%s; tolerance %g)", worst, worstName, tol.GradRelL2PerParam)
		// Rows of wte for bytes absent from batch 1 get exactly 0.
		used := map[int64]bool{}
		for _, id := range ref.x1 {
			used[id] = true
		}
		g, D := res.grads[tinygpt.ParamWTE], cfg.D
		unused := 0
		for r := range cfg.V {
			if used[int64(r)] {
				continue
			}
			unused++
			for _, e := range g[r*D : (r+1)*D] {
				if e != 0 {
					t.Errorf("wte row %d (byte absent from batch 1) has gradient %g, want exactly 0", r, e)
					break
				}
			}
		}
		if unused != 220 && cfg == tinygpt.Default() {
			t.Errorf("%d unused wte rows in batch 1, the spec says 220", unused)
		}
		t.Logf("%d unused wte rows, all gradients exactly 0", unused)
	})

	t.Run("5_full_step", func(t *testing.T) {
		worst := 0.0
		for _, p := range cfg.Params() {
			d := maxAbs(res.after[p.Name], ref.after1[p.Name])
			worst = max(worst, d)
			if d > tol.After1MaxAbsEndToEnd {
				t.Errorf("%s: max |p − after1| = %.3g > %g", p.Name, d, tol.After1MaxAbsEndToEnd)
			}
		}
		rel := math.Abs(res.loss2-ref.fx.LossStep2) / ref.fx.LossStep2
		t.Logf("own gradients: max |p − after1| = %.3g (tolerance %g); step-2 loss %.9f, reference %.9f, relative error %.3g (tolerance %g)",
			worst, tol.After1MaxAbsEndToEnd, res.loss2, ref.fx.LossStep2, rel, tol.LossStep2Rel)
		if rel > tol.LossStep2Rel {
			t.Errorf("step-2 loss %.9f, want %.9f within %g relative (got %.3g)", res.loss2, ref.fx.LossStep2, tol.LossStep2Rel, rel)
		}
	})
}
