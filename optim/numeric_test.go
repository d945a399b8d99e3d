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
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestNumericOptions: every numeric option, given NaN, ±Inf, 0 and a
// negative value, is rejected with ErrInvalid naming it (before anything
// changes) unless the value means something for that kind: 0 for a
// learning rate (warm-up), a weight decay, a momentum, a dampening and a
// beta; +Inf for a norm type (the max norm).
func TestNumericOptions(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	bad := []float64{nan, inf, -inf, 0, -1}
	type option struct {
		name string
		use  func(ps []*autograd.Value, v float64) error
		ok   func(v float64) bool // which of bad are valid
	}
	zeroOK := func(v float64) bool { return v == 0 }
	adamw := func(o func(float64) optim.Option) func([]*autograd.Value, float64) error {
		return func(ps []*autograd.Value, v float64) error { _, err := optim.NewAdamW(ps, o(v)); return err }
	}
	sgd := func(o func(float64) optim.Option) func([]*autograd.Value, float64) error {
		return func(ps []*autograd.Value, v float64) error { _, err := optim.NewSGD(ps, 0.1, o(v)); return err }
	}
	clip := func(ps []*autograd.Value, v float64, opts ...optim.Option) error {
		_, err := optim.ClipGradNorm(context.Background(), ps, v, opts...)
		return err
	}
	options := []option{
		{"LR", adamw(optim.WithLR), zeroOK},
		{"Beta1", adamw(func(v float64) optim.Option { return optim.WithBetas(v, 0.999) }), zeroOK},
		{"Beta2", adamw(func(v float64) optim.Option { return optim.WithBetas(0.9, v) }), zeroOK},
		{"Eps", adamw(optim.WithEps), func(float64) bool { return false }},
		{"WeightDecay", adamw(optim.WithWeightDecay), zeroOK},
		{"LR", func(ps []*autograd.Value, v float64) error { _, err := optim.NewSGD(ps, v); return err }, zeroOK},
		{"Momentum", sgd(optim.WithMomentum), zeroOK},
		{"Dampening", sgd(optim.WithDampening), zeroOK},
		{"WeightDecay", sgd(optim.WithWeightDecay), zeroOK},
		{"maxNorm", func(ps []*autograd.Value, v float64) error { return clip(ps, v) }, func(float64) bool { return false }},
		{"NormType", func(ps []*autograd.Value, v float64) error { return clip(ps, 1, optim.WithNormType(v)) }, func(v float64) bool { return math.IsInf(v, 1) }},
	}
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		rep := []placement.Placement{placement.Replicate()}
		a := param(t, tape, m, "a", rep, []float32{1, 2})
		g := param(t, tape, m, "g", rep, []float32{1, 1})
		if err := a.SetGrad(g.Data()); err != nil {
			return err
		}
		ps := []*autograd.Value{a}
		for i, o := range options {
			for _, v := range bad {
				err := o.use(ps, v)
				if o.ok(v) {
					if err != nil {
						t.Errorf("option %d (%s) = %v: %v, want it accepted", i, o.name, v, err)
					}
					continue
				}
				want := fmt.Sprintf("%s %v: must", o.name, v)
				if !errors.Is(err, optim.ErrInvalid) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), want) {
					t.Errorf("option %d (%s) = %v: %v, want ErrInvalid containing %q", i, o.name, v, err, want)
				}
			}
		}
		// A dampening of 1 would keep every later gradient out of the
		// momentum buffer.
		if _, err := optim.NewSGD(ps, 0.1, optim.WithDampening(1)); !errors.Is(err, optim.ErrInvalid) {
			t.Errorf("WithDampening(1): %v, want ErrInvalid", err)
		}
		if d := a.Data().LocalData().([]float32); d[0] != 1 || d[1] != 2 {
			t.Errorf("a rejected option changed the parameter to %v", d)
		}
		return nil
	})
}
