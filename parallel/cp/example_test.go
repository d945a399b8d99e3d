package cp_test

import (
	"context"
	"fmt"
	"math"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Ring attention on two in-process ranks over a load-balanced sequence of
// 8 positions, checked against one rank's attention.
func Example() {
	shape := []int{1, 2, 8, 4} // [batch, heads, T, Dh]
	full := placementtest.Random(shape, comm.Float64, 1).([]float64)
	err := placementtest.Simulate(context.Background(), []int{2}, []string{"cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		run := func(p placement.Placement, f func(q *autograd.Value) (*autograd.Value, error)) ([]float64, error) {
			spec, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{p})
			if err != nil {
				return nil, err
			}
			d, err := placement.FromFull(spec, full)
			if err != nil {
				return nil, err
			}
			q, err := autograd.NewTape().Param("x", d)
			if err != nil {
				return nil, err
			}
			y, err := f(q)
			if err != nil {
				return nil, err
			}
			out, err := y.Data().Full(ctx)
			if err != nil {
				return nil, err
			}
			return out.([]float64), nil
		}
		got, err := run(placement.ShardBalanced(2), func(x *autograd.Value) (*autograd.Value, error) {
			return cp.Attention(ctx, x, x, x, "cp", cp.WithMethod(cp.Ring))
		})
		if err != nil {
			return err
		}
		want, err := run(placement.Replicate(), func(x *autograd.Value) (*autograd.Value, error) {
			return autograd.CausalAttention(x, x, x)
		})
		if err != nil {
			return err
		}
		bal, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{placement.ShardBalanced(2)})
		if err != nil {
			return err
		}
		p, err := bal.Positions(2, m.Rank())
		if err != nil {
			return err
		}
		diff := 0.0
		for i := range want {
			diff = math.Max(diff, math.Abs(got[i]-want[i]))
		}
		if m.Rank() == 0 {
			fmt.Printf("rank 0 holds positions %v; largest difference from one rank < 1e-12: %v\n", p, diff < 1e-12)
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output: rank 0 holds positions [0 1 6 7]; largest difference from one rank < 1e-12: true
}
