package autograd

import (
	"context"
	"math"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestFloat32: the float32 paths of every op give the float64 gradients
// to float32 precision.
func TestFloat32(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		grads := map[comm.DType][][]float64{}
		for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
			mk := func(shape []int, p pl, seed uint64) (*placement.DTensor, error) {
				s, err := placement.NewSpec(m, shape, dt, p)
				if err != nil {
					return nil, err
				}
				return placement.FromFull(s, placementtest.Random(shape, dt, seed))
			}
			x, err := mk([]int{5, 3}, pl{S0, R}, 1)
			if err != nil {
				return err
			}
			w, err := mk([]int{3, 4}, pl{R, S1}, 2)
			if err != nil {
				return err
			}
			tp := NewTape()
			ps, err := wrapParams(tp, []*placement.DTensor{x, w})
			if err != nil {
				return err
			}
			h, err := MatMul(ps[0], ps[1])
			if err != nil {
				return err
			}
			if h, err = Mul(h, h); err != nil {
				return err
			}
			if h, err = Scale(h, 3); err != nil {
				return err
			}
			if h, err = Add(h, h); err != nil {
				return err
			}
			l, err := Sum(h)
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, l); err != nil {
				return err
			}
			for _, p := range ps {
				g, err := fullData(ctx, p.Grad())
				if err != nil {
					return err
				}
				grads[dt] = append(grads[dt], g)
			}
		}
		for i := range grads[comm.Float64] {
			for j, want := range grads[comm.Float64][i] {
				if got := grads[comm.Float32][i][j]; math.Abs(got-want) > 1e-4*math.Max(1, math.Abs(want)) {
					t.Errorf("param %d element %d: float32 %v, float64 %v", i, j, got, want)
				}
			}
		}
		return nil
	})
}
