package placement_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestBalancedPositions: rank r of k holds chunks r and 2k−1−r of the
// 2k chunks, every index exactly once, for lengths that divide 2k and
// that do not (uneven chunks, empty ones when the dim is short).
func TestBalancedPositions(t *testing.T) {
	for _, tc := range []struct {
		k, n int
		want [][]int // per rank; nil: only check the cover
	}{
		{2, 8, [][]int{{0, 1, 6, 7}, {2, 3, 4, 5}}},
		{3, 12, [][]int{{0, 1, 10, 11}, {2, 3, 8, 9}, {4, 5, 6, 7}}},
		{2, 9, [][]int{{0, 1, 2, 7, 8}, {3, 4, 5, 6}}},
		{4, 5, nil}, {3, 7, nil}, {4, 1, nil}, {3, 0, nil},
	} {
		placementtest.Run(t, []int{tc.k}, []string{"cp"}, func(ctx context.Context, m *mesh.Mesh) error {
			spec, err := placement.NewSpec(m, []int{2, tc.n}, comm.Float64, []placement.Placement{placement.ShardBalanced(1)})
			if err != nil {
				return err
			}
			seen := make([]int, tc.n)
			for r := range tc.k {
				p, err := spec.Positions(1, r)
				if err != nil {
					return err
				}
				if tc.want != nil && !slices.Equal(p, tc.want[r]) {
					return fmt.Errorf("k=%d n=%d: rank %d holds %v, want %v", tc.k, tc.n, r, p, tc.want[r])
				}
				for _, i := range p {
					seen[i]++
				}
			}
			for i, c := range seen {
				if c != 1 {
					return fmt.Errorf("k=%d n=%d: index %d held %d times", tc.k, tc.n, i, c)
				}
			}
			if _, _, err := spec.Box(0); !errors.Is(err, placement.ErrUnsupported) {
				return fmt.Errorf("Box of a balanced spec: %v, want ErrUnsupported", err)
			}
			// FromFull's local block is the rows at Positions.
			full := placementtest.Random([]int{2, tc.n}, comm.Float64, 3).([]float64)
			dt, err := placement.FromFull(spec, full)
			if err != nil {
				return err
			}
			p, _ := spec.Positions(1, m.Rank())
			local := dt.LocalData().([]float64)
			for b := range 2 {
				for i, g := range p {
					if local[b*len(p)+i] != full[b*tc.n+g] {
						return fmt.Errorf("k=%d n=%d: local row %d is not global row %d", tc.k, tc.n, i, g)
					}
				}
			}
			// FromRoot scatters the same blocks.
			var rootFull any
			if m.Rank() == 0 {
				rootFull = full
			}
			rt, err := placement.FromRoot(ctx, spec, rootFull, 0)
			if err != nil {
				return err
			}
			if !slices.Equal(rt.LocalData().([]float64), local) {
				return fmt.Errorf("k=%d n=%d: FromRoot's block differs from FromFull's", tc.k, tc.n)
			}
			return nil
		})
	}
}

// balancedCombos returns every valid placement list of combos(n, ndim)
// with each subset of its Shard placements made ShardBalanced.
func balancedCombos(n, ndim int) [][]placement.Placement {
	var out [][]placement.Placement
	for _, ps := range combos(n, ndim) {
		var shards []int
		for a, p := range ps {
			if p.IsShard() {
				shards = append(shards, a)
			}
		}
		for mask := range 1 << len(shards) {
			c := slices.Clone(ps)
			for i, a := range shards {
				if mask&(1<<i) != 0 {
					c[a] = placement.ShardBalanced(ps[a].Dim())
				}
			}
			out = append(out, c)
		}
	}
	return out
}

// TestRoundTripBalanced is TestRoundTripExhaustive with ShardBalanced:
// every pair of placements, balanced or not, Partial included, on 1-D
// and 2-D meshes with lengths that divide 2·k and that do not, on the
// host and the emulated device.
func TestRoundTripBalanced(t *testing.T) {
	cases := []struct {
		mesh  []int
		shape []int
	}{
		{[]int{2}, []int{8, 3}},
		{[]int{2}, []int{5, 3}},
		{[]int{3}, []int{7, 2}},
		{[]int{4}, []int{2, 9}},
		{[]int{2, 2}, []int{9, 4}},
		{[]int{2, 3}, []int{5, 12}},
	}
	if testing.Short() {
		cases = cases[:4]
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.mesh, tc.shape), func(t *testing.T) {
			all := balancedCombos(len(tc.mesh), len(tc.shape))
			planners := []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)}
			runDevices(t, tc.mesh, names(len(tc.mesh)), func(ctx context.Context, m *mesh.Mesh) error {
				seed := uint64(0)
				pairs := 0
				for _, sp := range all {
					src, err := placement.NewSpec(m, tc.shape, comm.Float64, sp)
					if err != nil {
						continue // a balanced axis inside another: refused (TestBalancedOutermost)
					}
					for _, dp := range all {
						dst, err := placement.NewSpec(m, tc.shape, comm.Float64, dp)
						if err != nil {
							continue
						}
						seed += 7
						pairs++
						if err := roundTrip(ctx, planners[seed%2], src, dst, seed, 1e-12); err != nil {
							return err
						}
					}
				}
				if pairs == 0 {
					return fmt.Errorf("no pairs")
				}
				return nil
			})
		})
	}
}

// TestBalancedOutermost: a balanced axis inside another axis of its dim
// is refused, naming the order.
func TestBalancedOutermost(t *testing.T) {
	placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, err := placement.NewSpec(m, []int{8}, comm.Float64, []placement.Placement{placement.Shard(0), placement.ShardBalanced(0)})
		if !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("balanced inner axis: %v, want ErrInvalid", err)
		}
		if _, err := placement.NewSpec(m, []int{8}, comm.Float64, []placement.Placement{placement.ShardBalanced(0), placement.Shard(0)}); err != nil {
			return fmt.Errorf("balanced outer axis: %w", err)
		}
		return nil
	})
}
