package optim_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// sgdHyper is one test's SGD hyper-parameters, with torch.optim.SGD's
// meanings.
type sgdHyper struct {
	LR, Momentum, Dampening, WeightDecay float64
	Nesterov, Maximize                   bool
}

// opts returns the options that set h's values other than LR (NewSGD's
// positional argument); defaults are left to NewSGD.
func (h sgdHyper) opts() []optim.Option {
	var o []optim.Option
	if h.Momentum != 0 {
		o = append(o, optim.WithMomentum(h.Momentum))
	}
	if h.Dampening != 0 {
		o = append(o, optim.WithDampening(h.Dampening))
	}
	if h.WeightDecay != 0 {
		o = append(o, optim.WithWeightDecay(h.WeightDecay))
	}
	if h.Nesterov {
		o = append(o, optim.WithNesterov())
	}
	if h.Maximize {
		o = append(o, optim.WithMaximize())
	}
	return o
}

// set writes h into o's fields, as a schedule would between steps.
func (h sgdHyper) set(o *optim.SGD) {
	o.LR, o.Momentum, o.Dampening, o.WeightDecay, o.Nesterov, o.Maximize = h.LR, h.Momentum, h.Dampening, h.WeightDecay, h.Nesterov, h.Maximize
}

// sgdRef is torch.optim.SGD's single-tensor update (_single_tensor_sgd)
// in float64, written as PyTorch's sequence of tensor ops, for one tensor
// over several steps; a nil gradient skips the step (grad None).
func sgdRef(c sgdHyper, p0 []float64, grads [][]float64) []float64 {
	p := slices.Clone(p0)
	var buf []float64 // nil until the first step with momentum
	for _, g := range grads {
		if g == nil {
			continue
		}
		d := slices.Clone(g)
		if c.Maximize {
			for i := range d {
				d[i] = -d[i]
			}
		}
		if c.WeightDecay != 0 {
			for i := range d {
				d[i] += c.WeightDecay * p[i]
			}
		}
		if c.Momentum != 0 {
			if buf == nil {
				buf = slices.Clone(d)
			} else {
				for i := range buf {
					buf[i] = c.Momentum*buf[i] + (1-c.Dampening)*d[i]
				}
			}
			if c.Nesterov {
				for i := range d {
					d[i] += c.Momentum * buf[i]
				}
			} else {
				copy(d, buf)
			}
		}
		for i := range p {
			p[i] -= c.LR * d[i]
		}
	}
	return p
}

// sgdConfigs covers every branch of the update.
var sgdConfigs = []struct {
	name string
	cfg  sgdHyper
}{
	{"plain", sgdHyper{LR: 0.1}},
	{"momentum", sgdHyper{LR: 0.05, Momentum: 0.9}},
	{"dampening", sgdHyper{LR: 0.05, Momentum: 0.8, Dampening: 0.3}},
	{"nesterov", sgdHyper{LR: 0.05, Momentum: 0.9, Nesterov: true}},
	{"weight decay", sgdHyper{LR: 0.1, WeightDecay: 0.01}},
	{"all", sgdHyper{LR: 0.02, Momentum: 0.7, Dampening: 0.1, WeightDecay: 0.05, Maximize: true}},
	{"nesterov wd maximize", sgdHyper{LR: 0.02, Momentum: 0.5, WeightDecay: 0.1, Nesterov: true, Maximize: true}},
}

// sgdParam is one parameter of a test: its global shape, placements on
// the mesh, and whether its gradient is missing at step 1 (0-based).
type sgdParam struct {
	shape   []int
	places  []placement.Placement
	skipAt1 bool
}

// runSGD builds the parameters on m with dtype dt, runs steps SGD steps
// with fresh gradients each step (none for a skipping parameter at step
// 1) and compares every parameter's global value with sgdRef.
func runSGD(t *testing.T, ctx context.Context, m *mesh.Mesh, dt comm.DType, cfg sgdHyper, params []sgdParam, tol float64) error {
	const steps = 4
	tape := autograd.NewTape()
	vals := make([]*autograd.Value, len(params))
	specs := make([]*placement.Spec, len(params))
	for i, sp := range params {
		s, err := placement.NewSpec(m, sp.shape, dt, sp.places)
		if err != nil {
			return err
		}
		d, err := placement.FromFull(s, placementtest.Random(sp.shape, dt, uint64(i+1)))
		if err != nil {
			return err
		}
		if vals[i], err = tape.Param(fmt.Sprint("p", i), d); err != nil {
			return err
		}
		specs[i] = s
	}
	opt, err := optim.NewSGD(vals, cfg.LR, append(cfg.opts(), optim.WithAllowFrozen())...)
	if err != nil {
		return err
	}
	for step := range steps {
		for i, sp := range params {
			if sp.skipAt1 && step == 1 {
				vals[i].ZeroGrad()
				continue
			}
			g, err := placement.FromFull(specs[i], placementtest.Random(sp.shape, dt, uint64(100*step+i+50)))
			if err != nil {
				return err
			}
			if err := vals[i].SetGrad(g); err != nil {
				return err
			}
		}
		if err := opt.Step(); err != nil {
			return err
		}
	}
	// With momentum every parameter has a buffer the size of its local
	// block; without it, none.
	var wantState int64
	for _, v := range vals {
		if cfg.Momentum != 0 {
			wantState += int64(prodInts(v.Spec().LocalShape()) * dt.Size())
		}
	}
	if got := opt.StateBytes(); got != wantState {
		return fmt.Errorf("StateBytes = %d, want %d", got, wantState)
	}
	for i, sp := range params {
		var grads [][]float64
		for step := range steps {
			if sp.skipAt1 && step == 1 {
				grads = append(grads, nil)
				continue
			}
			// The gradients the run used, exactly (float32 ones widened).
			grads = append(grads, asF64(placementtest.Random(sp.shape, dt, uint64(100*step+i+50))))
		}
		want := sgdRef(cfg, asF64(placementtest.Random(sp.shape, dt, uint64(i+1))), grads)
		got, err := vals[i].Data().Full(ctx)
		if err != nil {
			return err
		}
		if err := placementtest.Compare(got, want, tol); err != nil {
			return fmt.Errorf("%s: %w", vals[i].Name(), err)
		}
	}
	return nil
}

