package placement_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// poisonAllocator hands out NaN-filled buffers and remembers them, so that
// a test can tell whether Execute wrote every element it uses, kept its
// result in a result buffer, and left its temporaries dead.
type poisonAllocator struct {
	results, temps []any
}

func (a *poisonAllocator) Float32(n int, result bool) []float32 {
	b := make([]float32, n)
	poison(b)
	a.keep(b, result)
	return b
}

func (a *poisonAllocator) Float64(n int, result bool) []float64 {
	b := make([]float64, n)
	poison(b)
	a.keep(b, result)
	return b
}

func (a *poisonAllocator) keep(b any, result bool) {
	if result {
		a.results = append(a.results, b)
	} else {
		a.temps = append(a.temps, b)
	}
}

// killTemps poisons every temporary again: Execute has returned, so
// nothing may read them.
func (a *poisonAllocator) killTemps() {
	for _, b := range a.temps {
		poisonAny(b)
	}
}

// handedOut reports whether data starts a buffer handed out as a result.
func (a *poisonAllocator) handedOut(data any) bool {
	p := start(data)
	for _, b := range a.results {
		if start(b) == p {
			return true
		}
	}
	return false
}

func poison[T float32 | float64](b []T) {
	for i := range b {
		b[i] = T(math.NaN())
	}
}

func poisonAny(b any) {
	switch b := b.(type) {
	case []float32:
		poison(b)
	case []float64:
		poison(b)
	}
}

// start is the address of a block's first element, nil when it is empty.
func start(b any) unsafe.Pointer {
	switch b := b.(type) {
	case []float32:
		if len(b) > 0 {
			return unsafe.Pointer(&b[0])
		}
	case []float64:
		if len(b) > 0 {
			return unsafe.Pointer(&b[0])
		}
	}
	return nil
}

// TestExecuteWithAllocator redistributes between every pair of placements
// with buffers from a poisoning allocator: the result must be right
// although every buffer starts as NaN, must sit in a buffer handed out as
// a result (unless a cross-mesh step made it), and must survive the
// temporaries and the input being overwritten after the call. With
// WithReuseInput the result must be right too, and a reduction to Replicate
// must run in the input's memory without asking for any buffer.
func TestExecuteWithAllocator(t *testing.T) {
	cases := []struct {
		mesh  []int
		shape []int
	}{
		{[]int{2}, []int{3, 1}},
		{[]int{3}, []int{2, 5}},
		{[]int{2, 2}, []int{3, 5}},
		{[]int{2, 3}, []int{5, 2}},
	}
	for _, tc := range cases {
		for _, reuse := range []bool{false, true} {
			t.Run(fmt.Sprint(tc.mesh, tc.shape, " reuse=", reuse), func(t *testing.T) {
				n := len(tc.mesh)
				all := combos(n, len(tc.shape))
				planners := []*placement.Planner{placement.NewPlanner(nil), placement.NewPlanner(testModel)}
				placementtest.Run(t, tc.mesh, names(n), func(ctx context.Context, m *mesh.Mesh) error {
					seed := uint64(0)
					for _, sp := range all {
						for _, dp := range all {
							seed += 7
							dt := []comm.DType{comm.Float32, comm.Float64}[seed%2]
							src, err := placement.NewSpec(m, tc.shape, dt, sp)
							if err != nil {
								return err
							}
							dst, err := placement.NewSpec(m, tc.shape, dt, dp)
							if err != nil {
								return err
							}
							if err := redistributeInto(ctx, planners[seed/2%2], src, dst, seed, reuse); err != nil {
								return err
							}
						}
					}
					return nil
				})
			})
		}
	}
}

