package tests

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The FSDP rows of the fault table: an MLP (fc 5 → 7, proj 7 → 3) fully
// sharded as FullyShard(mlp, {"fc", "proj"}) on the world's p ranks, in
// the configurations below.

// fsdpConfig is one FSDP configuration of the table, for p ranks.
type fsdpConfig struct {
	name string
	// mesh returns the shape and axis names for p ranks.
	mesh func(p int) ([]int, []string)
	opts func(p int) []fsdp.Option
	dt   comm.DType
}

func flat(p int) ([]int, []string) { return []int{p}, []string{"fsdp"} }

// hsdpMesh is (dp, fsdp) with a shard axis of 2 where p allows.
func hsdpMesh(p int) ([]int, []string) {
	if p%2 == 0 {
		return []int{p / 2, 2}, []string{"dp", "fsdp"}
	}
	return []int{1, p}, []string{"dp", "fsdp"}
}

// reshardGroup is a WithReshardTo group size that divides p: 2 where p is a
// multiple of 4 (a real sub-group), 1 otherwise.
func reshardGroup(p int) int {
	if p%4 == 0 {
		return 2
	}
	return 1
}

func fixed(o ...fsdp.Option) func(int) []fsdp.Option {
	return func(int) []fsdp.Option { return o }
}

// fsdpPolicies are every reshard policy and ZeRO stage.
func fsdpPolicies() []fsdpConfig {
	f64 := comm.Float64
	return []fsdpConfig{
		{"reshard true", flat, fixed(), f64},
		{"reshard false", flat, fixed(fsdp.WithReshard(false)), f64},
		{"ReshardTo", flat, func(p int) []fsdp.Option { return []fsdp.Option{fsdp.WithReshardTo(reshardGroup(p))} }, f64},
		{"ZeRO-2", flat, fixed(fsdp.WithZeROStage(2)), f64},
		{"ZeRO-1", flat, fixed(fsdp.WithZeROStage(1)), f64},
		{"HSDP", hsdpMesh, fixed(fsdp.WithReplicateAxis("dp")), f64},
	}
}

// fsdpConfigs adds bfloat16 gathers and prefetch off to the policies.
func fsdpConfigs() []fsdpConfig {
	return append(fsdpPolicies(),
		fsdpConfig{"bf16", flat, fixed(fsdp.WithMixedPrecision(comm.BFloat16)), comm.Float32},
		fsdpConfig{"prefetch off", flat, fixed(fsdp.WithPrefetch(false)), comm.Float64},
	)
}

// fsdpMLP builds the MLP and its input (12 rows, sharded over the data
// axes) on a mesh of c's ranks.
func fsdpMLP(c comm.Communicator, fc fsdpConfig) (*mesh.Mesh, *parallel.MLP, *autograd.Tape, *autograd.Value, error) {
	shape, names := fc.mesh(c.Size())
	m, err := mesh.New(c, shape, names)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	tape := autograd.NewTape()
	mlp, err := parallel.NewMLP(tape, m, 5, 7, parallel.WithName("mlp"), parallel.WithDType(fc.dt),
		parallel.WithInit(parallel.Normal(0.3, 1)), parallel.WithBiasInit(parallel.Normal(0.1, 2)))
	if err != nil {
		return nil, nil, nil, nil, err
	}
	places := make([]placement.Placement, len(names))
	for i := range places {
		places[i] = placement.Shard(0)
	}
	spec, err := placement.NewSpec(m, []int{12, 5}, fc.dt, places)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{12, 5}, fc.dt, 3))
	if err != nil {
		return nil, nil, nil, nil, err
	}
	x, err := tape.Constant(xd)
	return m, mlp, tape, x, err
}

// fsdpPass runs forward (run: the whole MLP, or only fc), Sum and
// Backward; on an error it discards the step, as a training loop must.
func fsdpPass(ctx context.Context, f *fsdp.FSDP, tape *autograd.Tape, run func() (*autograd.Value, error)) error {
	y, err := run()
	if err == nil {
		var l *autograd.Value
		if l, err = autograd.Sum(y); err == nil {
			err = tape.Backward(ctx, l)
		}
	}
	if err != nil {
		return errors.Join(err, f.Discard(ctx))
	}
	return nil
}

