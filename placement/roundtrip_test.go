package placement_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// TestRoundTripExhaustive checks Full(Redistribute(Distribute(x, src),
// dst)) == x for every pair of placements on small 1-D and 2-D meshes,
// with uneven and empty shards.
func TestRoundTripExhaustive(t *testing.T) {
	cases := []struct {
		mesh  []int
		shape []int
	}{
		{[]int{1}, []int{3, 2}},
		{[]int{2}, []int{3, 1}},
		{[]int{3}, []int{2, 5}},
		{[]int{5}, []int{7}},
		{[]int{2, 2}, []int{3, 5}},
		{[]int{2, 3}, []int{5, 2}},
	}
	if testing.Short() {
		cases = cases[:4]
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.mesh, tc.shape), func(t *testing.T) {
			n := len(tc.mesh)
			all := combos(n, len(tc.shape))
			// Without a model the planner prefers fewer collectives (direct
			// all-to-all-v); with a latency-heavy model, per-axis steps.
			planners := []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)}
			runDevices(t, tc.mesh, names(n), func(ctx context.Context, m *mesh.Mesh) error {
				seed := uint64(0)
				for _, sp := range all {
					src, err := placement.NewSpec(m, tc.shape, comm.Float64, sp)
					if err != nil {
						return err
					}
					for _, dp := range all {
						dst, err := placement.NewSpec(m, tc.shape, comm.Float64, dp)
						if err != nil {
							return err
						}
						seed += 7
						if err := roundTrip(ctx, planners[seed%2], src, dst, seed, 1e-9); err != nil {
							return err
						}
					}
				}
				return nil
			})
		})
	}
}

// TestRoundTripRandom draws random meshes (1 to 3 axes, 1 to 8 ranks per
// axis, at most 8 ranks), shapes (dims smaller than axis sizes included),
// shard orders and placement pairs.
func TestRoundTripRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	meshes := 16
	pairs := 40
	if testing.Short() {
		meshes, pairs = 4, 10
	}
	fixed := [][]int{{2, 2, 2}, {2, 1, 3}, {1, 8}, {3, 2}, {8}, {2, 3, 1}, {7, 1}}
	for i := range meshes {
		msh := randomMesh(rng)
		if i < len(fixed) {
			msh = fixed[i]
		}
		ndim := 1 + rng.IntN(3)
		shape := make([]int, ndim)
		for d := range shape {
			shape[d] = 1 + rng.IntN(7)
		}
		dt := comm.Float64
		tol := 1e-9
		if i%2 == 1 {
			dt, tol = comm.Float32, 2e-5
		}
		all := combos(len(msh), ndim)
		type pair struct {
			src, dst []placement.Placement
			so, do   uint64
		}
		ps := make([]pair, pairs)
		for k := range ps {
			ps[k] = pair{all[rng.IntN(len(all))], all[rng.IntN(len(all))], rng.Uint64(), rng.Uint64()}
		}
		t.Run(fmt.Sprint(msh, shape, dt), func(t *testing.T) {
			planner := placement.NewPlanner(nil)
			if i%3 == 0 {
				planner = placement.NewPlanner(testModel)
			}
			runDevices(t, msh, names(len(msh)), func(ctx context.Context, m *mesh.Mesh) error {
				for k, p := range ps {
					src, err := placement.NewSpec(m, shape, dt, p.src, orderOpts(m, p.src, ndim, rand.New(rand.NewPCG(p.so, 0)))...)
					if err != nil {
						return err
					}
					dst, err := placement.NewSpec(m, shape, dt, p.dst, orderOpts(m, p.dst, ndim, rand.New(rand.NewPCG(p.do, 0)))...)
					if err != nil {
						return err
					}
					if err := roundTrip(ctx, planner, src, dst, uint64(k)*13+5, tol); err != nil {
						return err
					}
				}
				return nil
			})
		})
	}
}

// randomMesh draws 1 to 3 axes of 1 to 8 ranks each, at most 8 in all.
func randomMesh(rng *rand.Rand) []int {
	for {
		n := 1 + rng.IntN(3)
		s := make([]int, n)
		total := 1
		for i := range s {
			s[i] = 1 + rng.IntN(8)
			total *= s[i]
		}
		if total <= 8 {
			return s
		}
	}
}
