package placement_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestBadInput: every malformed request is an error wrapping a sentinel,
// before any data moves.
func TestBadInput(t *testing.T) {
	m := rank0Mesh(t, []int{2, 2}, []string{"dp", "tp"})
	other := rank0Mesh(t, []int{2, 2}, []string{"dp", "tp"}) // another world
	cases := []struct {
		name string
		err  func() error
		want error
		text string
	}{
		{"shard dim out of range", func() error {
			_, err := placement.NewSpec(m, []int{4, 4}, comm.Float32, []placement.Placement{S2, R})
			return err
		}, placement.ErrInvalid, "shard dim 2 out of range"},
		{"negative shard dim", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{placement.Shard(-1), R})
			return err
		}, placement.ErrInvalid, "shard dim -1"},
		{"placement count", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{R})
			return err
		}, placement.ErrInvalid, "1 placements"},
		{"zero placement", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{{}, R})
			return err
		}, placement.ErrInvalid, "zero or unknown placement"},
		{"prod partial", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{placement.Partial(comm.Prod), R})
			return err
		}, placement.ErrInvalid, "prod"},
		{"mixed max and sum", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{Pmax, Psum})
			return err
		}, placement.ErrInvalid, "mix"},
		{"negative global dim", func() error {
			_, err := placement.NewSpec(m, []int{4, -1}, comm.Float32, []placement.Placement{R, R})
			return err
		}, placement.ErrInvalid, "dim 1 is -1"},
		{"dtype", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Int32, []placement.Placement{R, R})
			return err
		}, placement.ErrInvalid, "int32"},
		{"bad order axes", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{S0, R}, placement.WithOrder(0, "tp", "dp"))
			return err
		}, placement.ErrInvalid, "WithOrder(0)"},
		{"unknown order axis", func() error {
			_, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{S0, S0}, placement.WithOrder(0, "pp", "dp"))
			return err
		}, placement.ErrInvalid, `unknown mesh axis "pp"`},
		{"tensor on another mesh", func() error {
			src := mustSpec(t, m, []int{4}, []placement.Placement{S0, R})
			dt, err := placement.FromFull(src, placementtest.Random([]int{4}, comm.Float32, 1))
			if err != nil {
				return err
			}
			_, err = placement.Redistribute(context.Background(), dt, mustSpec(t, other, []int{4}, []placement.Placement{R, R}))
			return err
		}, placement.ErrInvalid, "another world"},
		{"shape differs", func() error {
			_, err := placement.NewPlanner(nil).Plan(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), mustSpec(t, m, []int{5}, []placement.Placement{S0, R}))
			return err
		}, placement.ErrInvalid, "global shapes differ"},
		{"full of the wrong shape", func() error {
			_, err := placement.FromFull(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), placementtest.Random([]int{5}, comm.Float32, 1))
			return err
		}, placement.ErrInvalid, "5 elements, shape [4] holds 4"},
		{"full of the wrong dtype", func() error {
			_, err := placement.FromFull(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), placementtest.Random([]int{4}, comm.Float64, 1))
			return err
		}, placement.ErrInvalid, "float64"},
		{"full of another type", func() error {
			_, err := placement.FromFull(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), []int{1, 2, 3, 4})
			return err
		}, placement.ErrInvalid, "[]int"},
		{"nil full", func() error {
			_, err := placement.FromFull(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), nil)
			return err
		}, placement.ErrInvalid, "nil full data"},
		{"routed", func() error {
			_, err := placement.NewPlanner(nil).Plan(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), mustSpec(t, m, []int{4}, []placement.Placement{placement.Routed(), R}))
			return err
		}, placement.ErrUnsupported, "MoE"},
		{"plan applied to another layout", func() error {
			p := placement.NewPlanner(nil)
			pl, _ := p.Plan(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), mustSpec(t, m, []int{4}, []placement.Placement{R, R}))
			dt, _ := placement.FromFull(mustSpec(t, m, []int{4}, []placement.Placement{R, S0}), placementtest.Random([]int{4}, comm.Float32, 1))
			_, err := p.Execute(context.Background(), pl, dt, nil)
			return err
		}, placement.ErrInvalid, "plan starts from"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.err()
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("error %v, want %v containing %q", err, tc.want, tc.text)
			}
		})
	}
}

