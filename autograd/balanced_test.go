package autograd

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestBalancedRules: rules that renumber dims keep a load-balanced shard
// balanced (a plain Shard there would silently mislabel the rows), a
// reshape that would merge or split a balanced dim is refused, and the
// values agree with the serial computation.
func TestBalancedRules(t *testing.T) {
	B := placement.ShardBalanced
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		x, err := random(m, []int{2, 6, 4}, pl{B(1)}, 3)
		if err != nil {
			return err
		}
		full, err := x.Full(ctx)
		if err != nil {
			return err
		}
		tp := NewTape()
		v, err := tp.Param("x", x)
		if err != nil {
			return err
		}
		for _, c := range []struct {
			name string
			f    func(*Value) (*Value, error)
			want placement.Placement
			ref  func([]float64) []float64
		}{
			{"permute", func(v *Value) (*Value, error) { return Permute(v, 1, 0, 2) }, B(0), func(f []float64) []float64 {
				out := make([]float64, len(f))
				for b := range 2 {
					for i := range 6 {
						copy(out[(i*2+b)*4:(i*2+b+1)*4], f[(b*6+i)*4:(b*6+i+1)*4])
					}
				}
				return out
			}},
			{"sum", func(v *Value) (*Value, error) { return Sum(v, 0) }, B(0), func(f []float64) []float64 {
				out := make([]float64, 24)
				for b := range 2 {
					for i := range 24 {
						out[i] += f[b*24+i]
					}
				}
				return out
			}},
			{"reshape", func(v *Value) (*Value, error) { return Reshape(v, 2, 6, 2, 2) }, B(1), func(f []float64) []float64 { return f }},
		} {
			y, err := c.f(v)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			if p := y.Spec().Placements()[0]; p != c.want {
				return fmt.Errorf("%s: result is %v, want %v", c.name, p, c.want)
			}
			if err := placementtest.CheckFull(ctx, y.Data(), c.ref(full.([]float64)), 1e-12); err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
		}
		if _, err := Reshape(v, 12, 4); !errors.Is(err, ErrRule) && !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("reshape merging the balanced dim: %v, want a rule error", err)
		}
		if _, err := Reshape(v, 2, 3, 2, 4); err == nil {
			return fmt.Errorf("reshape splitting the balanced dim: no error")
		}
		return nil
	})
}

// TestBalancedIndices: IndicesFromFull lays position ids out by a
// load-balanced placement: each rank's ids are the positions it holds.
func TestBalancedIndices(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		const b, n = 2, 8
		full := make([]int64, b*n)
		for i := range full {
			full[i] = int64(i % n)
		}
		ids, err := IndicesFromFull(m, []int{b, n}, pl{placement.ShardBalanced(1)}, full)
		if err != nil {
			return err
		}
		want := [][]int64{{0, 1, 6, 7, 0, 1, 6, 7}, {2, 3, 4, 5, 2, 3, 4, 5}}[m.Rank()]
		if got := ids.Local(); fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("position ids %v, want %v", got, want)
		}
		return nil
	})
}
