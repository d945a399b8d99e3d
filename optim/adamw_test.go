package optim_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// adamRef is PyTorch's AdamW in float64 for one scalar over several steps.
func adamRef(p float64, gs []float64, lr, wd, b1, b2, eps float64) float64 {
	m, v := 0.0, 0.0
	for i, g := range gs {
		t := float64(i + 1)
		p *= 1 - lr*wd
		m = b1*m + (1-b1)*g
		v = b2*v + (1-b2)*g*g
		p -= lr / (1 - math.Pow(b1, t)) * m / (math.Sqrt(v)/math.Sqrt(1-math.Pow(b2, t)) + eps)
	}
	return p
}

func TestUpdateMatchesFloat64Reference(t *testing.T) {
	const lr, wd, b1, b2, eps = 3e-3, 0.01, 0.9, 0.999, 1e-8
	ps := []float64{0.5, -1.25, 0.75, 2}
	gs := [][]float64{{0.1, -0.2, 0.3}, {-1, -1, 2}, {0, 0, 0}, {1e-3, 5, -1e-4}}
	p32, m32, v32 := make([]float32, len(ps)), make([]float32, len(ps)), make([]float32, len(ps))
	p64, m64, v64 := make([]float64, len(ps)), make([]float64, len(ps)), make([]float64, len(ps))
	for i, p := range ps {
		p32[i], p64[i] = float32(p), p
	}
	for step := range 3 {
		c := optim.Coefficients(lr, wd, b1, b2, eps, step+1)
		g32, g64 := make([]float32, len(ps)), make([]float64, len(ps))
		for i := range ps {
			g32[i], g64[i] = float32(gs[i][step]), gs[i][step]
		}
		if err := optim.Update(c, p32, g32, m32, v32); err != nil {
			t.Fatal(err)
		}
		if err := optim.Update(c, p64, g64, m64, v64); err != nil {
			t.Fatal(err)
		}
	}
	for i, p := range ps {
		want := adamRef(p, gs[i], lr, wd, b1, b2, eps)
		if d := math.Abs(p64[i] - want); d > 1e-12 {
			t.Errorf("float64 element %d: %v, want %v", i, p64[i], want)
		}
		if d := math.Abs(float64(p32[i]) - want); d > 1e-6 {
			t.Errorf("float32 element %d: %v, want %v", i, p32[i], want)
		}
	}
	// Where g is always 0 only the decay applies.
	if want := 0.75 * math.Pow(1-lr*wd, 3); math.Abs(float64(p32[2])-want) > 1e-7 {
		t.Errorf("decay only: %v, want %v", p32[2], want)
	}
}

func param(t *testing.T, tape *autograd.Tape, m *mesh.Mesh, name string, places []placement.Placement, data []float32) *autograd.Value {
	t.Helper()
	spec, err := placement.NewSpec(m, []int{len(data)}, comm.Float32, places)
	if err != nil {
		t.Fatal(err)
	}
	dt, err := placement.NewLocal(spec, data)
	if err != nil {
		t.Fatal(err)
	}
	v, err := tape.Param(name, dt)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestStepSkipsParamsWithoutGradient(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		rep := []placement.Placement{placement.Replicate()}
		a := param(t, tape, m, "a", rep, []float32{1, 2})
		b := param(t, tape, m, "b", rep, []float32{3, 4})
		opt, err := optim.NewAdamW([]*autograd.Value{a, b}, optim.WithLR(0.1), optim.WithWeightDecay(0.01), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8), optim.WithAllowFrozen())
		if err != nil {
			return err
		}
		loss, err := autograd.Sum(a)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if err := opt.Step(); err != nil {
			return err
		}
		if opt.StepCount(0) != 1 || opt.StepCount(1) != 0 {
			t.Errorf("step counts %d, %d; want 1, 0", opt.StepCount(0), opt.StepCount(1))
		}
		// Two float32 moments for a's two elements; b has no state yet.
		if got := opt.StateBytes(); got != 2*2*4 {
			t.Errorf("StateBytes = %d, want 16", got)
		}
		got := a.Data().LocalData().([]float32)
		for i, p0 := range []float64{1, 2} {
			if want := adamRef(p0, []float64{1}, 0.1, 0.01, 0.9, 0.999, 1e-8); math.Abs(float64(got[i])-want) > 1e-6 {
				t.Errorf("a[%d] = %v, want %v", i, got[i], want)
			}
		}
		if bd := b.Data().LocalData().([]float32); bd[0] != 3 || bd[1] != 4 {
			t.Errorf("b without gradient changed to %v", bd)
		}
		return nil
	})
}