// fsdpGrads returns the full gradients of f's parameters.
func fsdpGrads(ctx context.Context, f *fsdp.FSDP) ([][]float64, error) {
	var out [][]float64
	for _, p := range f.Params() {
		if p.Grad() == nil {
			return nil, fmt.Errorf("%w: %s has no gradient", errWrong, p.Name())
		}
		g, err := p.Grad().Full(ctx)
		if err != nil {
			return nil, err
		}
		out = append(out, asFloat64Any(g))
	}
	return out, nil
}

func asFloat64Any(d any) []float64 {
	switch v := d.(type) {
	case []float64:
		return v
	case []float32:
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out
	}
	return nil
}

// fsdpSecondBackward: a step of one pass, then a step of two plain passes
// (forward, Sum, Backward twice, then Finish): the second step's
// gradients must be twice the first's, as on one rank. FSDP used to drop
// the second pass without an error.
func fsdpSecondBackward(fc fsdpConfig) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, _ int) error {
		_, mlp, tape, x, err := fsdpMLP(c, fc)
		if err != nil {
			return err
		}
		fs, err := fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"}, fc.opts(c.Size())...)
		if err != nil {
			return err
		}
		var grads [3][][]float64
		for passes := 1; passes <= 2; passes++ {
			for range passes {
				if err := fsdpPass(ctx, fs, tape, func() (*autograd.Value, error) { return mlp.Forward(ctx, x) }); err != nil {
					return err
				}
			}
			if err := fs.Finish(ctx); err != nil {
				return err
			}
			if grads[passes], err = fsdpGrads(ctx, fs); err != nil {
				return err
			}
		}
		for i, one := range grads[1] {
			for k, g1 := range one {
				g2 := grads[2][i][k]
				if math.Abs(g2-2*g1) > 1e-6*math.Max(1, math.Abs(g1)) {
					return fmt.Errorf("%w: %s[%d] after two backward passes = %v, want twice one pass's %v", errWrong, fs.Params()[i].Name(), k, g2, g1)
				}
			}
		}
		return nil
	}
}

// fsdpSkippedUnit: the faulty rank runs only mlp.FC.Forward, the others
// the whole MLP. Every rank must fail with ErrMismatch naming the faulty
// rank (and the unit). Under WithReshard(false), ZeRO-2 and ZeRO-1 every
// rank used to succeed with proj's gradient missing the faulty rank's
// share.
func fsdpSkippedUnit(fc fsdpConfig) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, f int) error {
		_, mlp, tape, x, err := fsdpMLP(c, fc)
		if err != nil {
			return err
		}
		fs, err := fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"}, fc.opts(c.Size())...)
		if err != nil {
			return err
		}
		run := func() (*autograd.Value, error) { return mlp.Forward(ctx, x) }
		if c.Rank() == f {
			run = func() (*autograd.Value, error) { return mlp.FC.Forward(ctx, x) }
		}
		if err := fsdpPass(ctx, fs, tape, run); err != nil {
			return err
		}
		if err := fs.Finish(ctx); err != nil {
			return err
		}
		return fmt.Errorf("%w: Finish succeeded though rank %d skipped unit proj", errWrong, f)
	}
}

// fsdpBadOption: every rank passes the same bad option to FullyShard,
// which must refuse it with ErrInvalid before any collective.
func fsdpBadOption(opt fsdp.Option) func(ctx context.Context, c comm.Communicator, f int) error {
	return func(ctx context.Context, c comm.Communicator, _ int) error {
		_, mlp, _, _, err := fsdpMLP(c, fsdpConfig{mesh: flat, dt: comm.Float64})
		if err != nil {
			return err
		}
		before := len(c.Recorder().Entries())
		_, err = fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"}, opt)
		if n := len(c.Recorder().Entries()) - before; n > 0 {
			return errors.Join(err, fmt.Errorf("%w: %d collectives before the option was refused", errWrong, n))
		}
		return err
	}
}