// TestFromLocalCheck: global shapes (or placements) that differ across
// ranks are an ErrMismatch on every rank, found by the fingerprint
// all-gather before any data moves; a local block of the wrong shape is an
// ErrInvalid on every rank.
func TestFromLocalCheck(t *testing.T) {
	errs := make([]error, 4)
	_ = placementtest.Simulate(context.Background(), []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		shape := []int{8, 2}
		if m.Rank() == 2 {
			shape = []int{9, 2} // this rank believes another global shape
		}
		s, err := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{S0})
		if err != nil {
			return err
		}
		_, errs[m.Rank()] = placement.FromLocal(ctx, s, placementtest.Random(s.LocalShape(), comm.Float64, 1), true)
		return nil
	})
	for r, err := range errs {
		if !errors.Is(err, placement.ErrMismatch) || !strings.Contains(err.Error(), "[2]") {
			t.Errorf("rank %d: %v, want ErrMismatch naming mesh rank 2", r, err)
		}
	}
	_ = placementtest.Simulate(context.Background(), []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		s, _ := placement.NewSpec(m, []int{7, 2}, comm.Float64, []placement.Placement{S0})
		ls := s.LocalShape() // 2,2,2,1 rows
		if m.Rank() == 1 {
			ls[0]++
		}
		_, errs[m.Rank()] = placement.FromLocal(ctx, s, placementtest.Random(ls, comm.Float64, 1), true)
		return nil
	})
	for r, err := range errs {
		if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "[1]") {
			t.Errorf("rank %d: %v, want ErrInvalid naming mesh rank 1", r, err)
		}
	}
	// The planner's consistency check catches ranks asking for different
	// destinations.
	_ = placementtest.Simulate(context.Background(), []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		p := placement.NewPlanner(nil, placement.WithCheckConsistency())
		src, _ := placement.NewSpec(m, []int{4}, comm.Float64, []placement.Placement{S0})
		dp := R
		if m.Rank() == 1 {
			dp = Psum
		}
		dst, _ := placement.NewSpec(m, []int{4}, comm.Float64, []placement.Placement{dp})
		dt, _ := placement.FromFull(src, placementtest.Random([]int{4}, comm.Float64, 1))
		_, errs[m.Rank()] = p.Redistribute(ctx, dt, dst)
		return nil
	})
	for r, err := range errs[:2] {
		if !errors.Is(err, placement.ErrMismatch) {
			t.Errorf("consistency check, rank %d: %v", r, err)
		}
	}
}

// TestFromRoot distributes from one rank by scatter or broadcast, including
// uneven and empty shards, and rejects a bad tensor on root everywhere.
func TestFromRoot(t *testing.T) {
	shape := []int{5, 3}
	x := placementtest.Random(shape, comm.Float32, 9)
	for _, ps := range [][]placement.Placement{{S0, S1}, {R, R}, {Psum, S0}, {S1, Pmax}} {
		t.Run(fmt.Sprint(ps), func(t *testing.T) {
			placementtest.Run(t, []int{2, 3}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
				s, err := placement.NewSpec(m, shape, comm.Float32, ps)
				if err != nil {
					return err
				}
				var full any // read on root only
				if m.Rank() == 4 {
					full = x
				}
				dt, err := placement.FromRoot(ctx, s, full, 4)
				if err != nil {
					return err
				}
				ref, _ := placement.FromFull(s, x)
				if err := sameLocal(dt, ref, 0); err != nil {
					return err
				}
				return placementtest.CheckFull(ctx, dt, x, 0)
			})
		})
	}
	errs := make([]error, 2)
	_ = placementtest.Simulate(context.Background(), []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		s, _ := placement.NewSpec(m, shape, comm.Float32, []placement.Placement{S0})
		_, errs[m.Rank()] = placement.FromRoot(ctx, s, placementtest.Random([]int{4, 3}, comm.Float32, 1), 0)
		return nil
	})
	for r, err := range errs {
		if !errors.Is(err, placement.ErrInvalid) {
			t.Errorf("rank %d: %v, want ErrInvalid", r, err)
		}
	}
}