func TestStepRejectsPartialGradient(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		w := param(t, tape, m, "w", []placement.Placement{placement.Replicate()}, []float32{1, 2})
		xs, err := placement.NewSpec(m, []int{4, 2}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		xd, err := placement.NewLocal(xs, []float32{1, 2, 3, 4})
		if err != nil {
			return err
		}
		x, err := tape.Constant(xd)
		if err != nil {
			return err
		}
		ws, err := autograd.Reshape(w, 2, 1)
		if err != nil {
			return err
		}
		y, err := autograd.MatMul(x, ws)
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
		opt, err := optim.NewAdamW([]*autograd.Value{w}, optim.WithLR(0.1), optim.WithWeightDecay(0), optim.WithBetas(0.9, 0.999), optim.WithEps(1e-8))
		if err != nil {
			return err
		}
		if err := opt.Step(); err == nil || !strings.Contains(err.Error(), "reduce it") {
			t.Errorf("Step with a Partial(sum) gradient: %v", err)
		}
		if wd := w.Data().LocalData().([]float32); wd[0] != 1 || wd[1] != 2 {
			t.Errorf("a failed Step changed w to %v", wd)
		}
		return nil
	})
}

// TestNewAdamWRejects: a bad parameter list, invalid hyper-parameters and
// options AdamW does not take are ErrInvalid, naming the problem.
func TestNewAdamWRejects(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		a := param(t, tape, m, "a", []placement.Placement{placement.Replicate()}, []float32{1})
		c, err := tape.Constant(a.Data())
		if err != nil {
			return err
		}
		for _, tc := range []struct {
			name   string
			params []*autograd.Value
			opts   []optim.Option
			text   string
		}{
			{"duplicate", []*autograd.Value{a, a}, nil, "listed twice"},
			{"constant", []*autograd.Value{c}, nil, "not a leaf that requires grad"},
			{"nil parameter", []*autograd.Value{nil}, nil, "parameter 0 is nil"},
			{"beta1 = 1", []*autograd.Value{a}, []optim.Option{optim.WithBetas(1, 0.999)}, "Beta1 1: must be in [0, 1)"},
			{"negative beta2", []*autograd.Value{a}, []optim.Option{optim.WithBetas(0.9, -0.1)}, "Beta2 -0.1"},
			{"negative lr", []*autograd.Value{a}, []optim.Option{optim.WithLR(-1)}, "LR -1"},
			{"infinite lr", []*autograd.Value{a}, []optim.Option{optim.WithLR(math.Inf(1))}, "LR +Inf"},
			{"nan weight decay", []*autograd.Value{a}, []optim.Option{optim.WithWeightDecay(math.NaN())}, "WeightDecay NaN"},
			{"zero eps", []*autograd.Value{a}, []optim.Option{optim.WithEps(0)}, "Eps 0: must be positive"},
			{"clip option", []*autograd.Value{a}, []optim.Option{optim.WithNormType(1)}, "option WithNormType does not apply"},
			{"momentum", []*autograd.Value{a}, []optim.Option{optim.WithMomentum(0.9)}, "option WithMomentum does not apply"},
			{"maximize", []*autograd.Value{a}, []optim.Option{optim.WithMaximize()}, "option WithMaximize does not apply"},
			{"nil option", []*autograd.Value{a}, []optim.Option{nil}, "nil option"},
		} {
			_, err := optim.NewAdamW(tc.params, tc.opts...)
			if !errors.Is(err, optim.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("%s: %v, want ErrInvalid containing %q", tc.name, err, tc.text)
			}
		}
		return nil
	})
}

