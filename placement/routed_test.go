package placement_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

var Routed = placement.Routed()

// TestRoutedRows: a Routed spec with row counts (WithRoutedRows) has a
// local shape and a box on every rank, routed groups taken row-major over
// the Routed axes in mesh order, replicas along other axes holding the same
// rows; bad counts are rejected. The same blocks wrap buffers of an
// emulated device (NewLocalOn, FromLocal), empty ones included.
func TestRoutedRows(t *testing.T) {
	ctx := context.Background()
	err := placementtest.Simulate(ctx, []int{2, 3}, []string{"dp", "ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		cases := []struct {
			name   string
			places []placement.Placement
			shape  []int
			rows   []int
			// boxes[meshRank] = {offset0, size0}
			boxes [][2]int
		}{
			{"routed on both", []placement.Placement{Routed, Routed}, []int{10, 4}, []int{1, 0, 3, 2, 4, 0},
				[][2]int{{0, 1}, {1, 0}, {1, 3}, {4, 2}, {6, 4}, {10, 0}}},
			{"routed on ep, replicated on dp", []placement.Placement{R, Routed}, []int{5, 4}, []int{2, 0, 3},
				[][2]int{{0, 2}, {2, 0}, {2, 3}, {0, 2}, {2, 0}, {2, 3}}},
			{"routed on ep, columns sharded on dp", []placement.Placement{S1, Routed}, []int{5, 4}, []int{2, 0, 3},
				[][2]int{{0, 2}, {2, 0}, {2, 3}, {0, 2}, {2, 0}, {2, 3}}},
			{"no rows anywhere", []placement.Placement{R, Routed}, []int{0, 4}, []int{0, 0, 0},
				[][2]int{{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}}},
		}
		for _, tc := range cases {
			s, err := placement.NewSpec(m, tc.shape, comm.Float32, tc.places, placement.WithRoutedRows(tc.rows))
			if err != nil {
				return fmt.Errorf("%s: %w", tc.name, err)
			}
			if !slices.Equal(s.RoutedRows(), tc.rows) {
				return fmt.Errorf("%s: rows %v", tc.name, s.RoutedRows())
			}
			for r, want := range tc.boxes {
				off, size, err := s.Box(r)
				if err != nil {
					return fmt.Errorf("%s: Box(%d): %w", tc.name, r, err)
				}
				if off[0] != want[0] || size[0] != want[1] {
					return fmt.Errorf("%s: rank %d holds rows [%d, +%d), want [%d, +%d)", tc.name, r, off[0], size[0], want[0], want[1])
				}
				if tc.places[0] == S1 && size[1] != 2 {
					return fmt.Errorf("%s: rank %d holds %d columns, want 2", tc.name, r, size[1])
				}
			}
			local := s.LocalShape()
			data := make([]float32, local[0]*local[1])
			dt, err := placement.NewLocal(s, data)
			if err != nil {
				return fmt.Errorf("%s: NewLocal: %w", tc.name, err)
			}
			if _, err := placement.Redistribute(ctx, dt, s); !errors.Is(err, placement.ErrUnsupported) {
				return fmt.Errorf("%s: Redistribute of a Routed tensor: %v, want ErrUnsupported", tc.name, err)
			}
			// The same block on the rank's device (empty ones included).
			d := placementtest.Device(ctx)
			buf, err := d.Alloc(comm.Float32, len(data))
			if err != nil {
				return err
			}
			on, err := placement.NewLocalOn(s, buf)
			if err != nil {
				return fmt.Errorf("%s: NewLocalOn: %w", tc.name, err)
			}
			if on.Device() != d || !slices.Equal(on.LocalShape(), local) {
				return fmt.Errorf("%s: NewLocalOn: on %s, local shape %v, want %s and %v", tc.name, on.Device().Name(), on.LocalShape(), d.Name(), local)
			}
			if _, err := placement.Redistribute(ctx, on, s); !errors.Is(err, placement.ErrUnsupported) {
				return fmt.Errorf("%s: Redistribute of a Routed tensor on %s: %v, want ErrUnsupported", tc.name, d.Name(), err)
			}
			if c, err := placement.FromLocal(ctx, s, buf, true); err != nil || c.Device() != d {
				return fmt.Errorf("%s: FromLocal of a device buffer: %v", tc.name, err)
			}
			gs, err := placement.GradSpec(s)
			if err != nil || !gs.Equal(s) {
				return fmt.Errorf("%s: GradSpec %v (%v), want the spec itself", tc.name, gs, err)
			}
			other, _ := placement.NewSpec(m, tc.shape, comm.Float32, tc.places, placement.WithRoutedRows(tc.rows))
			if !other.Equal(s) || !strings.Contains(s.String(), "rows") {
				return fmt.Errorf("%s: equal specs differ or String %q lacks rows", tc.name, s)
			}
		}
		// Different row counts are a different layout.
		a, _ := placement.NewSpec(m, []int{3, 2}, comm.Float32, []placement.Placement{R, Routed}, placement.WithRoutedRows([]int{1, 1, 1}))
		b, _ := placement.NewSpec(m, []int{3, 2}, comm.Float32, []placement.Placement{R, Routed}, placement.WithRoutedRows([]int{3, 0, 0}))
		if a.Equal(b) {
			return fmt.Errorf("specs with rows [1 1 1] and [3 0 0] are equal")
		}
		return nil
	}, placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) }))
	if err != nil {
		t.Fatal(err)
	}
}

