package fsdp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestControlPipelined drives FSDP as a pipeline stage does: gradient
// sync and reshard-after-backward off, the units unsharded once (async,
// then Wait) before three micro-batches whose forwards and backwards
// interleave in their own Graphs (F0 F1 B0 F2 B1 B2), one Finish, then
// Reshard (and again with Reshard before Finish, as a user's schedule may
// order them: the unsharded gradients outlive it). Nothing is gathered or reduced between Unshard and Finish,
// Finish reduce-scatters each unit once, and the gradients are those of
// plain FSDP running the micro-batches one after another (each pass
// reduced on its own and summed) within 1e-12 (float64: only the order
// of the sums differs).
func TestControlPipelined(t *testing.T) {
	ctx := context.Background()
	seeds := []uint64{1, 2, 3}
	var mu sync.Mutex
	grads := [3]map[string][]float64{{}, {}, {}}
	var problems []string
	for run := range grads {
		// Run 0 is plain FSDP; 1 and 2 are controlled, 2 with Reshard
		// before Finish (the unsharded gradients must survive it).
		controlled, reshardFirst := run > 0, run == 2
		err := placementtest.Simulate(ctx, []int{2}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newFnet(m, comm.Float64)
			if err != nil {
				return err
			}
			var opts []Option
			if controlled {
				opts = append(opts, WithReshard(false))
			}
			f, err := FullyShard(ctx, n, []string{"h.*", "head"}, opts...)
			if err != nil {
				return err
			}
			defer f.Close()
			fail := func(format string, args ...any) {
				mu.Lock()
				defer mu.Unlock()
				problems = append(problems, fmt.Sprintf("rank %d: ", m.Rank())+fmt.Sprintf(format, args...))
			}
			losses := make([]*autograd.Value, len(seeds))
			graphs := make([]*autograd.Graph, len(seeds))
			fwd := func(i int) error {
				if graphs[i], err = n.tape.NewGraph(); err != nil {
					return err
				}
				return graphs[i].Do(func() (err error) {
					losses[i], err = n.forward(ctx, m, seeds[i], fnetB)
					return err
				})
			}
			bwd := func(i int) error {
				return graphs[i].Do(func() error { return n.tape.BackwardFrom(ctx, []*autograd.Value{losses[i]}, nil) })
			}
			if !controlled {
				for i := range seeds {
					if err := errors.Join(fwd(i), bwd(i)); err != nil {
						return err
					}
				}
			} else {
				f.SetRequiresGradientSync(false)
				f.SetReshardAfterBackward(false)
				h, err := f.UnshardAsync(ctx)
				if err != nil {
					return err
				}
				if err := h.Wait(ctx); err != nil {
					return err
				}
				var all int64
				for _, u := range f.Units() {
					all += 8 * int64(u.Elems)
				}
				if got := f.Bytes().Gathered; got != all {
					fail("after Unshard %d bytes gathered of %d", got, all)
				}
				before := f.Traffic()
				for _, s := range []struct {
					fn func(int) error
					i  int
				}{{fwd, 0}, {fwd, 1}, {bwd, 0}, {fwd, 2}, {bwd, 1}, {bwd, 2}} {
					if err := s.fn(s.i); err != nil {
						return err
					}
				}
				if got := f.Traffic(); got != before {
					fail("the micro-batches communicated: traffic %+v, before them %+v", got, before)
				}
				if got := f.Bytes().Gathered; got != all {
					fail("after the micro-batches %d bytes gathered of %d", got, all)
				}
			}
			if reshardFirst {
				if err := f.Reshard(ctx); err != nil {
					return err
				}
			}
			before := f.Traffic().ReduceScatter
			if err := f.Finish(ctx); err != nil {
				return err
			}
			var rs int64
			for _, u := range f.Units() {
				rs += 8 * int64(u.Chunk)
			}
			if got := f.Traffic().ReduceScatter - before; controlled && got != rs {
				fail("Finish sent %d bytes of reduce-scatters, want %d (one per unit)", got, rs)
			}
			if err := f.Reshard(ctx); err != nil {
				return err
			}
			if got := f.Bytes().Gathered; got != 0 {
				fail("after Reshard %d bytes gathered", got)
			}
			for _, p := range f.Params() {
				if p.Grad() == nil {
					continue
				}
				full, err := p.Grad().Full(ctx)
				if err != nil {
					return err
				}
				mu.Lock()
				grads[run][p.Name()] = full.([]float64)
				mu.Unlock()
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range problems {
		t.Error(p)
	}
	for run, what := range []string{1: "controlled", 2: "controlled, Reshard before Finish"} {
		if run == 0 {
			continue
		}
		if len(grads[run]) == 0 || len(grads[run]) != len(grads[0]) {
			t.Fatalf("%s: %d gradients, plain FSDP %d", what, len(grads[run]), len(grads[0]))
		}
		for name, want := range grads[0] {
			got := grads[run][name]
			for i := range want {
				if math.Abs(got[i]-want[i]) > 1e-12 {
					t.Errorf("%s: %s[%d]: %v, plain FSDP %v", what, name, i, got[i], want[i])
					break
				}
			}
		}
	}
}

// TestControlRefuses: the controls name what is wrong, before any
// communication.
func TestControlRefuses(t *testing.T) {
	ctx := context.Background()
	err := placementtest.Simulate(ctx, []int{2}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newFnet(m, comm.Float64)
		if err != nil {
			return err
		}
		f, err := New(ctx, m)
		if err != nil {
			return err
		}
		if err := f.Unshard(ctx); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Unshard with no units: %v, want ErrInvalid", err)
		}
		if err := f.Wrap(ctx, "head", n.head); err != nil {
			return err
		}
		if err := f.Wrap(ctx, "head", n.spare); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Wrap of a second module at a unit's path: %v, want ErrInvalid", err)
		}
		if _, err := f.UnshardAsync(ctx, "head", "nope"); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("UnshardAsync of a path that is not a unit: %v, want ErrInvalid", err)
		}
		if err := f.Reshard(ctx, "nope"); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Reshard of a path that is not a unit: %v, want ErrInvalid", err)
		}
		if err := f.Close(); err != nil {
			return err
		}
		if err := f.Unshard(ctx, "head"); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Unshard after Close: %v, want ErrInvalid", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
