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

// adjoint computes <T x, y> and <x, T* y> across ranks, where T is the
// plan src -> dst and T* its backward plan for a gradient arriving as grad
// (nil: the default, GradSpec(dst)).
func adjoint(ctx context.Context, p *placement.Planner, src, dst, grad *placement.Spec, seed uint64) (lhs, rhs float64, bwd *placement.Plan, err error) {
	fwd, err := p.Plan(src, dst)
	if err != nil {
		return 0, 0, nil, err
	}
	if grad == nil {
		if grad, err = placement.GradSpec(dst); err != nil {
			return 0, 0, nil, err
		}
	}
	hx, err := placementtest.Distribute(src, placementtest.Random(src.Shape(), src.DType(), seed), seed+1)
	if err != nil {
		return 0, 0, nil, err
	}
	hy, err := placementtest.Distribute(grad, placementtest.Random(grad.Shape(), grad.DType(), seed+2), seed+3)
	if err != nil {
		return 0, 0, nil, err
	}
	x, err := onDevice(ctx, hx)
	if err != nil {
		return 0, 0, nil, err
	}
	y, err := onDevice(ctx, hy)
	if err != nil {
		return 0, 0, nil, err
	}
	tx, err := p.Execute(ctx, fwd, x, dst.Mesh())
	if err != nil {
		return 0, 0, nil, err
	}
	if bwd, err = p.Backward(fwd, grad); err != nil {
		return 0, 0, nil, err
	}
	ty, err := p.Execute(ctx, bwd, y, src.Mesh())
	if err != nil {
		return 0, 0, nil, err
	}
	if x != hx {
		// The device's forward and backward are the host's, bit for bit.
		htx, err := p.Execute(ctx, fwd, hx, dst.Mesh())
		if err != nil {
			return 0, 0, nil, err
		}
		if err := sameAsHost(ctx, tx, htx); err != nil {
			return 0, 0, nil, fmt.Errorf("forward: %w", err)
		}
		hty, err := p.Execute(ctx, bwd, hy, src.Mesh())
		if err != nil {
			return 0, 0, nil, err
		}
		if err := sameAsHost(ctx, ty, hty); err != nil {
			return 0, 0, nil, fmt.Errorf("backward: %w", err)
		}
	}
	want, _ := placement.GradSpec(src)
	if !ty.Spec().Equal(want) {
		return 0, 0, nil, fmt.Errorf("backward ends in %v, want %v", ty.Spec(), want)
	}
	if lhs, err = placement.Inner(ctx, tx, y); err != nil {
		return 0, 0, nil, err
	}
	if rhs, err = placement.Inner(ctx, x, ty); err != nil {
		return 0, 0, nil, err
	}
	return lhs, rhs, bwd, nil
}

func close(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(a)) }

// linearCombos lists placement lists with only linear placements.
func linearCombos(n, ndim int) [][]placement.Placement {
	var out [][]placement.Placement
	for _, c := range combos(n, ndim) {
		if !slices.ContainsFunc(c, func(p placement.Placement) bool {
			return p.IsPartial() && (p.Op() == comm.Max || p.Op() == comm.Min)
		}) {
			out = append(out, c)
		}
	}
	return out
}

// TestAdjointAll checks <T x, y> == <x, T* y> for every pair of linear
// placements on a 1-D and a 2-D mesh with uneven shards, for the default
// gradient placement and for a gradient arriving Partial(sum) where the
// destination is Replicate.
func TestAdjointAll(t *testing.T) {
	cases := []struct {
		mesh, shape []int
	}{
		{[]int{3}, []int{5, 2}},
		{[]int{2, 3}, []int{5, 2}},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprint(tc.mesh, tc.shape), func(t *testing.T) {
			all := linearCombos(len(tc.mesh), len(tc.shape))
			planners := []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)}
			runDevices(t, tc.mesh, names(len(tc.mesh)), func(ctx context.Context, m *mesh.Mesh) error {
				seed := uint64(100)
				for _, sp := range all {
					src, _ := placement.NewSpec(m, tc.shape, comm.Float64, sp)
					for _, dp := range all {
						dst, _ := placement.NewSpec(m, tc.shape, comm.Float64, dp)
						grads := []*placement.Spec{nil}
						if slices.Contains(dp, R) {
							gp := slices.Clone(dp)
							for a, p := range gp {
								if p.IsPartial() {
									gp[a] = R
								} else if p == R {
									gp[a] = Psum
								}
							}
							g, err := placement.NewSpec(m, tc.shape, comm.Float64, gp)
							if err != nil {
								return err
							}
							grads = append(grads, g)
						}
						for _, g := range grads {
							seed += 11
							lhs, rhs, bwd, err := adjoint(ctx, planners[seed%2], src, dst, g, seed)
							if err != nil {
								return fmt.Errorf("%v -> %v (grad %v): %w", sp, dp, g, err)
							}
							if !close(lhs, rhs) {
								return fmt.Errorf("%v -> %v (grad %v): <Tx,y> = %.15g but <x,T*y> = %.15g\n%v", sp, dp, g, lhs, rhs, bwd)
							}
						}
					}
				}
				return nil
			})
		})
	}
}