// asF64 returns a []float32 or []float64 as float64s.
func asF64(d any) []float64 {
	switch v := d.(type) {
	case []float64:
		return slices.Clone(v)
	case []float32:
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out
	}
	return nil
}

// TestSGDMatchesReference runs every configuration against the float64
// reference over several steps, in float64 and float32, on one rank and
// with parameters sharded over 2 and 3 ranks (uneven and empty shards,
// 2-d parameters sharded on either dim) and on a 2x2 mesh.
func TestSGDMatchesReference(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	type pl = []placement.Placement
	meshes := []struct {
		shape  []int
		names  []string
		params []sgdParam
	}{
		{[]int{1}, []string{"dp"}, []sgdParam{{shape: []int{5}, places: pl{R}}, {shape: []int{2, 3}, places: pl{R}, skipAt1: true}}},
		{[]int{2}, []string{"dp"}, []sgdParam{
			{shape: []int{5}, places: pl{S0}},                   // 3 + 2
			{shape: []int{3, 4}, places: pl{S1}, skipAt1: true}, // columns
			{shape: []int{1, 3}, places: pl{S0}},                // 1 + 0: an empty shard
			{shape: []int{4}, places: pl{R}},                    // replicated
		}},
		{[]int{3}, []string{"dp"}, []sgdParam{
			{shape: []int{7}, places: pl{S0}},                   // 3 + 3 + 1
			{shape: []int{4, 2}, places: pl{S0}, skipAt1: true}, // 2 + 2 + 0
			{shape: []int{2, 5}, places: pl{S1}},                // 2 + 2 + 1 columns
		}},
		{[]int{2, 2}, []string{"dp", "tp"}, []sgdParam{
			{shape: []int{5, 3}, places: pl{S0, S1}},
			{shape: []int{3}, places: pl{S0, S0}},
			{shape: []int{4}, places: pl{R, S0}},
		}},
	}
	for _, mc := range meshes {
		for _, c := range sgdConfigs {
			for _, dt := range []comm.DType{comm.Float64, comm.Float32} {
				tol := 1e-12
				if dt == comm.Float32 {
					tol = 1e-5
				}
				t.Run(fmt.Sprintf("%v/%s/%v", mc.shape, c.name, dt), func(t *testing.T) {
					placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
						return runSGD(t, ctx, m, dt, c.cfg, mc.params, tol)
					})
				})
			}
		}
	}
}

// TestSGDSkipKeepsMomentum: a parameter without a gradient is not
// touched and its buffer starts only at its first gradient.
func TestSGDSkipKeepsMomentum(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		rep := []placement.Placement{placement.Replicate()}
		a := param(t, tape, m, "a", rep, []float32{1, 2})
		b := param(t, tape, m, "b", rep, []float32{3, 4})
		opt, err := optim.NewSGD([]*autograd.Value{a, b}, 0.5, optim.WithMomentum(0.9), optim.WithWeightDecay(0.1), optim.WithAllowFrozen())
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
		if !opt.HasMomentumBuffer(0) || opt.HasMomentumBuffer(1) || opt.HasMomentumBuffer(2) {
			t.Errorf("momentum buffers: %v %v %v, want true false false", opt.HasMomentumBuffer(0), opt.HasMomentumBuffer(1), opt.HasMomentumBuffer(2))
		}
		if bd := b.Data().LocalData().([]float32); bd[0] != 3 || bd[1] != 4 {
			t.Errorf("b without gradient changed to %v", bd)
		}
		// a = a − lr·(1 + wd·a): the first momentum step is the gradient.
		if ad := a.Data().LocalData().([]float32); math.Abs(float64(ad[0])-(1-0.5*1.1)) > 1e-6 || math.Abs(float64(ad[1])-(2-0.5*1.2)) > 1e-6 {
			t.Errorf("a = %v", ad)
		}
		return nil
	})
}

