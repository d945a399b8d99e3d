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

// TestZeroSizeRoundTrip: a global dim of 0 is an ordinary tensor with no
// elements. Every transition round-trips against the serial reference on
// 1-, 2- and 3-axis meshes: all placement pairs on 1 and 2 axes, and on 3
// axes every pair that differs on one axis (each single-axis transition
// under every background of the other two).
func TestZeroSizeRoundTrip(t *testing.T) {
	cases := []struct {
		mesh  []int
		shape []int
		all   bool // every pair; otherwise pairs differing on one axis
	}{
		{[]int{3}, []int{0}, true},
		{[]int{3}, []int{0, 2}, true},
		{[]int{2}, []int{2, 0}, true},
		{[]int{2, 3}, []int{0, 4}, true},
		{[]int{3, 2}, []int{3, 0}, true},
		{[]int{2, 2, 2}, []int{0, 3}, false},
		{[]int{2, 1, 3}, []int{2, 0}, false},
	}
	if testing.Short() {
		cases = slices.Delete(cases, 4, 6)
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.mesh, tc.shape), func(t *testing.T) {
			n := len(tc.mesh)
			all := combos(n, len(tc.shape))
			var pairs [][2][]placement.Placement
			for _, s := range all {
				for _, d := range all {
					if tc.all || differOnOne(s, d) {
						pairs = append(pairs, [2][]placement.Placement{s, d})
					}
				}
			}
			planners := []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)}
			runDevices(t, tc.mesh, names(n), func(ctx context.Context, m *mesh.Mesh) error {
				for k, pr := range pairs {
					src, err := placement.NewSpec(m, tc.shape, comm.Float64, pr[0])
					if err != nil {
						return err
					}
					dst, err := placement.NewSpec(m, tc.shape, comm.Float64, pr[1])
					if err != nil {
						return err
					}
					if err := roundTrip(ctx, planners[k%2], src, dst, uint64(k), 0); err != nil {
						return err
					}
				}
				return nil
			})
		})
	}
}

// differOnOne reports whether two placement lists differ on exactly one
// axis.
func differOnOne(a, b []placement.Placement) bool {
	n := 0
	for i := range a {
		if a[i] != b[i] {
			n++
		}
	}
	return n == 1
}

// TestZeroSizeConstructors: every way in and out of a DTensor works for a
// tensor with a zero global dim: FromFull, FromRoot (scatter and
// broadcast), FromLocal with its check, NewLocal and Full, all with empty
// slices, never nil.
func TestZeroSizeConstructors(t *testing.T) {
	shape := []int{4, 0}
	placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, ps := range [][]placement.Placement{{S0, S1}, {R, R}, {Psum, S0}} {
			s, err := placement.NewSpec(m, shape, comm.Float32, ps)
			if err != nil {
				return err
			}
			empty := []float32{}
			check := func(how string, dt *placement.DTensor) error {
				d, ok := dt.LocalData().([]float32)
				if !ok || d == nil || len(d) != 0 || !slices.Equal(dt.LocalShape(), s.LocalShape()) {
					return fmt.Errorf("%v %s: local %#v shape %v, want an empty []float32 of shape %v", ps, how, dt.LocalData(), dt.LocalShape(), s.LocalShape())
				}
				full, err := dt.Full(ctx)
				if err != nil {
					return fmt.Errorf("%v %s: Full: %w", ps, how, err)
				}
				if f, ok := full.([]float32); !ok || f == nil || len(f) != 0 {
					return fmt.Errorf("%v %s: Full = %#v, want an empty []float32", ps, how, full)
				}
				return nil
			}
			dt, err := placement.FromFull(s, empty)
			if err != nil {
				return err
			}
			if err := check("FromFull", dt); err != nil {
				return err
			}
			var root any
			if m.Rank() == 3 {
				root = empty
			}
			if dt, err = placement.FromRoot(ctx, s, root, 3); err != nil {
				return err
			}
			if err := check("FromRoot", dt); err != nil {
				return err
			}
			if dt, err = placement.FromLocal(ctx, s, empty, true); err != nil {
				return err
			}
			if err := check("FromLocal", dt); err != nil {
				return err
			}
			if dt, err = placement.FromLocal(ctx, s, nil, true); err != nil {
				return err
			}
			if err := check("FromLocal(nil)", dt); err != nil {
				return err
			}
			if dt, err = placement.NewLocal(s, nil); err != nil {
				return err
			}
			if err := check("NewLocal(nil)", dt); err != nil {
				return err
			}
			if dt, err = placement.NewLocal(s, []float32(nil)); err != nil {
				return err
			}
			if err := check("NewLocal([]float32(nil))", dt); err != nil {
				return err
			}
			// One element where none fit is still an error.
			if _, err := placement.FromFull(s, []float32{1}); !errors.Is(err, placement.ErrInvalid) {
				return fmt.Errorf("%v: FromFull with 1 element for shape %v: %v, want ErrInvalid", ps, shape, err)
			}
		}
		return nil
	})
}
