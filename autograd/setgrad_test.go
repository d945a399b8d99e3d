package autograd

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

func TestSetGrad(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		r := []placement.Placement{placement.Replicate()}
		spec, err := placement.NewSpec(m, []int{3}, comm.Float64, r)
		if err != nil {
			return err
		}
		mk := func(s *placement.Spec, n int) *placement.DTensor {
			dt, err := placement.NewLocal(s, make([]float64, n))
			if err != nil {
				t.Fatal(err)
			}
			return dt
		}
		tape := NewTape()
		p, err := tape.Param("p", mk(spec, 3))
		if err != nil {
			return err
		}
		g := mk(spec, 3)
		if err := p.SetGrad(g); err != nil || p.Grad() != g {
			return fmt.Errorf("SetGrad: %v", err)
		}
		other, _ := placement.NewSpec(m, []int{4}, comm.Float64, r)
		if err := p.SetGrad(mk(other, 4)); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("wrong shape: %v", err)
		}
		f32, _ := placement.NewSpec(m, []int{3}, comm.Float32, r)
		dt32, _ := placement.NewLocal(f32, make([]float32, 3))
		if err := p.SetGrad(dt32); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("wrong dtype: %v", err)
		}
		c, _ := tape.Constant(mk(spec, 3))
		if err := c.SetGrad(g); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("constant: %v", err)
		}
		if err := p.SetGrad(nil); err != nil || p.Grad() != nil {
			return fmt.Errorf("SetGrad(nil): %v", err)
		}
		return nil
	})
}
