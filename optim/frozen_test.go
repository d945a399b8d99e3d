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
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestNoGradientIsAnError: a step (AdamW, SGD) or a clip in which a
// parameter has no gradient fails with ErrInvalid naming it and changes
// nothing, unless WithAllowFrozen is given: then the parameter is skipped and
// the others are updated.
func TestNoGradientIsAnError(t *testing.T) {
	type stepper func(ps []*autograd.Value, opts ...optim.Option) error
	adamw := func(ps []*autograd.Value, opts ...optim.Option) error {
		o, err := optim.NewAdamW(ps, append(opts, optim.WithLR(0.1))...)
		if err != nil {
			return err
		}
		return o.Step()
	}
	sgd := func(ps []*autograd.Value, opts ...optim.Option) error {
		o, err := optim.NewSGD(ps, 0.1, append(opts, optim.WithMomentum(0.9))...)
		if err != nil {
			return err
		}
		return o.Step()
	}
	clip := func(ps []*autograd.Value, opts ...optim.Option) error {
		_, err := optim.ClipGradNorm(context.Background(), ps, 1e-3, opts...)
		return err
	}
	for _, tc := range []struct {
		name string
		step stepper
	}{{"AdamW", adamw}, {"SGD", sgd}, {"ClipGradNorm", clip}} {
		for _, frozen := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/frozen=%v", tc.name, frozen), func(t *testing.T) {
				placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
					tape := autograd.NewTape()
					rep := []placement.Placement{placement.Replicate()}
					a := param(t, tape, m, "a", rep, []float32{1, 2})
					b := param(t, tape, m, "frozen.b", rep, []float32{3, 4})
					loss, err := autograd.Sum(a)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, loss); err != nil {
						return err
					}
					ga := a.Grad()
					var opts []optim.Option
					if frozen {
						opts = append(opts, optim.WithAllowFrozen())
					}
					err = tc.step([]*autograd.Value{a, b}, opts...)
					ad := a.Data().LocalData().([]float32)
					bd := b.Data().LocalData().([]float32)
					if bd[0] != 3 || bd[1] != 4 {
						return fmt.Errorf("b, without a gradient, changed to %v", bd)
					}
					if !frozen {
						if !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `"frozen.b" has no gradient`) || !strings.Contains(err.Error(), "AllowFrozen") {
							return fmt.Errorf("got %v, want ErrInvalid naming frozen.b", err)
						}
						if ad[0] != 1 || ad[1] != 2 || a.Grad() != ga {
							return fmt.Errorf("a refused step changed a to %v or its gradient", ad)
						}
						return nil
					}
					if err != nil {
						return err
					}
					if tc.name == "ClipGradNorm" {
						if a.Grad() == ga {
							return fmt.Errorf("the clip left a's gradient of norm %v unscaled", math.Sqrt(2))
						}
					} else if ad[0] == 1 || ad[1] == 2 {
						return fmt.Errorf("a, with a gradient, was not updated: %v", ad)
					}
					return nil
				})
			})
		}
	}
}

// TestNoGradientNamesSeveral: several parameters without a gradient are
// named together, in list order.
func TestNoGradientNamesSeveral(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		rep := []placement.Placement{placement.Replicate()}
		a := param(t, tape, m, "a", rep, []float32{1})
		b := param(t, tape, m, "b", rep, []float32{1})
		o, err := optim.NewAdamW([]*autograd.Value{a, b})
		if err != nil {
			return err
		}
		if err := o.Step(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `2 parameters have ("a", "b") no gradient`) {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
}

// TestRelayoutAfterFirstStep: a parameter laid out anew (as Parallelize or
// FSDP do) after the optimizer made state for it is refused, naming it,
// rather than updated from state of another layout.
func TestRelayoutAfterFirstStep(t *testing.T) {
	for _, name := range []string{"AdamW", "SGD"} {
		t.Run(name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				tape := autograd.NewTape()
				rep := []placement.Placement{placement.Replicate()}
				w := param(t, tape, m, "w", rep, []float32{1, 2, 3, 4})
				step := func() error { return w.SetGrad(w.Data()) } // any gradient of w's layout
				var run func() error
				switch name {
				case "AdamW":
					o, err := optim.NewAdamW([]*autograd.Value{w})
					if err != nil {
						return err
					}
					run = o.Step
				case "SGD":
					o, err := optim.NewSGD([]*autograd.Value{w}, 0.1, optim.WithMomentum(0.9))
					if err != nil {
						return err
					}
					run = o.Step
				}
				if err := step(); err != nil {
					return err
				}
				if err := run(); err != nil {
					return err
				}
				w.ZeroGrad()
				s, err := placement.NewSpec(m, []int{4}, w.Spec().DType(), []placement.Placement{placement.Shard(0)})
				if err != nil {
					return err
				}
				sh, err := placement.Redistribute(ctx, w.Data(), s)
				if err != nil {
					return err
				}
				if err := w.Relayout(sh); err != nil {
					return err
				}
				if err := step(); err != nil {
					return err
				}
				before := slices.Clone(w.Data().LocalData().([]float32))
				if err := run(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), `"w" was laid out anew`) {
					return fmt.Errorf("a step after a relayout: %v, want ErrInvalid naming w", err)
				}
				if !slices.Equal(before, w.Data().LocalData().([]float32)) {
					return fmt.Errorf("the refused step changed w")
				}
				return nil
			})
		})
	}
}
