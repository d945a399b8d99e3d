package placementtest_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

var errBoom = errors.New("boom")

// TestSimulateReportsOnce: a failure names its rank and coordinate and is
// said once, however many ranks it stops or share it.
func TestSimulateReportsOnce(t *testing.T) {
	barrier := func(ctx context.Context, m *mesh.Mesh) error {
		c, err := m.Group(ctx)
		if err != nil {
			return err
		}
		return comm.Barrier(ctx, c)
	}
	cases := []struct {
		name string
		fn   func(ctx context.Context, m *mesh.Mesh) error
		want []string // each must appear exactly once
		not  []string // must not appear
	}{
		{"one rank fails, the others wait in a collective", func(ctx context.Context, m *mesh.Mesh) error {
			if m.Rank() == 4 {
				return fmt.Errorf("element 3: %w", errBoom)
			}
			return barrier(ctx, m)
		}, []string{"rank 4 (dp=1 tp=1): element 3: boom", "ranks 0, 1, 2, 3, 5: stopped because a failing rank aborted the mesh"}, []string{"rank 0 ("}},
		{"every rank fails alike", func(ctx context.Context, m *mesh.Mesh) error {
			return fmt.Errorf("bad spec: %w", errBoom)
		}, []string{"ranks 0, 1, 2, 3, 4, 5: bad spec: boom"}, []string{"stopped"}},
		{"ranks fail differently", func(ctx context.Context, m *mesh.Mesh) error {
			if m.Rank()%2 == 0 {
				return fmt.Errorf("even: %w", errBoom)
			}
			return fmt.Errorf("odd: %w", errBoom)
		}, []string{"ranks 0, 2, 4: even: boom", "ranks 1, 3, 5: odd: boom"}, nil},
		{"a panic is its rank's error", func(ctx context.Context, m *mesh.Mesh) error {
			if m.Rank() == 1 {
				var p []int
				_ = p[3] // index out of range
			}
			return barrier(ctx, m)
		}, []string{"rank 1 (dp=0 tp=1): panic: runtime error: index out of range"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := placementtest.Simulate(context.Background(), []int{2, 3}, []string{"dp", "tp"}, tc.fn)
			if err == nil {
				t.Fatal("no error")
			}
			msg := err.Error()
			for _, w := range tc.want {
				if n := strings.Count(msg, w); n != 1 {
					t.Errorf("%q appears %d times in\n%s", w, n, msg)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(msg, w) {
					t.Errorf("%q appears in\n%s", w, msg)
				}
			}
			if strings.Contains(tc.name, "panic") {
				return
			}
			if !errors.Is(err, errBoom) {
				t.Errorf("errors.Is(err, errBoom) is false for %v", err)
			}
			if strings.Contains(tc.name, "collective") && !errors.Is(err, comm.ErrAborted) {
				t.Errorf("the stopped ranks' errors are not visible to errors.Is: %v", err)
			}
		})
	}
	if err := placementtest.Simulate(context.Background(), []int{2, 0}, nil, nil); err == nil || !strings.Contains(err.Error(), "positive") {
		t.Errorf("mesh with a 0 axis: %v", err)
	}
}

// A mesh whose rank count overflows int is rejected: 2^32·2^32 ranks used
// to wrap to a world of 0 ranks.
func TestSimulateRejectsOverflowingMesh(t *testing.T) {
	for _, shape := range [][]int{{1 << 32, 1 << 32}, {0, 2}, {2, -1}} {
		ran := false
		err := placementtest.Simulate(context.Background(), shape, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
			ran = true
			return nil
		})
		if !errors.Is(err, placement.ErrInvalid) || ran {
			t.Errorf("Simulate(%v): %v (fn ran: %v); want ErrInvalid without running", shape, err, ran)
		}
	}
}

// Random returns nil for a shape whose element count overflows int (it used
// to wrap: 2^32·2^32 elements gave an empty slice) or has a negative dim.
func TestRandomRejectsOverflowingShapes(t *testing.T) {
	for _, tc := range []struct {
		shape []int
		n     int // -1: nil
	}{
		{[]int{2, 3}, 6},
		{[]int{4, 0}, 0},
		{nil, 1},
		{[]int{1 << 32, 1 << 32}, -1},
		{[]int{1 << 32, 1 << 32, 0}, -1},
		{[]int{3, -2}, -1},
	} {
		for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
			got := placementtest.Random(tc.shape, dt, 1)
			n := -1
			switch d := got.(type) {
			case []float32:
				n = len(d)
			case []float64:
				n = len(d)
			}
			if (tc.n < 0 && got != nil) || (tc.n >= 0 && n != tc.n) {
				t.Errorf("Random(%v, %v) = %T of %d elements; want %d (-1: nil)", tc.shape, dt, got, n, tc.n)
			}
		}
	}
}

// TestOnDevice: without WithDevice a rank's device is the host; with it
// every rank gets the device made for its rank, closed when fn returns; an
// error making it, or a nil device, is the rank's error.
func TestOnDevice(t *testing.T) {
	ctx := context.Background()
	if err := placementtest.Simulate(ctx, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		if d := placementtest.Device(ctx); d.Kind() != device.KindHost {
			return fmt.Errorf("device %s without OnDevice", d.Name())
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	made := make([]*emu.Device, 3)
	on := placementtest.WithDevice(func(r int) (device.Device, error) {
		d, err := emu.New(r)
		made[r] = d
		return d, err
	})
	if err := placementtest.Simulate(ctx, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		if want := fmt.Sprintf("emu:%d", m.Rank()); d.Name() != want {
			return fmt.Errorf("device %s, want %s", d.Name(), want)
		}
		_, err := d.Alloc(comm.Float32, 4)
		return err
	}, on); err != nil {
		t.Fatal(err)
	}
	for r, d := range made {
		if _, err := d.Alloc(comm.Float32, 1); err == nil {
			t.Errorf("rank %d's device is still open after Simulate", r)
		}
	}
	for _, tc := range []struct {
		name string
		new  func(r int) (device.Device, error)
		want string
	}{
		{"error", func(r int) (device.Device, error) { return nil, errBoom }, "boom"},
		{"nil", func(r int) (device.Device, error) { return nil, nil }, "nil device"},
	} {
		err := placementtest.Simulate(ctx, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error { return nil }, placementtest.WithDevice(tc.new))
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "rank") {
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		}
	}
}