// TestBackwardDuals asserts the backward plan of every row of the
// docs/design.md §3 table on a 1-D mesh, and runs the adjoint test on it.
func TestBackwardDuals(t *testing.T) {
	cases := []struct {
		name     string
		src, dst placement.Placement
		grad     placement.Placement // zero: the default gradient placement
		fwd, bwd []placement.StepKind
	}{
		{"S->R, grad R: local chunk", S0, R, placement.Placement{}, []placement.StepKind{placement.StepAllGather}, []placement.StepKind{placement.StepChunk}},
		{"S->R, grad P: reduce-scatter", S0, R, Psum, []placement.StepKind{placement.StepAllGather}, []placement.StepKind{placement.StepReduceScatter}},
		{"P->R: identity", Psum, R, placement.Placement{}, []placement.StepKind{placement.StepAllReduce}, nil},
		{"P(avg)->R: identity", Pavg, R, placement.Placement{}, []placement.StepKind{placement.StepAllReduce}, nil},
		{"P->R, grad P: all-reduce", Psum, R, Psum, []placement.StepKind{placement.StepAllReduce}, []placement.StepKind{placement.StepAllReduce}},
		{"P->S: all-gather", Psum, S1, placement.Placement{}, []placement.StepKind{placement.StepReduceScatter}, []placement.StepKind{placement.StepAllGather}},
		{"R->S: all-gather", R, S0, placement.Placement{}, []placement.StepKind{placement.StepChunk}, []placement.StepKind{placement.StepAllGather}},
		{"S(0)->S(1): all-to-all back", S0, S1, placement.Placement{}, []placement.StepKind{placement.StepAllToAll}, []placement.StepKind{placement.StepAllToAll}},
		{"R->P(sum): identity", R, Psum, placement.Placement{}, []placement.StepKind{placement.StepToPartial}, nil},
		{"S->P(sum): local chunk", S1, Psum, placement.Placement{}, []placement.StepKind{placement.StepShardToPartial}, []placement.StepKind{placement.StepChunk}},
	}
	p := placement.NewPlanner(testModel)
	runDevices(t, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		shape := []int{5, 4}
		for i, tc := range cases {
			src, _ := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{tc.src})
			dst, _ := placement.NewSpec(m, shape, comm.Float64, []placement.Placement{tc.dst})
			var grad *placement.Spec
			if tc.grad.Kind() != 0 {
				grad, _ = placement.NewSpec(m, shape, comm.Float64, []placement.Placement{tc.grad})
			}
			fwd, err := p.Plan(src, dst)
			if err != nil {
				return err
			}
			lhs, rhs, bwd, err := adjoint(ctx, p, src, dst, grad, uint64(i)*31)
			if err != nil {
				return fmt.Errorf("%s: %w", tc.name, err)
			}
			if got := kinds(fwd); !slices.Equal(got, tc.fwd) {
				return fmt.Errorf("%s: forward %v, want %v\n%v", tc.name, got, tc.fwd, fwd)
			}
			if got := kinds(bwd); !slices.Equal(got, tc.bwd) {
				return fmt.Errorf("%s: backward %v, want %v\n%v", tc.name, got, tc.bwd, bwd)
			}
			if tc.name == "S(0)->S(1): all-to-all back" {
				if s := bwd.Steps()[0]; s.Dim != 1 || s.ToDim != 0 {
					return fmt.Errorf("backward all-to-all is dim %d->%d, want 1->0", s.Dim, s.ToDim)
				}
			}
			if !close(lhs, rhs) {
				return fmt.Errorf("%s: <Tx,y> = %g, <x,T*y> = %g", tc.name, lhs, rhs)
			}
		}
		return nil
	})
}

