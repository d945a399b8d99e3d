package optim_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// stateful is an optimizer with a state dict.
type stateful interface {
	Step() error
	StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error)
	LoadStateDict(prefix string, entries map[string]any) error
}

// A state dict taken after one step and loaded into a new optimizer over
// parameters with the same values continues exactly as the optimizer that
// was not interrupted: 1 + 2 steps equal 3, bit for bit. A StateDict taken
// before the first step (which makes the state, zero) changes nothing
// either; for SGD with dampening that needs the "not started" flag,
// since a zero buffer that had started would take (1−τ)·g, not g.
func TestStateDictResumesExactly(t *testing.T) {
	cases := []struct {
		name string
		mk   func([]*autograd.Value) (stateful, error)
	}{
		{"AdamW", func(ps []*autograd.Value) (stateful, error) {
			return optim.NewAdamW(ps, optim.WithLR(0.1), optim.WithAllowFrozen())
		}},
		{"SGD momentum dampening", func(ps []*autograd.Value) (stateful, error) {
			return optim.NewSGD(ps, 0.1, optim.WithMomentum(0.9), optim.WithDampening(0.5), optim.WithWeightDecay(0.01), optim.WithAllowFrozen())
		}},
		{"SGD nesterov", func(ps []*autograd.Value) (stateful, error) {
			return optim.NewSGD(ps, 0.1, optim.WithMomentum(0.9), optim.WithNesterov(), optim.WithAllowFrozen())
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				rep := []placement.Placement{placement.Replicate()}
				newRun := func(a0, b0 []float32) (*autograd.Tape, []*autograd.Value, stateful) {
					tape := autograd.NewTape()
					ps := []*autograd.Value{param(t, tape, m, "a", rep, slices.Clone(a0)), param(t, tape, m, "b", rep, slices.Clone(b0))}
					o, err := c.mk(ps)
					if err != nil {
						t.Fatal(err)
					}
					return tape, ps, o
				}
				// step: the loss sums a·a (b, frozen, gets no gradient).
				step := func(tape *autograd.Tape, ps []*autograd.Value, o stateful) error {
					sq, err := autograd.Mul(ps[0], ps[0])
					if err != nil {
						return err
					}
					l, err := autograd.Sum(sq)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, l); err != nil {
						return err
					}
					if err := o.Step(); err != nil {
						return err
					}
					ps[0].ZeroGrad()
					return nil
				}
				a0, b0 := []float32{1, -2, 0.5}, []float32{3, 4}
				tapeA, psA, optA := newRun(a0, b0)
				for range 3 {
					if err := step(tapeA, psA, optA); err != nil {
						return err
					}
				}
				tapeB, psB, optB := newRun(a0, b0)
				if _, _, err := optB.StateDict("optim."); err != nil {
					return err
				}
				if err := step(tapeB, psB, optB); err != nil {
					return err
				}
				ts, es, err := optB.StateDict("optim.")
				if err != nil {
					return err
				}
				saved := map[string][]float32{}
				for n, x := range ts {
					saved[n] = slices.Clone(x.LocalData().([]float32))
				}
				tapeC, psC, optC := newRun(psB[0].Data().LocalData().([]float32), psB[1].Data().LocalData().([]float32))
				dst, _, err := optC.StateDict("optim.")
				if err != nil {
					return err
				}
				if !slices.Equal(slices.Sorted(maps.Keys(dst)), slices.Sorted(maps.Keys(saved))) {
					t.Fatalf("tensors %v, saved %v", slices.Sorted(maps.Keys(dst)), slices.Sorted(maps.Keys(saved)))
				}
				for n, x := range dst {
					copy(x.LocalData().([]float32), saved[n])
				}
				if err := optC.LoadStateDict("optim.", es); err != nil {
					return err
				}
				for range 2 {
					if err := step(tapeC, psC, optC); err != nil {
						return err
					}
				}
				for i := range psA {
					got, want := psC[i].Data().LocalData().([]float32), psA[i].Data().LocalData().([]float32)
					if !slices.Equal(got, want) {
						t.Errorf("%s after 1 + 2 steps: %v; after 3: %v", psA[i].Name(), got, want)
					}
				}
				return nil
			})
		})
	}
}

// LoadStateDict refuses a missing entry, one of another type and values
// the constructor refuses, naming the entry, and changes nothing.
func TestLoadStateDictRejects(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		rep := []placement.Placement{placement.Replicate()}
		tape := autograd.NewTape()
		a := param(t, tape, m, "a", rep, []float32{1, 2})
		adam, err := optim.NewAdamW([]*autograd.Value{a}, optim.WithLR(0.1))
		if err != nil {
			return err
		}
		sgd, err := optim.NewSGD([]*autograd.Value{a}, 0.1, optim.WithMomentum(0.9))
		if err != nil {
			return err
		}
		for _, c := range []struct {
			name   string
			o      stateful
			edit   func(map[string]any)
			naming string
		}{
			{"AdamW missing step", adam, func(e map[string]any) { delete(e, "o.a.step") }, `"o.a.step"`},
			{"AdamW step type", adam, func(e map[string]any) { e["o.a.step"] = 1.5 }, `"o.a.step"`},
			{"AdamW negative step", adam, func(e map[string]any) { e["o.a.step"] = int64(-1) }, `"o.a.step"`},
			{"AdamW beta", adam, func(e map[string]any) { e["o.beta1"] = 1.5 }, "Beta1"},
			{"SGD missing flag", sgd, func(e map[string]any) { delete(e, "o.a.has_momentum_buffer") }, `"o.a.has_momentum_buffer"`},
			{"SGD nesterov type", sgd, func(e map[string]any) { e["o.nesterov"] = "yes" }, `"o.nesterov"`},
		} {
			_, es, err := c.o.StateDict("o.")
			if err != nil {
				return err
			}
			c.edit(es)
			err = c.o.LoadStateDict("o.", es)
			if !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), c.naming) {
				t.Errorf("%s: %v, want ErrInvalid naming %s", c.name, err, c.naming)
			}
		}
		if adam.LR != 0.1 || adam.Beta1 != 0.9 || adam.StepCount(0) != 0 {
			t.Errorf("after refused loads: LR %v, Beta1 %v, step count %d", adam.LR, adam.Beta1, adam.StepCount(0))
		}
		return nil
	})
}