// TestString shows the global shape, placements and every rank's slice.
func TestString(t *testing.T) {
	m := rank0Mesh(t, []int{2, 2}, []string{"dp", "tp"})
	s := mustSpec(t, m, []int{3, 4}, []placement.Placement{S0, S1})
	dt, err := placement.FromFull(s, placementtest.Random([]int{3, 4}, comm.Float32, 1))
	if err != nil {
		t.Fatal(err)
	}
	want := `DTensor [3 4] float32 on (dp=2, tp=2): [S(0) S(1)]
  rank 0 [0 0]: [0:2, 0:2] <- this rank
  rank 1 [0 1]: [0:2, 2:4]
  rank 2 [1 0]: [2:3, 0:2]
  rank 3 [1 1]: [2:3, 2:4]`
	if got := dt.String(); got != want {
		t.Errorf("String() =\n%s\nwant\n%s", got, want)
	}
	e := mustSpec(t, m, []int{1}, []placement.Placement{S0, R})
	de, _ := placement.FromFull(e, placementtest.Random([]int{1}, comm.Float32, 1))
	if !strings.Contains(de.String(), "rank 2 [1 0]: [1:1] (empty)") {
		t.Errorf("empty shard not shown:\n%s", de)
	}
	if de.LocalShape()[0] != 1 || len(de.LocalData().([]float32)) != 1 {
		t.Errorf("rank 0 should hold the one row, holds %v", de.LocalShape())
	}
}

// TestScalarAndEmpty: 0-d tensors (Partial losses) and tensors smaller
// than the mesh.
func TestScalarAndEmpty(t *testing.T) {
	placementtest.Run(t, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		s, err := placement.NewSpec(m, nil, comm.Float64, []placement.Placement{Psum})
		if err != nil {
			return err
		}
		x := []float64{2.5} // a scalar is one element
		dt, err := placementtest.Distribute(s, x, 3)
		if err != nil {
			return err
		}
		if err := placementtest.CheckFull(ctx, dt, x, 1e-12); err != nil {
			return err
		}
		e, _ := placement.NewSpec(m, []int{1, 2}, comm.Float64, []placement.Placement{S0})
		y := placementtest.Random([]int{1, 2}, comm.Float64, 4)
		de, err := placement.FromFull(e, y)
		if err != nil {
			return err
		}
		local, ok := de.LocalData().([]float64)
		if !ok || local == nil || (m.Rank() > 0) != (len(local) == 0) {
			return fmt.Errorf("rank %d: local data %#v for block %v", m.Rank(), de.LocalData(), de.LocalShape())
		}
		// An empty block comes back through FromLocal as an empty slice,
		// or as nil.
		de2, err := placement.FromLocal(ctx, e, de.LocalData(), true)
		if err != nil {
			return err
		}
		if err := placementtest.CheckFull(ctx, de2, y, 0); err != nil {
			return err
		}
		var block any
		if m.Rank() == 0 {
			block = de.LocalData()
		}
		de3, err := placement.FromLocal(ctx, e, block, true)
		if err != nil {
			return err
		}
		return placementtest.CheckFull(ctx, de3, y, 0)
	})
}

// TestCrossMeshTransposedView redistributes between a mesh and its
// transposed view, whose world ranks are not in order.
func TestCrossMeshTransposedView(t *testing.T) {
	placementtest.Run(t, []int{2, 3}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := m.Sub("tp", "dp")
		if err != nil {
			return err
		}
		p := placement.NewPlanner(nil)
		for i, pair := range [][2][]placement.Placement{{{S0, S1}, {S0, S1}}, {{S0, R}, {R, S0}}, {{Psum, S0}, {S1, Pavg}}} {
			src, _ := placement.NewSpec(m, []int{5, 4}, comm.Float64, pair[0])
			dst, _ := placement.NewSpec(tr, []int{5, 4}, comm.Float64, pair[1])
			if err := roundTrip(ctx, p, src, dst, uint64(i), 1e-9); err != nil {
				return err
			}
		}
		return nil
	})
}

// TestDifferentRankSets: meshes over different world ranks are rejected.
func TestDifferentRankSets(t *testing.T) {
	w, _ := local.NewWorld(4)
	m, _ := mesh.New(w.Comm(0), []int{2, 2}, []string{"a", "b"})
	sub, _ := m.Sub("b")
	_, err := placement.NewPlanner(nil).Plan(mustSpec(t, m, []int{4}, []placement.Placement{S0, R}), mustSpec(t, sub, []int{4}, []placement.Placement{S0}))
	if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "different world ranks") {
		t.Errorf("got %v", err)
	}
}
