package placement_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
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
				runDevices(t, tc.mesh, names(len(tc.mesh)), func(ctx context.Context, m *mesh.Mesh) error {
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
	on := placement.WithDevice(placementtest.Device(ctx))
	x, err := placement.FromLocal(ctx, spec, local, false, on)
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
	g, err := placement.FromFull(gspec, gfull, on)
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
	if grad.Device() != placementtest.Device(ctx) {
		return fmt.Errorf("the gradient is on %s, want %s", grad.Device().Name(), placementtest.Device(ctx).Name())
	}
	hgrad, err := grad.To(device.Host())
	if err != nil {
		return err
	}
	got := hgrad.LocalData().([]float64)
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

// NaN in Partial(max|min) has one winner per element: the lowest rank
// holding a NaN (comm/local propagates NaN, so the extremum is NaN there),
// whatever the NaN's payload; elsewhere the lowest rank holding the
// extremum. So at NaN positions, as everywhere, the gradient is g on
// exactly one rank and 0 on the others, and sums to g over the ranks (the
// issue 19 case: it summed to 0 there). On 2-, 3- and 5-rank axes, for max
// and min, float32 and float64, to Replicate and to Shard(0).
func TestExtremumGradNaN(t *testing.T) {
	nan := math.NaN()
	// piece returns element i of rank r's piece on a p-rank axis.
	piece := func(op comm.ReduceOp, p, r, i int) float64 {
		big := 100.0
		if op == comm.Min {
			big = -100
		}
		switch i {
		case 0: // NaN on the last rank only
			if r == p-1 {
				return nan
			}
			return float64(r)
		case 1: // NaN on every rank but the first
			if r > 0 {
				return nan
			}
			return big
		case 2: // NaN on rank 0, the extremum of the numbers elsewhere
			if r == 0 {
				return nan
			}
			return big
		case 3: // no NaN: a tie on every rank
			return 1.5
		case 4: // NaN everywhere, a different payload on every rank
			return math.Float64frombits(0x7ff8000000000001 + uint64(r))
		default: // no NaN: distinct values, the extremum in the middle
			return -math.Abs(float64(r-p/2)) * big / 100
		}
	}
	const n = 6
	for _, op := range []comm.ReduceOp{comm.Max, comm.Min} {
		for _, p := range []int{2, 3, 5} {
			// The winner of every element, from the pieces alone.
			want := make([]int, n)
			for i := range want {
				want[i] = -1
				for r := range p {
					if math.IsNaN(piece(op, p, r, i)) {
						want[i] = r
						break
					}
				}
				if want[i] >= 0 {
					continue
				}
				best := piece(op, p, 0, i)
				want[i] = 0
				for r := 1; r < p; r++ {
					if v := piece(op, p, r, i); (op == comm.Max && v > best) || (op == comm.Min && v < best) {
						best, want[i] = v, r
					}
				}
			}
			for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
				for _, dst := range []placement.Placement{R, S0} {
					t.Run(fmt.Sprintf("%v/p=%d/%v/to %v", op, p, dt, dst), func(t *testing.T) {
						placementtest.Run(t, []int{p}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
							return checkNaNGrad(ctx, m, op, dt, dst, want, func(i int) float64 { return piece(op, p, m.Rank(), i) })
						})
					})
				}
			}
		}
	}
}

// checkNaNGrad runs ExtremumGrad on a 1-axis mesh for pieces given by
// piece and checks that element i's gradient is g_i on rank want[i] and 0
// on every other rank.
func checkNaNGrad(ctx context.Context, m *mesh.Mesh, op comm.ReduceOp, dt comm.DType, dst placement.Placement, want []int, piece func(int) float64) error {
	n := len(want)
	spec, err := placement.NewSpec(m, []int{n}, dt, []placement.Placement{placement.Partial(op)})
	if err != nil {
		return err
	}
	local := make([]float64, n)
	for i := range local {
		local[i] = piece(i)
	}
	x, err := placement.NewLocal(spec, asType(local, dt))
	if err != nil {
		return err
	}
	var p placement.Planner
	dspec, err := spec.With([]placement.Placement{dst})
	if err != nil {
		return err
	}
	y, err := p.Redistribute(ctx, x, dspec)
	if err != nil {
		return err
	}
	gfull := make([]float64, n)
	for i := range gfull {
		gfull[i] = float64(10 * (i + 1))
	}
	gspec, err := placement.GradSpec(dspec)
	if err != nil {
		return err
	}
	g, err := placement.FromFull(gspec, asType(gfull, dt))
	if err != nil {
		return err
	}
	grad, err := p.ExtremumGrad(ctx, x, y, g)
	if err != nil {
		return err
	}
	c, err := m.Group(ctx)
	if err != nil {
		return err
	}
	mine := f64(grad.LocalData())
	all := make([]float64, n*c.Size())
	if err := comm.AllGather(ctx, c, comm.Host(mine), comm.Host(all)); err != nil {
		return err
	}
	for i, w := range want {
		sum, holders := 0.0, 0
		for r := range c.Size() {
			v := all[r*n+i]
			sum += v
			if v != 0 {
				holders++
			}
			wv := 0.0
			if r == w {
				wv = gfull[i]
			}
			if v != wv {
				return fmt.Errorf("element %d (this rank's piece %v; the winner is rank %d): rank %d's gradient is %v, want %v", i, local[i], w, r, v, wv)
			}
		}
		if sum != gfull[i] || holders != 1 {
			return fmt.Errorf("element %d: the gradient sums to %v over %d ranks holding it, want %v on exactly one", i, sum, holders, gfull[i])
		}
	}
	return nil
}

// asType returns v as a []float32 or []float64 for dt.
func asType(v []float64, dt comm.DType) any {
	if dt == comm.Float64 {
		return slices.Clone(v)
	}
	out := make([]float32, len(v))
	for i, x := range v {
		out[i] = float32(x)
	}
	return out
}
