package fsdp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// fsdpVariant is one FSDP configuration on 4 data-parallel ranks.
type fsdpVariant struct {
	name  string
	shape []int
	names []string
	dt    comm.DType
	opts  []Option
	// units are the FullyShard patterns (default "h.*"); ckpt
	// checkpoints the blocks: their bodies, and the units inside them,
	// run again during backward.
	units []string
	ckpt  bool
}

// fsdpVariants are every reshard policy, ZeRO stage, HSDP, bfloat16
// gathers and prefetch off, on 4 ranks.
func fsdpVariants() []fsdpVariant {
	one, hsdp := []string{"fsdp"}, []string{"dp", "fsdp"}
	f64 := comm.Float64
	return []fsdpVariant{
		{name: "reshard", shape: []int{4}, names: one, dt: f64},
		{name: "reshard false", shape: []int{4}, names: one, dt: f64, opts: []Option{WithReshard(false)}},
		{name: "reshard to 2 of 4", shape: []int{4}, names: one, dt: f64, opts: []Option{WithReshardTo(2)}},
		{name: "zero2", shape: []int{4}, names: one, dt: f64, opts: []Option{WithZeROStage(2)}},
		{name: "zero1", shape: []int{4}, names: one, dt: f64, opts: []Option{WithZeROStage(1)}},
		{name: "hsdp 2x2", shape: []int{2, 2}, names: hsdp, dt: f64, opts: []Option{WithReplicateAxis("dp")}},
		{name: "bfloat16 gathers", shape: []int{4}, names: one, dt: comm.Float32, opts: []Option{WithMixedPrecision(comm.BFloat16)}},
		{name: "no prefetch", shape: []int{4}, names: one, dt: f64, opts: []Option{WithPrefetch(false)}},
	}
}

