package fsdp

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestParamsCollectedBeforeLayoutChange is issue 26's stale parameters: a
// parameter list collected for the optimizer before Parallelize or
// FullyShard must hold the model's parameters afterwards (the same
// Values, laid out anew), so that an AdamW step updates every parameter,
// exactly as with a list collected after.
func TestParamsCollectedBeforeLayoutChange(t *testing.T) {
	for _, tc := range []struct {
		name, mode string
		dt         comm.DType
		opts       []Option
	}{
		{"Parallelize", "Parallelize", comm.Float64, nil},
		{"FullyShard", "FullyShard", comm.Float64, nil},
		{"FullyShard WithReshard(false)", "FullyShard", comm.Float64, []Option{WithReshard(false)}},
		{"FullyShard ZeRO-2", "FullyShard", comm.Float64, []Option{WithZeROStage(2)}},
		{"FullyShard ZeRO-1", "FullyShard", comm.Float64, []Option{WithZeROStage(1)}},
		{"FullyShard bf16", "FullyShard", comm.Float32, []Option{WithMixedPrecision(comm.BFloat16)}},
	} {
		mode := tc.mode
		t.Run(tc.name, func(t *testing.T) {
			init, before := staleStep(t, mode, true, tc.dt, tc.opts...)
			_, after := staleStep(t, mode, false, tc.dt, tc.opts...)
			if len(before) == 0 || len(before) != len(after) {
				t.Fatalf("%d parameters collected before, %d after", len(before), len(after))
			}
			for name, got := range before {
				if slices.Equal(got, init[name]) {
					t.Errorf("%s: the step did not update %q (collected before %s)", mode, name, mode)
				}
				if !slices.Equal(got, after[name]) {
					t.Errorf("%s: %q differs between a list collected before and one collected after", mode, name)
				}
			}
		})
	}
}

// staleStep builds a model (the FSDP one of dtype dt; the block is
// float64), collects its parameters before or after mode lays them out, runs one training step with AdamW on that list and
// returns every trained parameter's full value before and after the step.
func staleStep(t *testing.T, mode string, before bool, dt comm.DType, opts ...Option) (init, final map[string][]float64) {
	t.Helper()
	var mu sync.Mutex
	init, final = map[string][]float64{}, map[string][]float64{}
	fulls := func(ctx context.Context, m *mesh.Mesh, ps []*autograd.Value, into map[string][]float64) error {
		for _, p := range ps {
			d, err := p.Data().Full(ctx)
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				mu.Lock()
				into[p.Name()] = slices.Clone(toF64(d))
				mu.Unlock()
			}
		}
		return nil
	}
	shape, names := []int{1, 2}, []string{"dp", "tp"}
	if mode == "FullyShard" {
		shape, names = []int{2}, []string{"fsdp"}
	}
	err := placementtest.Simulate(context.Background(), shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		var (
			model    parallel.Module
			tape     *autograd.Tape
			relayout func() error
			train    func() error
			live     func() ([]*autograd.Value, error) // the model's parameters once laid out
		)
		switch mode {
		case "Parallelize":
			b, tpe, err := ptest.NewBlock(m)
			if err != nil {
				return err
			}
			model, tape = b, tpe
			relayout = func() error { return tp.Parallelize(ctx, b, "tp", ptest.BlockPlan(false)) }
			live = func() ([]*autograd.Value, error) { return parallel.Params(b) }
			train = func() error {
				l, err := b.Loss(ctx, tape, m, false)
				if err != nil {
					return err
				}
				return tape.Backward(ctx, l)
			}
		case "FullyShard":
			n, err := newFnet(m, dt)
			if err != nil {
				return err
			}
			var f *FSDP
			model = n
			relayout = func() (err error) {
				f, err = FullyShard(ctx, n, []string{"h.*"}, opts...)
				return err
			}
			// The spare Linear (the last two) is never used: leave it out.
			live = func() ([]*autograd.Value, error) { ps := f.Params(); return ps[:len(ps)-2], nil }
			train = func() error { return n.step(ctx, m, f) }
		}
		ps, err := parallel.Params(model)
		if err != nil {
			return err
		}
		if mode == "FullyShard" {
			ps = ps[:len(ps)-2]
		}
		if err := fulls(ctx, m, ps, init); err != nil {
			return err
		}
		if err := relayout(); err != nil {
			return err
		}
		lv, err := live()
		if err != nil {
			return err
		}
		if before {
			if !slices.Equal(ps, lv) {
				return fmt.Errorf("the list collected before %s no longer holds the model's parameters", mode)
			}
		} else {
			ps = lv
		}
		if err := train(); err != nil {
			return err
		}
		if err := tp.ReduceGrads(ctx, ps); err != nil {
			return err
		}
		opt, err := optim.NewAdamW(ps, optim.WithLR(0.1))
		if err != nil {
			return err
		}
		if err := opt.Step(); err != nil {
			return err
		}
		return fulls(ctx, m, ps, final)
	})
	if err != nil {
		t.Fatalf("%s (collected before: %v): %v", mode, before, err)
	}
	return init, final
}
