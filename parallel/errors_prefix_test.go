package parallel

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestErrorsSayPackageOnce: invalid-argument errors of the package's entry
// points match loom.ErrInvalid, start with "parallel: " and say it once
// (the sentinel's text carries the prefix, so a call site that added it
// again printed "parallel: FullyShard: parallel: invalid argument: ...").
func TestErrorsSayPackageOnce(t *testing.T) {
	placementtest.Run(t, []int{1, 1, 2}, []string{"dp", "fsdp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		mlp, err := NewMLP(tape, m, 4, 8, WithName("mlp"))
		if err != nil {
			return err
		}
		params, err := Params(mlp)
		if err != nil {
			return err
		}
		ddp, err := New(ctx, params)
		if err != nil {
			return err
		}
		cases := []struct {
			name string
			err  func() error
		}{
			{"Parallelize axis", func() error { return Parallelize(ctx, mlp, "model", Plan{{"fc", ColwiseParallel{}}}) }},
			{"Parallelize no match", func() error { return Parallelize(ctx, mlp, "tp", Plan{{"fx", ColwiseParallel{}}}) }},
			{"FullyShard no match", func() error { _, err := FullyShard(ctx, mlp, []string{"nothing"}); return err }},
			{"Checkpoint no patterns", func() error { return Checkpoint(mlp, nil) }},
			{"Checkpoint no match", func() error { return Checkpoint(mlp, []string{"nothing"}) }},
			{"NewLinear dims", func() error { _, err := NewLinear(tape, m, 0, 3); return err }},
			{"NewLinear nil", func() error { _, err := NewLinear(nil, m, 2, 3); return err }},
			{"NewLayerNorm eps", func() error { _, err := NewLayerNorm(tape, m, 4, WithEps(-1)); return err }},
			{"New no params", func() error { _, err := New(ctx, nil); return err }},
			{"New bucket", func() error { _, err := New(ctx, params, WithBucketCap(0)); return err }},
			{"SetScale", func() error { return ddp.SetScale(math.NaN()) }},
			{"NewFSDP ReshardTo", func() error { _, err := NewFSDP(ctx, m, ReshardTo(0)); return err }},
			{"NewFSDP divide", func() error { _, err := NewFSDP(ctx, m, GradientDivideFactor(-1)); return err }},
			{"NewDropout", func() error { _, err := NewDropout(1.5, 1); return err }},
			{"Dropout nil input", func() error { _, err := (&Dropout{P: 0.5}).Forward(ctx, nil); return err }},
			{"Linear nil input", func() error { _, err := mlp.FC.Forward(ctx, nil); return err }},
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
			case !strings.HasPrefix(msg, "parallel: ") || strings.Count(msg, "parallel:") != 1:
				errs = append(errs, errors.New(c.name+": "+msg+": want one \"parallel: \", in front"))
			}
		}
		return errors.Join(errs...)
	})
}
