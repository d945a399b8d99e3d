package placement_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// The gradient of Partial(max|min) goes to the rank whose value won, ties
// to the lowest rank, and sums to the incoming gradient, for every
// destination that reduces the extremum axes (Replicate, Shard, and the
// Partial(avg|sum) that go through Replicate), on axes of 2 to 5 ranks.
// Averaging identical copies over 3 or 5 ranks is not bit-exact, so a
// winner found by comparing with the reduced result would be lost there.
func TestExtremumGradGoesToTheWinner(t *testing.T) {
	dsts1 := []placement.Placement{R, S0, S1, Pavg, Psum}
	for _, op := range []comm.ReduceOp{comm.Max, comm.Min} {
		P := placement.Partial(op)
		cases := []struct {
			mesh []int
			src  []placement.Placement
		}{
			{[]int{2}, []placement.Placement{P}},
			{[]int{3}, []placement.Placement{P}},
			{[]int{4}, []placement.Placement{P}},
			{[]int{5}, []placement.Placement{P}},
			{[]int{3, 2}, []placement.Placement{P, P}},
			{[]int{2, 3}, []placement.Placement{S1, P}},
			{[]int{5, 2}, []placement.Placement{P, S0}},
		}
		for _, tc := range cases {
			var dsts [][]placement.Placement
			for _, a := range dsts1 {
				if len(tc.mesh) == 1 {
					dsts = append(dsts, []placement.Placement{a})
					continue
				}
				for _, b := range dsts1 {
					dsts = append(dsts, []placement.Placement{a, b})
				}
			}
			t.Run(fmt.Sprint(tc.mesh, tc.src), func(t *testing.T) {
				placementtest.Run(t, tc.mesh, names(len(tc.mesh)), func(ctx context.Context, m *mesh.Mesh) error {
					for _, dst := range dsts {
						if err := checkExtremumGrad(ctx, m, tc.src, dst, op); err != nil {
							return fmt.Errorf("%v -> %v: %w", tc.src, dst, err)
						}
					}
					return nil
				})
			})
		}
	}
}

// levels are the values of checkExtremumGrad's pieces.
var levels = [3]float64{0.1, 0.7, 0.4}

func checkExtremumGrad(ctx context.Context, m *mesh.Mesh, src, dst []placement.Placement, op comm.ReduceOp) error {
	shape := []int{3, 4}
	spec, err := placement.NewSpec(m, shape, comm.Float64, src)
	if err != nil {
		return err
	}
	// Piece values with deliberate ties: element i of the rank at
	// reducing position q is levels[(i*7 + q) mod 3], so several ranks
	// often hold the extremum. The levels are not bit-exact under an
	// average of 3 or 6 identical copies.
	group, err := reducingGroup(ctx, m, src)
	if err != nil {
		return err
	}
	q := group.Rank()
	lshape := spec.LocalShape()
	n := lshape[0] * lshape[1]
	local := make([]float64, n)
	for i := range local {
		local[i] = levels[(i*7+q)%3]
	}
	x, err := placement.FromLocal(ctx, spec, local, false)
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
	gfull := make([]float64, 12)
	for i := range gfull {
		gfull[i] = float64(i + 1)
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
		best, first := levels[(i*7)%3], 0
		for r := 1; r < group.Size(); r++ {
			v := levels[(i*7+r)%3]
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
			return fmt.Errorf("mesh rank %d (reducing rank %d) element %d: gradient %v, want %v", m.Rank(), q, i, got[i], want)
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
		x, err := placement.FromFull(spec, []float32{1, 2, 3, 4})
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

// A NaN piece still leaves every element exactly one winner: the lowest
// rank holding the extremum, NaN included when the reduction yields NaN.
func TestExtremumGradNaN(t *testing.T) {
	nan := math.NaN()
	pieces := [][]float64{{1, 2}, {nan, 5}, {3, nan}} // by rank of the 3-rank axis
	placementtest.Run(t, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{2}, comm.Float64, []placement.Placement{Pmax})
		if err != nil {
			return err
		}
		x, err := placement.NewLocal(spec, slices.Clone(pieces[m.Rank()]))
		if err != nil {
			return err
		}
		var p placement.Planner
		rspec, err := spec.With([]placement.Placement{R})
		if err != nil {
			return err
		}
		y, err := p.Redistribute(ctx, x, rspec)
		if err != nil {
			return err
		}
		g, err := placement.NewLocal(rspec, []float64{10, 20})
		if err != nil {
			return err
		}
		grad, err := p.ExtremumGrad(ctx, x, y, g)
		if err != nil {
			return err
		}
		// Who won, seen from every rank: one all-gather of the gradients.
		c, err := m.Group(ctx)
		if err != nil {
			return err
		}
		all := make([]float64, 2*c.Size())
		if err := comm.AllGather(ctx, c, comm.Host(grad.LocalData().([]float64)), comm.Host(all)); err != nil {
			return err
		}
		yv := y.LocalData().([]float64)
		for i, gv := range []float64{10, 20} {
			first := -1 // the lowest rank whose piece is the forward value
			for r, pc := range pieces {
				if pc[i] == yv[i] || (math.IsNaN(pc[i]) && math.IsNaN(yv[i])) {
					first = r
					break
				}
			}
			for r := range c.Size() {
				want := 0.0
				if r == first {
					want = gv
				}
				if all[2*r+i] != want {
					return fmt.Errorf("element %d (forward value %v): rank %d's gradient is %v, want %v", i, yv[i], r, all[2*r+i], want)
				}
			}
		}
		return nil
	})
}