// fsdpLateRank: under WithReshardTo, the faulty rank sleeps in proj's enter
// hook past the timeout. Every rank's error must name it: its peers wait
// for it in the group all-gather of backward, or in reduce-scatters
// behind the peers that do.
func fsdpLateRank(ctx context.Context, c comm.Communicator, f int) error {
	fc := fsdpConfig{mesh: flat, dt: comm.Float64}
	_, mlp, tape, x, err := fsdpMLP(c, fc)
	if err != nil {
		return err
	}
	fs, err := fsdp.FullyShard(ctx, mlp, []string{"fc", "proj"}, fsdp.WithReshardTo(reshardGroup(c.Size())))
	if err != nil {
		return err
	}
	if c.Rank() == f {
		mlp.Proj.OnEnter(func(context.Context) error {
			time.Sleep(faultTimeout * 3 / 2)
			return nil
		})
	}
	if err := fsdpPass(ctx, fs, tape, func() (*autograd.Value, error) { return mlp.Forward(ctx, x) }); err != nil {
		return err
	}
	return fs.Finish(ctx)
}

// expectLate returns the check of a late rank: every rank's error
// matches target and, on the other ranks, its first line (the step's
// first error) blames the late rank as the one the call waited for, in
// world ranks ("waiting for rank 3", or "rank 1 (world rank 3)" on a
// split communicator), not a rank that was itself waiting.
func expectLate(target error) func(r, f int, err error) error {
	return func(r, f int, err error) error {
		if e := expect(target, nil)(r, f, err); e != nil || r == f {
			return e
		}
		first, _, _ := strings.Cut(err.Error(), "\n")
		blame := regexp.MustCompile(fmt.Sprintf(`waiting for rank (%d|\d+ \(world rank %d\))\D`, f, f))
		if !blame.MatchString(first) {
			return fmt.Errorf("the first error does not blame the late rank %d: %s", f, first)
		}
		return nil
	}
}

// expectEverywhere returns a check: every rank's error matches target
// (the same bad input on every rank: no rank is to blame).
func expectEverywhere(target error) func(r, f int, err error) error {
	return func(_, _ int, err error) error {
		if !errors.Is(err, target) {
			return fmt.Errorf("%v, want an error matching %v", err, target)
		}
		return nil
	}
}

// fsdpFaultCases are the FSDP rows of the table.
func fsdpFaultCases() []faultCase {
	var out []faultCase
	for _, fc := range fsdpConfigs() {
		out = append(out, faultCase{name: "FSDP second backward, " + fc.name, check: succeed, body: fsdpSecondBackward(fc)})
	}
	for _, fc := range fsdpPolicies() {
		out = append(out, faultCase{name: "FSDP skipped unit, " + fc.name, check: expect(loom.ErrMismatch, nil), body: fsdpSkippedUnit(fc)})
	}
	for _, bad := range []struct {
		name string
		opt  fsdp.Option
	}{
		{"WithGradientDivideFactor(+Inf)", fsdp.WithGradientDivideFactor(math.Inf(1))},
		{"WithGradientDivideFactor(0)", fsdp.WithGradientDivideFactor(0)},
		{"WithGradientDivideFactor(-1)", fsdp.WithGradientDivideFactor(-1)},
		{"WithGradientDivideFactor(NaN)", fsdp.WithGradientDivideFactor(math.NaN())},
		{"WithReshardTo(0)", fsdp.WithReshardTo(0)},
	} {
		out = append(out, faultCase{name: "FSDP " + bad.name, check: expectEverywhere(fsdp.ErrInvalid), body: fsdpBadOption(bad.opt)})
	}
	out = append(out, faultCase{name: "FSDP late rank under ReshardTo", check: expectLate(comm.ErrTimeout), body: fsdpLateRank,
		dependsOn: "comm/local naming the rank that never arrived (branch errs)"})
	return out
}
