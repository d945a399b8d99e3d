package autograd

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// TestWithPlanner: tapes made WithPlanner(p) plan their redistributions
// (forward and backward) with p, so they share its plan cache; a tape
// without it has a planner of its own and leaves p alone.
func TestWithPlanner(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		p := placement.NewPlanner(nil)
		step := func(tape *Tape) error {
			xd, err := random(m, []int{4, 3}, pl{S0}, 1)
			if err != nil {
				return err
			}
			x, err := tape.Param("x", xd)
			if err != nil {
				return err
			}
			rs, err := allR(x.Spec())
			if err != nil {
				return err
			}
			y, err := Redistribute(ctx, x, rs)
			if err != nil {
				return err
			}
			loss, err := Sum(y)
			if err != nil {
				return err
			}
			return tape.Backward(ctx, loss)
		}
		a, b := NewTape(WithPlanner(p)), NewTape(WithPlanner(p))
		if a.Planner() != p {
			return fmt.Errorf("Planner() of a tape made WithPlanner(p) is not p")
		}
		if err := step(a); err != nil {
			return err
		}
		n := p.CacheLen()
		if n < 2 {
			return fmt.Errorf("after a forward and backward redistribute p caches %d plans, want ≥ 2 (S(0)->R and its dual)", n)
		}
		if err := step(b); err != nil {
			return err
		}
		if got := p.CacheLen(); got != n {
			return fmt.Errorf("a second tape on p added plans (%d -> %d): the cache is not shared", n, got)
		}
		own := NewTape()
		if err := step(own); err != nil {
			return err
		}
		if own.Planner() == p || p.CacheLen() != n || own.Planner().CacheLen() == 0 {
			return fmt.Errorf("a tape without WithPlanner used p (own planner %v, p caches %d plans, want %d)", own.Planner() == p, p.CacheLen(), n)
		}
		return nil
	})
}
