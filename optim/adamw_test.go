package optim_test

import (
	"context"
	"math"
	"strings"
	"testing"

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
		optim.Update(c, p32, g32, m32, v32)
		optim.Update(c, p64, g64, m64, v64)
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
		opt, err := optim.NewAdamW([]*autograd.Value{a, b}, 0.1, 0.01, 0.9, 0.999, 1e-8)
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
		opt, err := optim.NewAdamW([]*autograd.Value{w}, 0.1, 0, 0.9, 0.999, 1e-8)
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

func TestNewAdamWRejects(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		a := param(t, tape, m, "a", []placement.Placement{placement.Replicate()}, []float32{1})
		if _, err := optim.NewAdamW([]*autograd.Value{a, a}, 0.1, 0, 0.9, 0.999, 1e-8); err == nil {
			t.Error("duplicate parameter accepted")
		}
		if _, err := optim.NewAdamW([]*autograd.Value{a}, 0.1, 0, 1, 0.999, 1e-8); err == nil {
			t.Error("beta1 = 1 accepted")
		}
		c, err := tape.Constant(a.Data())
		if err != nil {
			return err
		}
		if _, err := optim.NewAdamW([]*autograd.Value{c}, 0.1, 0, 0.9, 0.999, 1e-8); err == nil {
			t.Error("constant accepted")
		}
		return nil
	})
}
