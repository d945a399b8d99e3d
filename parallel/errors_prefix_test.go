package parallel_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestErrorsSayPackageOnce: invalid-argument errors of the entry points of
// parallel, parallel/tp, parallel/ddp and parallel/fsdp match
// loom.ErrInvalid and their package's own ErrInvalid, start with the
// package's prefix ("tp: ") and say it once, naming no other of these
// packages (the sentinel's text carries the prefix, so a call site that
// added it again printed "parallel: FullyShard: parallel: invalid
// argument: ...").
func TestErrorsSayPackageOnce(t *testing.T) {
	placementtest.Run(t, []int{1, 1, 2}, []string{"dp", "fsdp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		mlp, err := parallel.NewMLP(tape, m, 4, 8, parallel.WithName("mlp"))
		if err != nil {
			return err
		}
		params, err := parallel.Params(mlp)
		if err != nil {
			return err
		}
		dd, err := ddp.New(ctx, params)
		if err != nil {
			return err
		}
		cases := []struct {
			name string
			pkg  error // the package's ErrInvalid; nil: another package's error under "parallel: "
			err  func() error
		}{
			{"Parallelize axis", tp.ErrInvalid, func() error {
				return tp.Parallelize(ctx, mlp, "model", tp.Plan{{Pattern: "fc", Style: tp.ColwiseParallel{}}})
			}},
			{"Parallelize style misfit", tp.ErrInvalid, func() error {
				seq, err := parallel.NewSequential(mlp)
				if err != nil {
					return err
				}
				return tp.Parallelize(ctx, seq, "tp", tp.Plan{{Pattern: "0", Style: tp.ColwiseParallel{}}})
			}},
			{"Parallelize no match", tp.ErrInvalid, func() error {
				return tp.Parallelize(ctx, mlp, "tp", tp.Plan{{Pattern: "fx", Style: tp.ColwiseParallel{}}})
			}},
			{"FullyShard no match", fsdp.ErrInvalid, func() error { _, err := fsdp.FullyShard(ctx, mlp, []string{"nothing"}); return err }},
			{"Checkpoint no patterns", parallel.ErrInvalid, func() error { return parallel.Checkpoint(mlp, nil) }},
			{"Checkpoint no match", parallel.ErrInvalid, func() error { return parallel.Checkpoint(mlp, []string{"nothing"}) }},
			{"NewLinear dims", parallel.ErrInvalid, func() error { _, err := parallel.NewLinear(tape, m, 0, 3); return err }},
			{"NewLinear nil", parallel.ErrInvalid, func() error { _, err := parallel.NewLinear(nil, m, 2, 3); return err }},
			{"NewLayerNorm eps", parallel.ErrInvalid, func() error { _, err := parallel.NewLayerNorm(tape, m, 4, parallel.WithEps(-1)); return err }},
			{"New no params", ddp.ErrInvalid, func() error { _, err := ddp.New(ctx, nil); return err }},
			{"New bucket", ddp.ErrInvalid, func() error { _, err := ddp.New(ctx, params, ddp.WithBucketCap(0)); return err }},
			{"SetScale", ddp.ErrInvalid, func() error { return dd.SetScale(math.NaN()) }},
			{"fsdp.New ReshardTo", fsdp.ErrInvalid, func() error { _, err := fsdp.New(ctx, m, fsdp.WithReshardTo(0)); return err }},
			{"fsdp.New divide", fsdp.ErrInvalid, func() error { _, err := fsdp.New(ctx, m, fsdp.WithGradientDivideFactor(-1)); return err }},
			{"NewDropout", parallel.ErrInvalid, func() error { _, err := parallel.NewDropout(1.5, 1); return err }},
			{"Dropout nil input", parallel.ErrInvalid, func() error { _, err := (&parallel.Dropout{P: 0.5}).Forward(ctx, nil); return err }},
			{"Linear nil input", nil, func() error { _, err := mlp.FC.Forward(ctx, nil); return err }},
		}
		var errs []error
		for _, c := range cases {
			err := c.err()
			msg := ""
			if err != nil {
				msg = err.Error()
			}
			switch {
			case !errors.Is(err, loom.ErrInvalid):
				errs = append(errs, errors.New(c.name+": "+msg+": does not match loom.ErrInvalid"))
			case c.pkg != nil && !errors.Is(err, c.pkg):
				errs = append(errs, errors.New(c.name+": "+msg+": does not match "+c.pkg.Error()))
			default:
				prefix := "parallel:"
				switch c.pkg {
				case tp.ErrInvalid:
					prefix = "tp:"
				case ddp.ErrInvalid:
					prefix = "ddp:"
				case fsdp.ErrInvalid:
					prefix = "fsdp:"
				}
				n := 0
				for _, p := range []string{"parallel:", "tp:", "ddp:", "fsdp:"} {
					n += strings.Count(msg, p)
				}
				if !strings.HasPrefix(msg, prefix+" ") || n != 1 {
					errs = append(errs, errors.New(c.name+": "+msg+": want one \""+prefix+" \", in front, and no other package's prefix"))
				}
			}
		}
		return errors.Join(errs...)
	})
}