// TestOptimizerDefaults: without options the optimizers take
// torch.optim's defaults (PyTorch 1.13), options override them, and a
// learning rate of 0 (the start of a warm-up) is valid.
func TestOptimizerDefaults(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		a := param(t, tape, m, "a", []placement.Placement{placement.Replicate()}, []float32{1})
		adam, err := optim.NewAdamW([]*autograd.Value{a})
		if err != nil {
			return err
		}
		if got, want := [5]float64{adam.LR, adam.Beta1, adam.Beta2, adam.Eps, adam.WeightDecay}, [5]float64{1e-3, 0.9, 0.999, 1e-8, 0.01}; got != want {
			t.Errorf("AdamW defaults (lr, beta1, beta2, eps, weight_decay) = %v, want %v", got, want)
		}
		adam, err = optim.NewAdamW([]*autograd.Value{a}, optim.WithLR(0), optim.WithBetas(0.8, 0.99), optim.WithEps(1e-6), optim.WithWeightDecay(0), optim.WithLR(0.5))
		if err != nil {
			return err
		}
		if got, want := [5]float64{adam.LR, adam.Beta1, adam.Beta2, adam.Eps, adam.WeightDecay}, [5]float64{0.5, 0.8, 0.99, 1e-6, 0}; got != want {
			t.Errorf("AdamW with options = %v, want %v (the last LR wins)", got, want)
		}
		if _, err := optim.NewAdamW([]*autograd.Value{a}, optim.WithLR(0)); err != nil {
			t.Errorf("AdamW with lr 0: %v", err)
		}
		sgd, err := optim.NewSGD([]*autograd.Value{a}, 0.1)
		if err != nil {
			return err
		}
		if sgd.LR != 0.1 || sgd.Momentum != 0 || sgd.Dampening != 0 || sgd.WeightDecay != 0 || sgd.Nesterov || sgd.Maximize {
			t.Errorf("SGD defaults: %+v", *sgd)
		}
		sgd, err = optim.NewSGD([]*autograd.Value{a}, 0, optim.WithMomentum(0.9), optim.WithNesterov(), optim.WithWeightDecay(0.1), optim.WithMaximize())
		if err != nil {
			return err
		}
		if sgd.LR != 0 || sgd.Momentum != 0.9 || sgd.Dampening != 0 || sgd.WeightDecay != 0.1 || !sgd.Nesterov || !sgd.Maximize {
			t.Errorf("SGD with options: %+v", *sgd)
		}
		for _, o := range []optim.Option{optim.WithLR(0.1), optim.WithBetas(0.9, 0.99), optim.WithEps(1e-8)} {
			if _, err := optim.NewSGD([]*autograd.Value{a}, 0.1, o); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), "does not apply") {
				t.Errorf("SGD with an AdamW option: %v", err)
			}
		}
		return nil
	})
}

// TestUpdateRejectsLengths: slices of different lengths are ErrInvalid
// and nothing is updated.
func TestUpdateRejectsLengths(t *testing.T) {
	c := optim.Coefficients(0.1, 0.01, 0.9, 0.999, 1e-8, 1)
	p := []float32{1, 2}
	for name, s := range map[string][4][]float32{
		"short g": {p, {1}, {0, 0}, {0, 0}},
		"long m":  {p, {1, 1}, {0, 0, 0}, {0, 0}},
		"short v": {p, {1, 1}, {0, 0}, {0}},
	} {
		if err := optim.Update(c, s[0], s[1], s[2], s[3]); !errors.Is(err, optim.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
		if p[0] != 1 || p[1] != 2 {
			t.Fatalf("%s: a rejected Update changed p to %v", name, p)
		}
	}
}

// TestStateBytesSharded: a parameter sharded over 3 ranks (5 rows: 2, 2
// and 1) holds state for its local rows only.
func TestStateBytesSharded(t *testing.T) {
	placementtest.Run(t, []int{3}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		spec, err := placement.NewSpec(m, []int{5, 2}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		full := make([]float64, 10)
		dt, err := placement.FromFull(spec, full)
		if err != nil {
			return err
		}
		p, err := tape.Param("w", dt)
		if err != nil {
			return err
		}
		opt, err := optim.NewAdamW([]*autograd.Value{p})
		if err != nil {
			return err
		}
		loss, err := autograd.Sum(p)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return err
		}
		if err := opt.Step(); err != nil {
			return err
		}
		rows := []int{2, 2, 1}[m.Rank()]
		if got, want := opt.StateBytes(), int64(2*rows*2*8); got != want {
			return fmt.Errorf("rank %d: StateBytes = %d, want %d", m.Rank(), got, want)
		}
		return nil
	})
}
