package placement_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"gorgonia.org/tensor"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The gradient of Partial(max|min) goes to the rank whose value won, ties
// to the lowest rank, and sums to the incoming gradient.
func TestExtremumGradGoesToTheWinner(t *testing.T) {
	for _, tc := range []struct {
		shape []int
		names []string
		src   []placement.Placement
		dst   []placement.Placement
		op    comm.ReduceOp
	}{
		{[]int{3}, []string{"x"}, []placement.Placement{placement.Partial(comm.Max)}, []placement.Placement{placement.Replicate()}, comm.Max},
		{[]int{3}, []string{"x"}, []placement.Placement{placement.Partial(comm.Min)}, []placement.Placement{placement.Shard(0)}, comm.Min},
		{[]int{2, 2}, []string{"a", "b"}, []placement.Placement{placement.Partial(comm.Max), placement.Partial(comm.Max)}, []placement.Placement{placement.Replicate(), placement.Shard(1)}, comm.Max},
		{[]int{2, 2}, []string{"a", "b"}, []placement.Placement{placement.Shard(1), placement.Partial(comm.Min)}, []placement.Placement{placement.Replicate(), placement.Replicate()}, comm.Min},
	} {
		t.Run(fmt.Sprint(tc.shape, tc.src, tc.dst), func(t *testing.T) {
			placementtest.Run(t, tc.shape, tc.names, func(ctx context.Context, m *mesh.Mesh) error {
				return checkExtremumGrad(ctx, m, tc.src, tc.dst, tc.op)
			})
		})
	}
}

func checkExtremumGrad(ctx context.Context, m *mesh.Mesh, src, dst []placement.Placement, op comm.ReduceOp) error {
	shape := []int{3, 4}
	spec, err := placement.NewSpec(m, shape, comm.Float64, src)
	if err != nil {
		return err
	}
	// Piece values with deliberate ties: element i of the rank at
	// reducing position q is (i*7 + q) mod 3, so several ranks often hold
	// the extremum.
	group, err := reducingGroup(ctx, m, src)
	if err != nil {
		return err
	}
	q := group.Rank()
	lshape := spec.LocalShape()
	n := lshape[0] * lshape[1]
	local := make([]float64, n)
	for i := range local {
		local[i] = float64((i*7 + q) % 3)
	}
	x, err := placement.FromLocal(ctx, spec, tensor.New(tensor.WithShape(lshape...), tensor.WithBacking(local)), false)
	if err != nil {
		return err
	}
	var p placement.Planner
	dspec, err := spec.With(dst)
	if err != nil {
		return err
	}
	y, err := p.Redistribute(ctx, x, dspec)
	if err != nil {
		return err
	}
	// The incoming gradient: a distinct value per global element.
	gfull := tensor.New(tensor.WithShape(shape...), tensor.WithBacking(make([]float64, 12)))
	for i := range gfull.Data().([]float64) {
		gfull.Data().([]float64)[i] = float64(i + 1)
	}
	gspec, err := placement.GradSpec(dspec)
	if err != nil {
		return err
	}
	g, err := placement.FromFull(gspec, gfull)
	if err != nil {
		return err
	}
	grad, err := p.ExtremumGrad(ctx, x, y, g)
	if err != nil {
		return err
	}
	for a, pl := range grad.Spec().Placements() {
		if src[a].IsPartial() && pl != placement.Partial(comm.Sum) {
			return fmt.Errorf("gradient placement %v on axis %d, want P(sum)", pl, a)
		}
	}
	// Expected: this rank wins element i iff its value is the extremum
	// and no lower reducing rank holds it too.
	off, _, err := spec.Box(m.Rank())
	if err != nil {
		return err
	}
	got := grad.LocalData().([]float64)
	for i := range got {
		best, first := float64((i*7)%3), 0
		for r := 1; r < group.Size(); r++ {
			v := float64((i*7 + r) % 3)
			if (op == comm.Max && v > best) || (op == comm.Min && v < best) {
				best, first = v, r
			}
		}
		row, col := off[0]+i/lshape[1], off[1]+i%lshape[1]
		want := 0.0
		if first == q {
			want = float64(row*4 + col + 1)
		}
		if got[i] != want {
			return fmt.Errorf("rank %d element %d: gradient %v, want %v", q, i, got[i], want)
		}
	}
	return nil
}

// reducingGroup is the communicator over the mesh axes where src is Partial.
func reducingGroup(ctx context.Context, m *mesh.Mesh, src []placement.Placement) (comm.Communicator, error) {
	var axes []string
	for a, pl := range src {
		if pl.IsPartial() {
			axes = append(axes, m.Names()[a])
		}
	}
	return m.Group(ctx, axes...)
}

func TestExtremumGradRejectsLinearSources(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{4}, comm.Float32, []placement.Placement{placement.Partial(comm.Sum)})
		if err != nil {
			return err
		}
		x, err := placement.FromFull(spec, tensor.New(tensor.WithShape(4), tensor.WithBacking([]float32{1, 2, 3, 4})))
		if err != nil {
			return err
		}
		var p placement.Planner
		_, err = p.ExtremumGrad(ctx, x, x, x)
		if !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("got %v, want ErrInvalid (use Backward)", err)
		}
		return nil
	})
}
