package fsdp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestShardAxesParity: FSDP over flattened axes (WithShardAxes) trains
// the net as one rank does, in float64 to TestFSDPParity's 1e-9: the
// batch sharded over both axes (gradients Partial on both, reduce-scattered
// over the 4-rank group), the axes flattened against mesh order, HSDP
// beside them with one of them holding Replicate data (its gradients
// Replicate there: counted once), and WithReshardTo over the flattened
// group. The net's widths (5, 7, 3) split unevenly over 2×2, so the
// shards follow the nested chunk rule of their placements, which Full
// reads back.
func TestShardAxesParity(t *testing.T) {
	const steps = 3
	f64 := comm.Float64
	cases := []trainCase{
		{name: "dp×fsdp", shape: []int{2, 2}, names: []string{"dp", "fsdp"}, dt: f64, opts: []Option{WithShardAxes("dp", "fsdp")}},
		{name: "fsdp×dp against mesh order", shape: []int{2, 2}, names: []string{"dp", "fsdp"}, dt: f64, opts: []Option{WithShardAxes("fsdp", "dp")}},
		{name: "hsdp over fsdp×cp", shape: []int{2, 2, 2}, names: []string{"dp", "fsdp", "cp"}, dt: f64, opts: []Option{WithShardAxes("fsdp", "cp"), WithReplicateAxis("dp")}},
		{name: "reshard to 2 of 2×2", shape: []int{2, 2}, names: []string{"dp", "fsdp"}, dt: f64, opts: []Option{WithShardAxes("dp", "fsdp"), WithReshardTo(2)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			wantLoss, wantParams := train(t, c, false, steps)
			gotLoss, gotParams := train(t, c, true, steps)
			for s := range steps {
				if !closeTo(gotLoss[s], wantLoss[s], 1e-9) {
					t.Errorf("step %d: loss %.15g, serial %.15g", s, gotLoss[s], wantLoss[s])
				}
			}
			for name, w := range wantParams {
				g := gotParams[name]
				if len(g) != len(w) {
					t.Fatalf("%s: %d elements, serial %d", name, len(g), len(w))
				}
				for k := range w {
					if !closeTo(g[k], w[k], 1e-9) || math.IsNaN(g[k]) {
						t.Fatalf("%s[%d] = %.15g, serial %.15g", name, k, g[k], w[k])
					}
				}
			}
		})
	}
}

// TestShardAxesRefused: shard axes that cannot be flattened are refused
// by New with ErrInvalid before any communication, naming the axis.
func TestShardAxesRefused(t *testing.T) {
	placementtest.Run(t, []int{1, 1}, []string{"dp", "fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, c := range []struct {
			opts []Option
			want string
		}{
			{[]Option{WithShardAxes()}, `WithShardAxes names no axis`},
			{[]Option{WithShardAxes("fsdp", "fsdp")}, `WithShardAxes names axis "fsdp" twice`},
			{[]Option{WithShardAxes("fsdp", "cp")}, `no shard axis "cp"`},
			{[]Option{WithShardAxes("dp", "fsdp"), WithReplicateAxis("dp")}, `replicate axis "dp" distinct from the shard axes`},
		} {
			if _, err := New(ctx, m, c.opts...); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
				return fmt.Errorf("New: %v; want ErrInvalid with %q", err, c.want)
			}
		}
		return nil
	})
}