// TestRoutedRowsErrors: row counts that do not fit the spec are
// ErrInvalid; a Routed spec without counts still has no box and cannot
// hold data.
func TestRoutedRowsErrors(t *testing.T) {
	err := placementtest.Simulate(context.Background(), []int{2, 2}, []string{"dp", "ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		cases := []struct {
			name   string
			shape  []int
			places []placement.Placement
			opts   []placement.SpecOption
			text   string
		}{
			{"rows without Routed", []int{4, 2}, []placement.Placement{S0, R}, []placement.SpecOption{placement.WithRoutedRows([]int{2, 2})}, "no placement"},
			{"too few counts", []int{4, 2}, []placement.Placement{Routed, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{2, 2})}, "4 groups"},
			{"negative count", []int{4, 2}, []placement.Placement{R, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{5, -1})}, "-1 rows"},
			{"counts do not sum", []int{4, 2}, []placement.Placement{R, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{1, 2})}, "sum to 3"},
			{"dim 0 also sharded", []int{4, 2}, []placement.Placement{S0, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{2, 2})}, "shard dim 0"},
			{"scalar", []int{}, []placement.Placement{R, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{0, 0})}, "at least one dim"},
			{"given twice", []int{4, 2}, []placement.Placement{R, Routed}, []placement.SpecOption{placement.WithRoutedRows([]int{2, 2}), placement.WithRoutedRows([]int{2, 2})}, "twice"},
			{"negative dim", []int{-1, 2}, []placement.Placement{R, Routed}, nil, "dim 0 is -1"},
		}
		for _, tc := range cases {
			_, err := placement.NewSpec(m, tc.shape, comm.Float32, tc.places, tc.opts...)
			if !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), tc.text) {
				return fmt.Errorf("%s: error %v, want ErrInvalid containing %q", tc.name, err, tc.text)
			}
		}
		bare, err := placement.NewSpec(m, []int{4, 2}, comm.Float32, []placement.Placement{R, Routed})
		if err != nil {
			return err
		}
		if _, _, err := bare.Box(0); !errors.Is(err, placement.ErrUnsupported) {
			return fmt.Errorf("Box of a Routed spec without rows: %v", err)
		}
		if _, err := placement.NewLocal(bare, make([]float32, 8)); !errors.Is(err, placement.ErrUnsupported) {
			return fmt.Errorf("NewLocal of a Routed spec without rows: %v", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestRoutedInner: Inner pairs two Routed tensors with the same rows (the
// adjoint test of dispatch and combine needs it) and rejects different
// rows.
func TestRoutedInner(t *testing.T) {
	placementtest.Run(t, []int{3}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		rows := []int{2, 0, 1}
		s, err := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{Routed}, placement.WithRoutedRows(rows))
		if err != nil {
			return err
		}
		n := rows[m.Rank()] * 2
		a, b := make([]float64, n), make([]float64, n)
		for i := range a {
			a[i], b[i] = float64(m.Rank()+1), float64(i+1)
		}
		da, _ := placement.NewLocal(s, a)
		db, _ := placement.NewLocal(s, b)
		got, err := placement.Inner(ctx, da, db)
		if err != nil {
			return err
		}
		// rank 0: 1·(1+2+3+4), rank 2: 3·(1+2).
		if got != 10+9 {
			return fmt.Errorf("inner %v, want 19", got)
		}
		s2, _ := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{Routed}, placement.WithRoutedRows([]int{1, 1, 1}))
		dc, _ := placement.NewLocal(s2, make([]float64, 2))
		if _, err := placement.Inner(ctx, da, dc); !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("inner of different rows: %v", err)
		}
		return nil
	})
}
