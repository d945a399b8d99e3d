package parallel_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// seqModel is Linear(4→7), ReLU, Dropout(0.4), Linear(7→3), Tanh: hidden
// width 7 splits unevenly over 2 or 3 ranks.
func seqModel(tape *autograd.Tape, m *mesh.Mesh) (*parallel.Sequential, error) {
	l0, err := parallel.NewLinear(tape, m, 4, 7, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.7, 1)), parallel.WithDType(comm.Float64))
	if err != nil {
		return nil, err
	}
	l3, err := parallel.NewLinear(tape, m, 7, 3, parallel.WithName("3"), parallel.WithInit(parallel.Normal(0.7, 2)), parallel.WithDType(comm.Float64))
	if err != nil {
		return nil, err
	}
	d, err := parallel.NewDropout(0.4, 77)
	if err != nil {
		return nil, err
	}
	return parallel.NewSequential(l0, parallel.NewReLU(), d, l3, parallel.NewTanh())
}

// seqLayout lays a model out and returns the leaves that will hold its
// gradients (nil: its parameters) and what completes a step's gradients
// (nil: nothing).
type seqLayout func(context.Context, *parallel.Sequential) ([]*autograd.Value, func(context.Context) error, error)

// seqRun builds seqModel on m, lays it out with layout (nil: as built),
// runs two training steps and one eval forward on x [5, 4] (rows sharded
// on the "dp" and "fsdp" axes) and returns the losses (MSE against a
// fixed target) and the full gradients of the parameters after the
// second step.
func seqRun(ctx context.Context, m *mesh.Mesh, layout seqLayout) ([]float64, [][]float64, error) {
	tape := autograd.NewTape()
	seq, err := seqModel(tape, m)
	if err != nil {
		return nil, nil, err
	}
	var ps []*autograd.Value // the leaves holding the gradients
	var finish func(context.Context) error
	if layout != nil {
		if ps, finish, err = layout(ctx, seq); err != nil {
			return nil, nil, err
		}
	}
	places := ptest.DataPlaces(m)
	mk := func(shape []int, seed uint64) (*autograd.Value, error) {
		spec, err := placement.NewSpec(m, shape, comm.Float64, places)
		if err != nil {
			return nil, err
		}
		dt, err := placement.FromFull(spec, placementtest.Random(shape, comm.Float64, seed))
		if err != nil {
			return nil, err
		}
		return tape.Constant(dt)
	}
	var losses []float64
	var grads [][]float64
	for step := range 3 {
		if step == 2 {
			if err := parallel.Eval(seq); err != nil {
				return nil, nil, err
			}
		}
		x, err := mk([]int{5, 4}, 5)
		if err != nil {
			return nil, nil, err
		}
		tgt, err := mk([]int{5, 3}, 6)
		if err != nil {
			return nil, nil, err
		}
		y, err := seq.Forward(ctx, x)
		if err != nil {
			return nil, nil, err
		}
		loss, err := autograd.MSE(y, tgt)
		if err != nil {
			return nil, nil, err
		}
		full, err := loss.Data().Full(ctx)
		if err != nil {
			return nil, nil, err
		}
		losses = append(losses, full.([]float64)[0])
		if step != 1 {
			// Only the second step's gradients are compared.
			tape.Reset()
			continue
		}
		if err := tape.Backward(ctx, loss); err != nil {
			return nil, nil, err
		}
		if finish != nil {
			if err := finish(ctx); err != nil {
				return nil, nil, err
			}
		}
	}
	if ps == nil {
		if ps, err = parallel.Params(seq); err != nil {
			return nil, nil, err
		}
	}
	for _, p := range ps {
		g, err := p.Grad().Full(ctx)
		if err != nil {
			return nil, nil, err
		}
		grads = append(grads, g.([]float64))
	}
	return losses, grads, nil
}

// TestSequentialParallelEqualsSerial trains the Sequential model with
// dropout on one rank and under tensor parallelism (3 ranks, uneven
// hidden shards), data×tensor parallelism (2×3) and FSDP (3 ranks): the
// losses of two training steps and an eval forward, and the gradients,
// match the serial run to 1e-12 (float64; only summation order differs),
// which needs the dropout masks of the serial run on every layout.
func TestSequentialParallelEqualsSerial(t *testing.T) {
	var want []float64
	var wantG [][]float64
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		var err error
		want, wantG, err = seqRun(ctx, m, nil)
		return err
	})
	if len(want) != 3 || want[0] == want[1] {
		t.Fatalf("serial losses %v: want three, the first two with different masks", want)
	}
	tp := func(ctx context.Context, s *parallel.Sequential) ([]*autograd.Value, func(context.Context) error, error) {
		return nil, nil, tp.Parallelize(ctx, s, "tp", tp.Plan{{Pattern: "0", Style: tp.ColwiseParallel{}}, {Pattern: "3", Style: tp.RowwiseParallel{}}})
	}
	fsdp := func(ctx context.Context, s *parallel.Sequential) ([]*autograd.Value, func(context.Context) error, error) {
		f, err := fsdp.FullyShard(ctx, s, []string{"0", "3"})
		if err != nil {
			return nil, nil, err
		}
		return f.Params(), f.Finish, nil
	}
	cases := []struct {
		name   string
		shape  []int
		names  []string
		layout seqLayout
	}{
		{"tp3", []int{3}, []string{"tp"}, tp},
		{"dp2xtp3", []int{2, 3}, []string{"dp", "tp"}, tp},
		{"fsdp3", []int{3}, []string{"fsdp"}, fsdp},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, c.shape, c.names, func(ctx context.Context, m *mesh.Mesh) error {
				got, grads, err := seqRun(ctx, m, c.layout)
				if err != nil {
					return err
				}
				for i := range want {
					if math.Abs(got[i]-want[i]) > 1e-12 {
						return fmt.Errorf("loss %d: %v, serial %v", i, got[i], want[i])
					}
				}
				for i := range wantG {
					if err := placementtest.Compare(grads[i], wantG[i], 1e-12); err != nil {
						return fmt.Errorf("gradient %d: %w", i, err)
					}
				}
				return nil
			})
		})
	}
}