func redistributeInto(ctx context.Context, p *placement.Planner, src, dst *placement.Spec, seed uint64, reuse bool) error {
	tol := 1e-9
	if src.DType() == comm.Float32 {
		tol = 2e-5
	}
	x := placementtest.Random(src.Shape(), src.DType(), seed)
	in, err := placementtest.Distribute(src, x, seed+1)
	if err != nil {
		return fmt.Errorf("distribute %v: %w", src, err)
	}
	pl, err := p.Plan(src, dst)
	if err != nil {
		return err
	}
	var al poisonAllocator
	opts := []placement.ExecuteOption{placement.WithAllocator(&al)}
	if reuse {
		opts = append(opts, placement.WithReuseInput())
	}
	inData := in.LocalData()
	out, err := p.Execute(ctx, pl, in, nil, opts...)
	if err != nil {
		return fmt.Errorf("%v -> %v: %w", src, dst, err)
	}
	fail := func(format string, a ...any) error {
		return fmt.Errorf("%v -> %v (reuse %v): %s\n%v", src, dst, reuse, fmt.Sprintf(format, a...), pl)
	}
	al.killTemps()
	got := start(out.LocalData())
	switch {
	case got == nil:
	case reuse && got == start(inData):
	case pl.CrossMesh() || hasDirect(pl):
	case !al.handedOut(out.LocalData()):
		return fail("the result is not in a buffer handed out as a result")
	}
	if !reuse {
		poisonAny(inData)
	}
	if reuse && onlyReductions(src, dst) {
		if got != start(inData) || len(al.results)+len(al.temps) > 0 {
			return fail("a reduction to Replicate with ReuseInput took %d result and %d temporary buffers, in place %v", len(al.results), len(al.temps), got == start(inData))
		}
	}
	if err := placementtest.CheckFull(ctx, out, x, tol); err != nil {
		return fail("%v", err)
	}
	return nil
}

// hasDirect reports whether pl moves data by one direct all-to-all-v over
// the whole mesh, which allocates its own buffers.
func hasDirect(pl *placement.Plan) bool {
	for _, st := range pl.Steps() {
		if st.Kind == placement.StepDirect {
			return true
		}
	}
	return false
}

// onlyReductions reports whether src -> dst only turns Partial(sum) axes
// into Replicate and keeps every other axis.
func onlyReductions(src, dst *placement.Spec) bool {
	sp, dp := src.Placements(), dst.Placements()
	some := false
	for a := range sp {
		switch {
		case sp[a] == dp[a]:
		case sp[a] == Psum && dp[a].IsReplicate():
			some = true
		default:
			return false
		}
	}
	return some
}

// shortAllocator returns one element fewer than asked for.
type shortAllocator struct{}

func (shortAllocator) Float32(n int, _ bool) []float32 { return make([]float32, max(n-1, 0)) }
func (shortAllocator) Float64(n int, _ bool) []float64 { return make([]float64, max(n-1, 0)) }

// TestExecuteShortAllocator checks that an allocator returning too little
// fails Execute with ErrInvalid on the rank that uses it, without a panic
// and without leaving its peers waiting.
func TestExecuteShortAllocator(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"a"}, func(ctx context.Context, m *mesh.Mesh) error {
		src, err := placement.NewSpec(m, []int{4, 3}, comm.Float32, []placement.Placement{S0})
		if err != nil {
			return err
		}
		dst, err := placement.NewSpec(m, []int{4, 3}, comm.Float32, []placement.Placement{R})
		if err != nil {
			return err
		}
		in, err := placementtest.Distribute(src, placementtest.Random(src.Shape(), src.DType(), 1), 2)
		if err != nil {
			return err
		}
		var opts []placement.ExecuteOption
		if m.Rank() == 0 {
			opts = append(opts, placement.WithAllocator(shortAllocator{}))
		}
		_, err = placement.NewPlanner(nil).Redistribute(ctx, in, dst, opts...)
		switch {
		case m.Rank() == 0 && !errors.Is(err, placement.ErrInvalid):
			return fmt.Errorf("rank 0, short allocator: err = %v, want ErrInvalid", err)
		case m.Rank() != 0 && err != nil:
			return fmt.Errorf("rank %d: %w", m.Rank(), err)
		}
		return nil
	})
}