// passGrads runs the micro-batches of pattern on the net, one letter
// each (micro-batch i draws seed i+1): P a plain forward and backward, N
// one inside NoSync, R one inside NoReplicaSync; then Finish. It returns
// rank 0's full gradients by parameter name. Without fsdp it runs every
// micro-batch plainly on one rank: the reference.
func passGrads(t *testing.T, v fsdpVariant, fsdp bool, pattern string) map[string][]float64 {
	t.Helper()
	shape, names := v.shape, v.names
	if !fsdp {
		shape, names = []int{1}, []string{"fsdp"}
	}
	var mu sync.Mutex
	got := map[string][]float64{}
	err := placementtest.Simulate(context.Background(), shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newFnet(m, v.dt)
		if err != nil {
			return err
		}
		var f *FSDP
		params, err := parallel.Params(n)
		if err != nil {
			return err
		}
		if fsdp {
			units := v.units
			if units == nil {
				units = []string{"h.*"}
			}
			if f, err = FullyShard(ctx, n, units, v.opts...); err != nil {
				return err
			}
			params = f.Params()
		}
		if v.ckpt {
			if err := parallel.Checkpoint(n, []string{"h.*"}); err != nil {
				return err
			}
		}
		for i, c := range pattern {
			run := func() error {
				l, err := n.forward(ctx, m, uint64(i+1), fnetB)
				if err != nil {
					return err
				}
				return n.tape.Backward(ctx, l)
			}
			switch {
			case f == nil || c == 'P':
				err = run()
			case c == 'N':
				err = f.NoSync(run)
			case c == 'R':
				err = f.NoReplicaSync(ctx, run)
			}
			if err != nil {
				return fmt.Errorf("micro-batch %d (%c): %w", i, c, err)
			}
		}
		if f != nil {
			if err := f.Finish(ctx); err != nil {
				return err
			}
		}
		for _, p := range params {
			if p.Grad() == nil {
				continue
			}
			g, err := p.Grad().Full(ctx)
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				mu.Lock()
				got[p.Name()] = toF64(g)
				mu.Unlock()
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s %s (fsdp %v): %v", v.name, pattern, fsdp, err)
	}
	return got
}

// TestFSDPBackwardPasses runs several forward and backward passes before
// one Finish, plainly (FSDP2's accumulation: each pass reduces and adds
// to the sharded gradient) and mixed with NoSync and NoReplicaSync, in
// every configuration: the gradients are one rank's gradients of all the
// passes (bfloat16 gathers: the same configuration's NoSync
// accumulation, which TestFSDPParity checks against one rank). FSDP used
// to drop every pass after the first, with no error. Units inside
// checkpointed blocks are entered again while backward recomputes the
// blocks: that is no new pass, their output hooks must record the same
// ops both times, and their enter hooks must not prefetch the next unit
// of forward (they used to fail the recomputation: an op that differs,
// then a pooled slot held by that prefetch).
func TestFSDPBackwardPasses(t *testing.T) {
	one := []string{"fsdp"}
	ckpt := []fsdpVariant{
		{name: "checkpointed units", shape: []int{4}, names: one, dt: comm.Float64, ckpt: true},
		{name: "units in checkpointed blocks", shape: []int{4}, names: one, dt: comm.Float64, ckpt: true, units: []string{"h.*.mlp"}},
		{name: "units in checkpointed blocks, reshard to 2", shape: []int{4}, names: one, dt: comm.Float64, ckpt: true, units: []string{"h.*.mlp"}, opts: []Option{WithReshardTo(2)}},
		{name: "units in checkpointed blocks, zero2", shape: []int{4}, names: one, dt: comm.Float64, ckpt: true, units: []string{"h.*.mlp"}, opts: []Option{WithZeROStage(2)}},
		{name: "units in checkpointed blocks, reshard false", shape: []int{4}, names: one, dt: comm.Float64, ckpt: true, units: []string{"h.*.mlp"}, opts: []Option{WithReshard(false)}},
	}
	for _, v := range append(fsdpVariants(), ckpt...) {
		patterns := []string{"PP", "PPP", "PNP", "NPP"}
		if len(v.shape) == 2 {
			patterns = append(patterns, "PRP", "RPRP")
		}
		t.Run(v.name, func(t *testing.T) {
			for _, pat := range patterns {
				var want map[string][]float64
				tol := 1e-10
				if v.dt == comm.Float32 {
					// The reference is the same gathers with one
					// reduction of the summed passes.
					want, tol = passGrads(t, v, true, strings.Repeat("N", len(pat)-1)+"P"), 1e-4
				} else {
					want = passGrads(t, v, false, pat)
				}
				got := passGrads(t, v, true, pat)
				if len(got) != len(want) || len(want) == 0 {
					t.Fatalf("%s: %d gradients, want %d", pat, len(got), len(want))
				}
				for name, w := range want {
					g := got[name]
					if len(g) != len(w) {
						t.Fatalf("%s: %s has %d elements, want %d", pat, name, len(g), len(w))
					}
					for k := range w {
						if !closeTo(g[k], w[k], tol) {
							t.Fatalf("%s: %s[%d] = %.10g, want %.10g (one rank's sum of the passes)", pat, name, k, g[k], w[k])
						}
					}
				}
			}
		})
	}
}

// TestFSDPBackwardTwiceMLP is the case: FullyShard(mlp, fc and
// proj), the same forward, Sum and Backward twice, then Finish: every
// gradient is twice one pass's.
func TestFSDPBackwardTwiceMLP(t *testing.T) {
	for _, v := range fsdpVariants() {
		t.Run(v.name, func(t *testing.T) {
			var mu sync.Mutex
			grads := map[int]map[string][]float64{} // by passes
			for _, passes := range []int{1, 2} {
				err := placementtest.Simulate(context.Background(), v.shape, v.names, func(ctx context.Context, m *mesh.Mesh) error {
					mlp, tape, x, err := newShardMLP(m, v.dt)
					if err != nil {
						return err
					}
					f, err := FullyShard(ctx, mlp, []string{"fc", "proj"}, v.opts...)
					if err != nil {
						return err
					}
					for range passes {
						y, err := mlp.Forward(ctx, x)
						if err != nil {
							return err
						}
						l, err := autograd.Sum(y)
						if err != nil {
							return err
						}
						if err := tape.Backward(ctx, l); err != nil {
							return err
						}
					}
					if err := f.Finish(ctx); err != nil {
						return err
					}
					for _, p := range f.Params() {
						g, err := p.Grad().Full(ctx)
						if err != nil {
							return err
						}
						if m.Rank() == 0 {
							mu.Lock()
							if grads[passes] == nil {
								grads[passes] = map[string][]float64{}
							}
							grads[passes][p.Name()] = toF64(g)
							mu.Unlock()
						}
					}
					return nil
				})
				if err != nil {
					t.Fatalf("%d passes: %v", passes, err)
				}
			}
			if len(grads[1]) != 4 {
				t.Fatalf("gradients of %d parameters, want 4", len(grads[1]))
			}
			for name, one := range grads[1] {
				for k, g1 := range one {
					if g2 := grads[2][name][k]; !closeTo(g2, 2*g1, 1e-6) || g1 == 0 {
						t.Fatalf("%s[%d]: %.6g after two passes, one pass %.6g; want twice", name, k, g2, g1)
					}
				}
			}
		})
	}
}

// newShardMLP makes an MLP 5 → 7 → 3 of dtype dt on m and an input of 8
// rows sharded over the data axes.
func newShardMLP(m *mesh.Mesh, dt comm.DType) (*parallel.MLP, *autograd.Tape, *autograd.Value, error) {
	tape := autograd.NewTape()
	mlp, err := parallel.NewMLP(tape, m, 5, 7, parallel.WithName("mlp"), parallel.WithDType(dt), parallel.WithInit(parallel.Normal(0.3, 1)), parallel.WithBiasInit(parallel.Normal(0.1, 2)))
	if err != nil {
		return nil, nil, nil, err
	}
	spec, err := placement.NewSpec(m, []int{8, 5}, dt, ptest.DataPlaces(m))
	if err != nil {
		return nil, nil, nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{8, 5}, dt, 3))
	if err != nil {
		return nil, nil, nil, err
	}
	x, err := tape.Constant(xd)
	return mlp, tape, x, err
}

