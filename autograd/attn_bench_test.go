package autograd

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// BenchmarkCausalAttention times the fused float32 attention (forward and
// backward) on one layer of the tiny GPT: [B, H, T, Dh] = [16, 4, 64, 32].
func BenchmarkCausalAttention(b *testing.B) {
	placementtest.Run(b, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		shape := []int{16, 4, 64, 32}
		tp := NewTape()
		var vs []*Value
		for i := range 3 {
			s, err := placement.NewSpec(m, shape, comm.Float32, pl{R})
			if err != nil {
				return err
			}
			d, err := placement.FromFull(s, placementtest.Random(shape, comm.Float32, uint64(i)))
			if err != nil {
				return err
			}
			v, err := tp.Param("x", d)
			if err != nil {
				return err
			}
			vs = append(vs, v)
		}
		for b.Loop() {
			o, err := CausalAttention(vs[0], vs[1], vs[2])
			if err != nil {
				return err
			}
			l, err := Sum(o)
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, l); err != nil {
				return err
			}
			for _, v := range vs {
				v.ZeroGrad()
			}
		}
		return nil
	})
}
