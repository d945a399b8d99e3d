package autograd

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

func TestGradsWithNestedShardOrder(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		ord := placement.WithOrder(0, "tp", "dp")
		x, err := random(m, []int{5, 3}, pl{S0, S0}, 1, ord)
		if err != nil {
			return err
		}
		w, err := random(m, []int{2, 3}, pl{R, R}, 2)
		if err != nil {
			return err
		}
		b, err := random(m, []int{2}, pl{R, R}, 3)
		if err != nil {
			return err
		}
		x3, err := random(m, []int{5, 4, 3}, pl{S0, S0}, 4, ord)
		if err != nil {
			return err
		}
		if err := CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
			y, err := Linear(ps[0], ps[1], ps[2])
			if err != nil {
				return nil, err
			}
			if y, err = GELU(y); err != nil {
				return nil, err
			}
			return probe(ctx, y)
		}, x, w, b); err != nil {
			return err
		}
		return CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
			y, err := Reshape(ps[0], 5, 12)
			if err != nil {
				return nil, err
			}
			if y, err = Softmax(y, -1); err != nil {
				return nil, err
			}
			if y, err = Transpose(y, 0, 1); err != nil {
				return nil, err
			}
			s, err := Sum(y, 0)
			if err != nil {
				return nil, err
			}
			return probe(ctx, s)
		}, x3)
	})
}