func TestSequentialTreeModesAndHooks(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		seq, err := seqModel(tape, m)
		if err != nil {
			return err
		}
		outer, err := parallel.NewSequential(seq, parallel.NewSigmoid())
		if err != nil {
			return err
		}
		var paths []string
		if err := parallel.Walk(outer, func(p string, _ parallel.Module) error { paths = append(paths, p); return nil }); err != nil {
			return err
		}
		if want := []string{"", "0", "0.0", "0.1", "0.2", "0.3", "0.4", "1"}; !slices.Equal(paths, want) {
			return fmt.Errorf("paths %v, want %v", paths, want)
		}
		ps, err := parallel.Params(outer)
		if err != nil {
			return err
		}
		if len(ps) != 4 {
			return fmt.Errorf("%d parameters, want 4 (two weights, two biases)", len(ps))
		}
		// Hooks on the Sequential and on a layer inside it fire once per
		// forward.
		var seqIn, reluIn int
		seq.OnEnter(func(context.Context) error { seqIn++; return nil })
		seq.Layers[1].Boundary().OnInput(func(_ context.Context, v *autograd.Value) (*autograd.Value, error) {
			reluIn++
			return v, nil
		})
		drop := seq.Layers[2].(*parallel.Dropout)
		dt, err := ptest.Replicated(m, []int{2, 4}, 3)
		if err != nil {
			return err
		}
		x, err := tape.Constant(dt)
		if err != nil {
			return err
		}
		if _, err := outer.Forward(ctx, x); err != nil {
			return err
		}
		if seqIn != 1 || reluIn != 1 {
			return fmt.Errorf("hooks ran %d and %d times, want 1 and 1", seqIn, reluIn)
		}
		// Modes: Eval makes Dropout the identity, Train restores it.
		if err := parallel.Eval(outer); err != nil {
			return err
		}
		if drop.Training() {
			return errors.New("Dropout still training after Eval")
		}
		if y, err := drop.Forward(ctx, x); err != nil || y != x {
			return fmt.Errorf("eval Dropout returned %v, %v; want its input", y, err)
		}
		if err := parallel.Train(outer); err != nil {
			return err
		}
		if y, err := drop.Forward(ctx, x); err != nil || y == x || !drop.Training() {
			return fmt.Errorf("training Dropout returned its input (%v) or failed: %v", y == x, err)
		}
		return nil
	})
}

func TestSequentialRejects(t *testing.T) {
	var nilLin *parallel.Linear
	cases := []struct {
		name string
		f    func() error
	}{
		{"no layers", func() error { _, err := parallel.NewSequential(); return err }},
		{"nil layer", func() error { _, err := parallel.NewSequential(parallel.NewReLU(), nil); return err }},
		{"nil pointer layer", func() error { _, err := parallel.NewSequential(nilLin); return err }},
		{"nil input", func() error {
			_, err := (&parallel.Sequential{Layers: []parallel.Layer{parallel.NewReLU()}}).Forward(context.Background(), nil)
			return err
		}},
		{"empty Sequential", func() error { _, err := (&parallel.Sequential{}).Forward(context.Background(), nil); return err }},
		{"dropout p=1", func() error { _, err := parallel.NewDropout(1, 0); return err }},
		{"dropout p NaN", func() error { _, err := parallel.NewDropout(math.NaN(), 0); return err }},
		{"dropout P set out of range", func() error {
			_, err := (&parallel.Dropout{P: -1}).Forward(context.Background(), &autograd.Value{})
			return err
		}},
		{"activation without function", func() error { _, err := (&parallel.Activation{}).Forward(context.Background(), nil); return err }},
		{"Train nil", func() error { return parallel.Train(nil) }},
		{"Eval nil child", func() error { return parallel.Eval(&parallel.Sequential{Layers: []parallel.Layer{nilLin}}) }},
	}
	for _, c := range cases {
		if err := c.f(); !errors.Is(err, parallel.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.name, err)
		}
	}
}

// TestActivationModules checks that each activation module computes its
// autograd op, under its name in errors.
func TestActivationModules(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		dt, err := ptest.Replicated(m, []int{3, 5}, 4)
		if err != nil {
			return err
		}
		x, err := tape.Constant(dt)
		if err != nil {
			return err
		}
		for _, c := range []struct {
			a  *parallel.Activation
			op func(*autograd.Value) (*autograd.Value, error)
		}{
			{parallel.NewReLU(), autograd.ReLU}, {parallel.NewSiLU(), autograd.SiLU}, {parallel.NewTanh(), autograd.Tanh},
			{parallel.NewSigmoid(), autograd.Sigmoid}, {parallel.NewGELU(), autograd.GELU},
		} {
			got, err := c.a.Forward(ctx, x)
			if err != nil {
				return err
			}
			want, err := c.op(x)
			if err != nil {
				return err
			}
			if err := placementtest.Compare(got.Data().LocalData(), want.Data().LocalData(), 0); err != nil {
				return fmt.Errorf("%s: %w", c.a.Name, err)
			}
			if _, err := c.a.Forward(ctx, nil); err == nil || !errors.Is(err, parallel.ErrInvalid) {
				return fmt.Errorf("%s on nil: %v, want ErrInvalid", c.a.Name, err)
			}
		}
		return nil
	})
}