func kinds(p *placement.Plan) []placement.StepKind {
	var out []placement.StepKind
	for _, s := range p.Steps() {
		out = append(out, s.Kind)
	}
	return out
}

// TestBackwardMaxMin: Partial(max|min) is not linear (its gradient goes to
// the winning rank, which needs the forward values), so its backward plan
// is an ErrUnsupported error that says so, and so is a gradient arriving
// as Partial(max).
func TestBackwardMaxMin(t *testing.T) {
	m := rank0Mesh(t, []int{4}, []string{"x"})
	p := placement.NewPlanner(nil)
	for _, pp := range []placement.Placement{Pmax, Pmin} {
		for _, pair := range [][2]placement.Placement{{pp, R}, {R, pp}, {pp, S0}} {
			fwd, err := p.Plan(mustSpec(t, m, []int{6}, pair[:1]), mustSpec(t, m, []int{6}, pair[1:]))
			if err != nil {
				t.Fatal(err)
			}
			_, err = p.Backward(fwd, nil)
			if !errors.Is(err, placement.ErrUnsupported) {
				t.Errorf("%v -> %v: backward error %v, want ErrUnsupported", pair[0], pair[1], err)
			} else {
				t.Log(err)
			}
		}
	}
	fwd, _ := p.Plan(mustSpec(t, m, []int{6}, []placement.Placement{S0}), mustSpec(t, m, []int{6}, []placement.Placement{R}))
	if _, err := p.Backward(fwd, mustSpec(t, m, []int{6}, []placement.Placement{Pmax})); !errors.Is(err, placement.ErrUnsupported) {
		t.Errorf("gradient arriving P(max): %v", err)
	}
}

// TestAdjointCrossMesh runs the adjoint test between a 2x4 and an 8 mesh
// (and a 3x2 and a 2x3 transposed view) over the same world.
func TestAdjointCrossMesh(t *testing.T) {
	run := func(t *testing.T, shapeA, shapeB []int, namesA, namesB []string, pa, pb [][]placement.Placement) {
		p := placement.NewPlanner(testModel)
		n := 1
		for _, s := range shapeA {
			n *= s
		}
		runDevices(t, []int{n}, []string{"w"}, func(ctx context.Context, w *mesh.Mesh) error {
			ma, err := mesh.New(w.World(), shapeA, namesA)
			if err != nil {
				return err
			}
			mb, err := mesh.New(w.World(), shapeB, namesB)
			if err != nil {
				return err
			}
			seed := uint64(7)
			for _, sa := range pa {
				for _, sb := range pb {
					for _, shape := range [][]int{{8, 3}, {5, 7}, {3, 1}} {
						src, err := placement.NewSpec(ma, shape, comm.Float64, sa)
						if err != nil {
							return err
						}
						dst, err := placement.NewSpec(mb, shape, comm.Float64, sb)
						if err != nil {
							return err
						}
						seed += 3
						if err := roundTrip(ctx, p, src, dst, seed, 1e-9); err != nil {
							return err
						}
						lhs, rhs, bwd, err := adjoint(ctx, p, src, dst, nil, seed)
						if err != nil {
							return fmt.Errorf("%v -> %v: %w", src, dst, err)
						}
						if !close(lhs, rhs) {
							return fmt.Errorf("%v -> %v: <Tx,y> = %g, <x,T*y> = %g\n%v", src, dst, lhs, rhs, bwd)
						}
					}
				}
			}
			return nil
		})
	}
	twoD := [][]placement.Placement{{S0, S0}, {S0, S1}, {R, S0}, {Psum, S1}, {S1, R}, {R, Pavg}}
	oneD := [][]placement.Placement{{S0}, {S1}, {R}, {Psum}}
	t.Run("2x4<->8", func(t *testing.T) {
		run(t, []int{2, 4}, []int{8}, []string{"dp", "tp"}, []string{"w"}, twoD, oneD)
		run(t, []int{8}, []int{2, 4}, []string{"w"}, []string{"dp", "tp"}, oneD, twoD)
	})
	t.Run("3x2<->2x3", func(t *testing.T) {
		run(t, []int{3, 2}, []int{2, 3}, []string{"a", "b"}, []string{"b", "a"}, twoD, twoD)
	})
}