// TestSGDRejects covers the hyper-parameter checks (at NewSGD and again at
// Step) and gradients that do not line up with their parameter.
func TestSGDRejects(t *testing.T) {
	for _, c := range []struct {
		name string
		cfg  sgdHyper
		text string
	}{
		{"negative lr", sgdHyper{LR: -1}, "LR -1: must be zero or positive"},
		{"negative momentum", sgdHyper{LR: 1, Momentum: -0.1}, "Momentum -0.1: must be zero or positive"},
		{"negative wd", sgdHyper{LR: 1, WeightDecay: -0.1}, "WeightDecay -0.1: must be zero or positive"},
		{"nan", sgdHyper{LR: math.NaN()}, "LR NaN"},
		{"nesterov no momentum", sgdHyper{LR: 1, Nesterov: true}, "Nesterov momentum requires"},
		{"nesterov dampening", sgdHyper{LR: 1, Momentum: 0.9, Dampening: 0.1, Nesterov: true}, "zero dampening"},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				tape := autograd.NewTape()
				a := param(t, tape, m, "a", []placement.Placement{placement.Replicate()}, []float32{1})
				if _, err := optim.NewSGD([]*autograd.Value{a}, c.cfg.LR, c.cfg.opts()...); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), c.text) {
					t.Errorf("NewSGD: %v, want an error containing %q", err, c.text)
				}
				opt, err := optim.NewSGD([]*autograd.Value{a}, 1)
				if err != nil {
					return err
				}
				c.cfg.set(opt) // "may be changed between steps"
				s, _ := placement.NewSpec(m, []int{1}, comm.Float32, []placement.Placement{placement.Replicate()})
				g, _ := placement.NewLocal(s, []float32{1})
				if err := a.SetGrad(g); err != nil {
					return err
				}
				if err := opt.Step(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), c.text) {
					t.Errorf("Step: %v, want an error containing %q", err, c.text)
				}
				if got := a.Data().LocalData().([]float32); got[0] != 1 {
					t.Errorf("a rejected step changed the parameter to %v", got)
				}
				return nil
			})
		})
	}
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		a := param(t, tape, m, "a", []placement.Placement{placement.Replicate()}, []float32{1})
		if _, err := optim.NewSGD([]*autograd.Value{a, a}, 1); err == nil || !strings.Contains(err.Error(), "listed twice") {
			t.Errorf("duplicate parameter: %v", err)
		}
		c, _ := tape.Constant(a.Data())
		if _, err := optim.NewSGD([]*autograd.Value{c}, 1); err == nil || !strings.Contains(err.Error(), "not a leaf that requires grad") {
			t.Errorf("constant: %v", err)
		}
		if _, err := optim.NewSGD([]*autograd.Value{nil}, 1); err == nil || !strings.Contains(err.Error(), "parameter 0 is nil") {
			t.Errorf("nil parameter: %v", err)
		}
		return nil
	})
}

// TestSGDRejectsMisalignedGradients: a Partial gradient, a sharded
// gradient for a replicated parameter and one sharded on another dim are
// refused before any parameter changes.
func TestSGDRejectsMisalignedGradients(t *testing.T) {
	R, S0, S1 := placement.Replicate(), placement.Shard(0), placement.Shard(1)
	for _, c := range []struct {
		name string
		p, g placement.Placement
		text string
	}{
		{"partial", R, placement.Partial(comm.Sum), `gradient is P(sum) on mesh axis "dp": reduce it before the optimizer step`},
		{"sharded for replicated", R, S0, `gradient is S(0) on mesh axis "dp" where the parameter is R`},
		{"other dim", S0, S1, `gradient is S(1) on mesh axis "dp" where the parameter is S(0)`},
	} {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				full := []float64{1, 2, 3, 4}
				ps, _ := placement.NewSpec(m, []int{2, 2}, comm.Float64, []placement.Placement{c.p})
				gs, _ := placement.NewSpec(m, []int{2, 2}, comm.Float64, []placement.Placement{c.g})
				pd, _ := placement.FromFull(ps, full)
				gd, _ := placement.FromFull(gs, full)
				tape := autograd.NewTape()
				good := param(t, tape, m, "good", []placement.Placement{R}, []float32{1})
				p, _ := tape.Param("p", pd)
				if err := p.SetGrad(gd); err != nil {
					return err
				}
				gg, _ := placement.NewLocal(good.Spec(), []float32{1})
				if err := good.SetGrad(gg); err != nil {
					return err
				}
				opt, err := optim.NewSGD([]*autograd.Value{good, p}, 0.1)
				if err != nil {
					return err
				}
				if err := opt.Step(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `optim: SGD.Step: invalid argument: "p": `+c.text) {
					t.Errorf("Step: %v, want %q", err, c.text)
				}
				if got := good.Data().LocalData().([]float32); got[0] != 1 {
					t.Errorf("a refused step changed another parameter to %v", got)
				}
				return nil
			})
		})
	}
}

func prodInts(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}