// meshRun runs fn on a simulated mesh with a short communicator timeout
// and returns every rank's error.
func meshRun(shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error) []error {
	p := 1
	for _, s := range shape {
		p *= s
	}
	errs := make([]error, p)
	_ = local.Run(context.Background(), p, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, shape, names)
		if err == nil {
			err = fn(ctx, m)
		}
		errs[world.Rank()] = err
		return err
	}, local.WithOptions(comm.Options{Timeout: 2 * time.Second}))
	return errs
}

// TestFSDPSkippedUnit is the second case: rank 1 runs only the
// MLP's fc, the others the whole MLP. Every rank must fail with
// ErrMismatch naming rank 1 and the unit it did not run, in every
// configuration; WithReshard(false), ZeRO-2 and ZeRO-1 used to give a wrong
// proj.bias with no error (rank 1 issues the same collectives: proj is
// gathered by the prefetch and reduced with zeros). TestFSDPNonSPMD skips
// a whole block on rank 1.
func TestFSDPSkippedUnit(t *testing.T) {
	for _, v := range fsdpVariants() {
		t.Run(v.name, func(t *testing.T) {
			errs := meshRun(v.shape, v.names, func(ctx context.Context, m *mesh.Mesh) error {
				mlp, tape, x, err := newShardMLP(m, v.dt)
				if err != nil {
					return err
				}
				f, err := FullyShard(ctx, mlp, []string{"fc", "proj"}, v.opts...)
				if err != nil {
					return err
				}
				err = func() error {
					var y *autograd.Value
					var err error
					if m.Rank() == 1 {
						y, err = mlp.FC.Forward(ctx, x)
					} else {
						y, err = mlp.Forward(ctx, x)
					}
					if err != nil {
						return errors.Join(err, f.Discard(ctx))
					}
					l, err := autograd.Sum(y)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, l); err != nil {
						return errors.Join(err, f.Discard(ctx))
					}
					return f.Finish(ctx)
				}()
				return err
			})
			for r, err := range errs {
				if !errors.Is(err, loom.ErrMismatch) || !strings.Contains(err.Error(), "rank 1 has") || !strings.Contains(err.Error(), `"proj"`) {
					t.Errorf("rank %d: %v; want ErrMismatch naming rank 1 and unit proj", r, err)
				}
			}
		})
	}
}
