package fsdp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestFSDPOverTP shards the transformer block of tp_test on the "dp" axis
// of a dp=2 × tp=2 mesh after Parallelize (with and without sequence
// parallelism): the gradients, after Finish and ReduceGrads, are laid out
// like the sharded parameters (TP outer, FSDP inner) and equal the serial
// ones, in two steps (the second gathers again).
func TestFSDPOverTP(t *testing.T) {
	_, want := ptest.GradsOf(t, 1, 1, false, false)
	for _, sp := range []bool{false, true} {
		t.Run(fmt.Sprintf("sp=%v", sp), func(t *testing.T) {
			var mu sync.Mutex
			got := map[string][]float64{}
			err := placementtest.Simulate(context.Background(), []int{2, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				b, tape, err := ptest.NewBlock(m)
				if err != nil {
					return err
				}
				if err := tp.Parallelize(ctx, b, "tp", ptest.BlockPlan(sp)); err != nil {
					return err
				}
				f, err := New(ctx, m, WithShardAxis("dp"))
				if err != nil {
					return err
				}
				for _, c := range b.Children() {
					if err := f.Wrap(ctx, c.Name, c.Module); err != nil {
						return err
					}
				}
				params := f.Params()
				for step := range 2 {
					for _, p := range params {
						p.ZeroGrad()
					}
					l, err := b.Loss(ctx, tape, m, sp)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, l); err != nil {
						return err
					}
					if err := f.Finish(ctx); err != nil {
						return err
					}
					if err := tp.ReduceGrads(ctx, params); err != nil {
						return err
					}
					for _, p := range params {
						if !p.Grad().Spec().Equal(p.Spec()) {
							return fmt.Errorf("step %d: gradient of %q is %v, parameter %v", step, p.Name(), p.Grad().Spec(), p.Spec())
						}
						g, err := p.Grad().Full(ctx)
						if err != nil {
							return err
						}
						if m.Rank() == 0 {
							mu.Lock()
							got[fmt.Sprint(step, p.Name())] = g.([]float64)
							mu.Unlock()
						}
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			for step := range 2 {
				for name, w := range want {
					g := got[fmt.Sprint(step, name)]
					if len(g) != len(w) {
						t.Fatalf("step %d %s: %d elements, want %d", step, name, len(g), len(w))
					}
					for k := range w {
						if !closeTo(g[k], w[k], 1e-10) {
							t.Fatalf("step %d %s[%d] = %g, want %g", step, name, k, g[k], w[k])
						}
					}
				}
			}
		})
	}
}

// fsdpRun runs fn on a simulated fsdp mesh of p ranks with a short
// communicator timeout and returns every rank's error.
func fsdpRun(t *testing.T, p int, fn func(ctx context.Context, m *mesh.Mesh) error) []error {
	t.Helper()
	return meshRun([]int{p}, []string{"fsdp"}, fn)
}

// TestTraffic checks the collectives of one step against the formula
// of each policy, from the flight recorders and from Traffic. A unit of
// chunk c elements (its largest rank share plus the 2-element tag, see
// UnitInfo.Chunk) of e bytes each is all-gathered with c·e bytes sent in
// per rank (the recorder's count) over p ranks, which is (p−1)·c·e bytes
// on the wire per rank ((p−1)/p of the padded unit p·c·e); its
// reduce-scatter likewise. WithReshard(true): two all-gathers per unit (the
// root one) and one reduce-scatter; WithReshard(false): one and one;
// WithReshardTo(n): one over p, one over n of (p/n)·c·e, one reduce-scatter.
func TestTraffic(t *testing.T) {
	const p = 4
	cases := []struct {
		name   string
		opts   []Option
		ag     func(u UnitInfo) int64 // all-gather bytes recorded per unit
		group  func(u UnitInfo) int64
		elem   int64
		rsElem int64
	}{
		{"reshard", nil, func(u UnitInfo) int64 {
			if u.Root {
				return 1
			}
			return 2
		}, nil, 8, 8},
		{"keep", []Option{WithReshard(false)}, func(UnitInfo) int64 { return 1 }, nil, 8, 8},
		{"reshard to 2", []Option{WithReshardTo(2)}, func(UnitInfo) int64 { return 1 }, func(u UnitInfo) int64 {
			if u.Root {
				return 0
			}
			return p / 2
		}, 8, 8},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			errs := fsdpRun(t, p, func(ctx context.Context, m *mesh.Mesh) error {
				n, err := newFnet(m, comm.Float64)
				if err != nil {
					return err
				}
				f, err := FullyShard(ctx, n, []string{"h.*"}, c.opts...)
				if err != nil {
					return err
				}
				if err := n.step(ctx, m, f); err != nil {
					return err
				}
				var wantAG, wantGroup, wantRS int64
				for _, u := range f.Units() {
					wantAG += c.ag(u) * int64(u.Chunk) * c.elem
					if c.group != nil {
						wantGroup += c.group(u) * int64(u.Chunk) * c.elem
					}
					wantRS += int64(u.Chunk) * c.rsElem
				}
				sum := func(cm comm.Communicator, op comm.Op) int64 {
					if cm == nil {
						return 0
					}
					var s int64
					for _, e := range cm.Recorder().Entries() {
						if e.Op == op.String() {
							s += e.Bytes
						}
					}
					return s
				}
				gotAG, gotGroup, gotRS := sum(f.ag, comm.OpAllGather), sum(f.group, comm.OpAllGather), sum(f.rs, comm.OpReduceScatter)
				if gotAG != wantAG || gotGroup != wantGroup || gotRS != wantRS {
					return fmt.Errorf("recorded all-gather %d B, group all-gather %d B, reduce-scatter %d B; want %d, %d, %d", gotAG, gotGroup, gotRS, wantAG, wantGroup, wantRS)
				}
				tr := f.Traffic()
				if want := (p-1)*wantAG + (2-1)*wantGroup; tr.AllGather != want {
					return fmt.Errorf("Traffic().AllGather %d, want %d", tr.AllGather, want)
				}
				if tr.ReduceScatter != (p-1)*wantRS {
					return fmt.Errorf("Traffic().ReduceScatter %d, want %d", tr.ReduceScatter, (p-1)*wantRS)
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

// TestFSDPMixedPrecisionBytes checks that bfloat16 gathers send half the
// bytes of float32 ones.
func TestFSDPMixedPrecisionBytes(t *testing.T) {
	sent := map[bool]int64{}
	var mu sync.Mutex
	for _, mp := range []bool{false, true} {
		errs := fsdpRun(t, 2, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newFnet(m, comm.Float32)
			if err != nil {
				return err
			}
			var opts []Option
			if mp {
				opts = append(opts, WithMixedPrecision(comm.BFloat16))
			}
			f, err := FullyShard(ctx, n, []string{"h.*"}, opts...)
			if err != nil {
				return err
			}
			if _, err := n.forward(ctx, m, 1, fnetB); err != nil {
				return err
			}
			mu.Lock()
			sent[mp] = f.Traffic().AllGather
			mu.Unlock()
			return f.Discard(ctx)
		})
		for r, err := range errs {
			if err != nil {
				t.Fatalf("mp=%v rank %d: %v", mp, r, err)
			}
		}
	}
	if sent[true]*2 != sent[false] || sent[true] == 0 {
		t.Fatalf("all-gather bytes: bfloat16 %d, float32 %d; want half", sent[true], sent[false])
	}
}

// userHolder holds a parameter but cannot have it swapped.
type userHolder struct {
	parallel.Hooks
	w *autograd.Value
}

func (u *userHolder) Children() []parallel.Child   { return nil }
func (u *userHolder) OwnParams() []*autograd.Value { return []*autograd.Value{u.w} }

// TestFSDPBadInput checks that misuse is refused with ErrInvalid (ranks
// disagreeing: ErrMismatch) on every rank, before any parameter changes.
func TestFSDPBadInput(t *testing.T) {
	cases := []struct {
		name string
		want error
		fn   func(ctx context.Context, m *mesh.Mesh, n *fnet) error
	}{
		{"missing axis", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithShardAxis("zero"))
			return err
		}},
		{"replicate axis missing", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithReplicateAxis("dp"))
			return err
		}},
		{"reshard group", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithReshardTo(3))
			return err
		}},
		{"stage", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithZeROStage(4))
			return err
		}},
		{"stage 0", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithZeROStage(0))
			return err
		}},
		// WithReshardTo(0) used to mean WithReshard(false) and WithReshardTo(-1)
		// WithReshard(true), while WithReshardTo(-2) was refused.
		{"pattern matches no module", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			_, err := FullyShard(ctx, n, []string{"h.*", "blocks.*"})
			return err
		}},
		{"reshard to 0", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			_, err := FullyShard(ctx, n, []string{"h.*"}, WithReshardTo(0))
			return err
		}},
		{"reshard to -1", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			_, err := FullyShard(ctx, n, []string{"h.*"}, WithReshardTo(-1))
			return err
		}},
		{"reshard to -2", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithReshardTo(-2))
			return err
		}},
		// +Inf used to zero every gradient, 0 to mean no division.
		{"divide by +Inf", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			_, err := FullyShard(ctx, n, []string{"h.*"}, WithGradientDivideFactor(math.Inf(1)))
			return err
		}},
		{"divide by 0", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			_, err := FullyShard(ctx, n, []string{"h.*"}, WithGradientDivideFactor(0))
			return err
		}},
		{"divide by -0", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithGradientDivideFactor(math.Copysign(0, -1)))
			return err
		}},
		{"divide by -2", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithGradientDivideFactor(-2))
			return err
		}},
		{"divide by NaN", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithGradientDivideFactor(math.NaN()))
			return err
		}},
		{"divide by -Inf", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, _ *fnet) error {
			_, err := New(ctx, m, WithGradientDivideFactor(math.Inf(-1)))
			return err
		}},
		{"wrapped twice", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			if err := f.Wrap(ctx, "h.0", n.list.blocks[0]); err != nil {
				return err
			}
			return f.Wrap(ctx, "h.0", n.list.blocks[0])
		}},
		{"child after parent", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			if err := f.Wrap(ctx, "h.0", n.list.blocks[0]); err != nil {
				return err
			}
			return f.Wrap(ctx, "h.0.mlp", n.list.blocks[0].mlp)
		}},
		{"shard dim", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			return f.Wrap(ctx, "head", n.head, WithShardDim("head.weight", 2))
		}},
		{"not a setter", ErrInvalid, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			return f.Wrap(ctx, "u", &userHolder{w: n.spare.Weight})
		}},
		{"ranks disagree", loom.ErrMismatch, func(ctx context.Context, m *mesh.Mesh, n *fnet) error {
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			dim := m.Rank() % 2 // rank 1 shards head.weight's columns
			return f.Wrap(ctx, "head", n.head, WithShardDim("head.weight", dim))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			errs := fsdpRun(t, 2, func(ctx context.Context, m *mesh.Mesh) error {
				n, err := newFnet(m, comm.Float64)
				if err != nil {
					return err
				}
				before := n.head.Weight
				sent := traffic(m)
				err = c.fn(ctx, m, n)
				if c.name == "shard dim" && n.head.Weight != before {
					return fmt.Errorf("a refused Wrap replaced the parameter")
				}
				// A bad option is refused before any data moves.
				if strings.Contains(c.name, "divide") || strings.HasPrefix(c.name, "reshard to") || strings.HasPrefix(c.name, "stage") {
					if n.head.Weight != before {
						return errors.Join(err, fmt.Errorf("a refused option replaced the parameters"))
					}
					if now := traffic(m); now != sent {
						return errors.Join(err, fmt.Errorf("a refused option issued %d collectives", now-sent))
					}
				}
				return err
			})
			for r, err := range errs {
				if !errors.Is(err, c.want) {
					t.Errorf("rank %d: %v, want %v", r, err, c.want)
				}
			}
		})
	}
}

// traffic counts the calls the flight recorder of m's world communicator
// holds.
func traffic(m *mesh.Mesh) int {
	return len(m.World().Recorder().Entries())
}

// TestFSDPNonSPMD runs a step where rank 1 skips block h.1's forward:
// every rank must fail with an error naming a unit, within the timeout,
// with prefetch on and off; under WithReshard(false), where rank 1 issues
// the same collectives as rank 0 and only the unit-order check can tell,
// with ErrMismatch naming rank 1 and the units that differ.
func TestFSDPNonSPMD(t *testing.T) {
	for _, c := range []struct {
		name     string
		opt      Option
		want     string
		mismatch bool
	}{
		{"prefetch=true", WithPrefetch(true), `unit "h.`, false},
		{"prefetch=false", WithPrefetch(false), `unit "h.`, false},
		{"reshard=false", WithReshard(false), `rank 1 has "h.2" at position 2 where rank 0 has "h.1"`, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			errs := fsdpRun(t, 2, func(ctx context.Context, m *mesh.Mesh) error {
				n, err := newFnet(m, comm.Float64)
				if err != nil {
					return err
				}
				f, err := FullyShard(ctx, n, []string{"h.*"}, c.opt)
				if err != nil {
					return err
				}
				if m.Rank() == 1 {
					n.list.blocks = append(n.list.blocks[:1:1], n.list.blocks[2:]...)
				}
				l, err := n.forward(ctx, m, 1, fnetB)
				if err == nil {
					err = n.tape.Backward(ctx, l)
				}
				if err != nil {
					return errors.Join(err, f.Discard(ctx))
				}
				return f.Finish(ctx)
			})
			for r, err := range errs {
				if err == nil || !strings.Contains(err.Error(), c.want) || c.mismatch && !errors.Is(err, loom.ErrMismatch) {
					t.Errorf("rank %d: %v; want an error containing %s (ErrMismatch: %v)", r, err, c.want, c.mismatch)
				}
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("took %v", d)
			}
		})
	}
}

// TestFSDPClipGradNorm checks that ClipGradNorm over the sharded
// gradients computes the global norm: the serial net's.
func TestFSDPClipGradNorm(t *testing.T) {
	norms := map[int]float64{}
	var mu sync.Mutex
	for _, p := range []int{1, 3} {
		errs := fsdpRun(t, p, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newFnet(m, comm.Float64)
			if err != nil {
				return err
			}
			params, err := parallel.Params(n)
			if err != nil {
				return err
			}
			var f *FSDP
			if p > 1 {
				if f, err = FullyShard(ctx, n, []string{"h.*"}); err != nil {
					return err
				}
				params = f.Params()
			}
			if err := n.step(ctx, m, f); err != nil {
				return err
			}
			norm, err := optim.ClipGradNorm(ctx, params, 1e9, optim.WithAllowFrozen()) // the spare Linear is never used
			if err != nil {
				return err
			}
			mu.Lock()
			norms[p] = norm
			mu.Unlock()
			return nil
		})
		for r, err := range errs {
			if err != nil {
				t.Fatalf("p=%d rank %d: %v", p, r, err)
			}
		}
	}
	if norms[1] == 0 || !closeTo(norms[3], norms[1], 1e-12) {
		t.Fatalf("norm over shards %v, serial %v", norms[3], norms[1])
	}
}

// TestBytes checks the memory accounting through a step: the sharded
// parameters are 1/p of the model (up to uneven shards), gradients on the
// gathered parameters are dropped after their reduce-scatter (their
// memory kept for reuse), after Finish nothing is gathered, and later
// steps hold exactly what the first did.
func TestBytes(t *testing.T) {
	const p = 2
	errs := fsdpRun(t, p, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newFnet(m, comm.Float64)
		if err != nil {
			return err
		}
		all, err := parallel.Params(n)
		if err != nil {
			return err
		}
		// Shares differ by at most one row of each parameter.
		var total, slack int64
		for _, q := range all {
			total += int64(len(q.Data().LocalData().([]float64))) * 8
			slack += int64(blocks.Prod(q.Spec().Shape()[1:])) * 8
		}
		f, err := FullyShard(ctx, n, []string{"h.*"})
		if err != nil {
			return err
		}
		b := f.Bytes()
		if b.Sharded > total/p+slack || b.Sharded < total/p-slack {
			return fmt.Errorf("sharded %d B of a %d B model over %d ranks", b.Sharded, total, p)
		}
		l, err := n.forward(ctx, m, 1, fnetB)
		if err != nil {
			return err
		}
		// After forward only the root stays gathered.
		if b := f.Bytes(); b.Gathered == 0 || b.Gathered >= total {
			return fmt.Errorf("after forward: gathered %d B of %d", b.Gathered, total)
		}
		if err := n.tape.Backward(ctx, l); err != nil {
			return err
		}
		// Every unit but the root has reduced and dropped its gradients,
		// their memory kept only for the units whose backward follows (at
		// most one block's); the root's unused spare keeps it from being
		// ready, so the head's wait for Finish.
		b = f.Bytes()
		head, pooled := int64(fnetV*fnetD+fnetV)*8, f.gradPool.bytes()
		blk := int64(2*fnetD+2*fnetH*fnetD+fnetH+fnetD) * 8 // ln, fc, proj
		if b.UnshardedGrads != head+pooled || pooled > 2*blk {
			return fmt.Errorf("after backward: %d B of unsharded gradients, want %d (the head's) + %d kept for reuse, at most two blocks' (%d)", b.UnshardedGrads, head, pooled, 2*blk)
		}
		if err := f.Finish(ctx); err != nil {
			return err
		}
		// Between steps only the pool is left: the head's memory and at
		// most two blocks', for the next backward.
		b = f.Bytes()
		if b.Gathered != 0 || b.UnshardedGrads != f.gradPool.bytes() || b.UnshardedGrads > head+2*blk || b.ShardedGrads == 0 || b.Staging == 0 || b.Unsharded == 0 {
			return fmt.Errorf("after Finish: %+v", b)
		}
		// Later steps reuse that memory: the accounting after each is the
		// first's, so nothing grows with the step count.
		for step := 2; step <= 4; step++ {
			if err := n.step(ctx, m, f); err != nil {
				return err
			}
			if got := f.Bytes(); got != b {
				return fmt.Errorf("after step %d: %+v, after step 1: %+v", step, got, b)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestFSDPGradientScale checks WithAverage (1/p over the data-parallel
// ranks) and WithGradientDivideFactor (1/f) against the summed gradients.
func TestFSDPGradientScale(t *testing.T) {
	grads := map[string][]float64{}
	var mu sync.Mutex
	cases := []struct {
		name string
		opts []Option
		div  float64
	}{{"sum", nil, 1}, {"average", []Option{WithAverage()}, 3}, {"divide", []Option{WithGradientDivideFactor(0.5)}, 0.5}}
	for _, c := range cases {
		errs := fsdpRun(t, 3, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newFnet(m, comm.Float64)
			if err != nil {
				return err
			}
			f, err := FullyShard(ctx, n, []string{"h.*"}, c.opts...)
			if err != nil {
				return err
			}
			if err := n.step(ctx, m, f); err != nil {
				return err
			}
			g, err := n.head.Weight.Grad().Full(ctx)
			if err != nil {
				return err
			}
			mu.Lock()
			grads[c.name] = g.([]float64)
			mu.Unlock()
			return nil
		})
		for r, err := range errs {
			if err != nil {
				t.Fatalf("%s rank %d: %v", c.name, r, err)
			}
		}
	}
	for _, c := range cases {
		for k, w := range grads["sum"] {
			if g := grads[c.name][k]; !closeTo(g*c.div, w, 1e-12) {
				t.Fatalf("%s: head.weight[%d] = %g, want %g / %g", c.name, k, g, w, c.div)
			}
		}
	}
}

// TestFSDPExplicitPrefetch wraps the net by hand with explicit prefetch
// lists (two units ahead in forward, where the second is skipped while its
// slot is held, and none in backward): the gradients equal the default
// run's. A list naming no unit fails the first forward with ErrInvalid.
func TestFSDPExplicitPrefetch(t *testing.T) {
	grads := map[string][]float64{}
	var mu sync.Mutex
	for _, mode := range []string{"default", "explicit", "unknown"} {
		errs := fsdpRun(t, 2, func(ctx context.Context, m *mesh.Mesh) error {
			n, err := newFnet(m, comm.Float64)
			if err != nil {
				return err
			}
			f, err := New(ctx, m)
			if err != nil {
				return err
			}
			for i, b := range n.list.blocks {
				var opts []UnitOption
				switch {
				case mode == "explicit" && i == 0:
					opts = append(opts, WithPrefetchForward("h.1", "h.2"), WithPrefetchBackward())
				case mode == "explicit":
					opts = append(opts, WithPrefetchBackward(fmt.Sprintf("h.%d", i-1)))
				case mode == "unknown":
					opts = append(opts, WithPrefetchForward("h.9"))
				}
				if err := f.Wrap(ctx, fmt.Sprintf("h.%d", i), b, opts...); err != nil {
					return err
				}
			}
			if err := f.Wrap(ctx, "", n); err != nil {
				return err
			}
			if err := n.step(ctx, m, f); err != nil {
				return err
			}
			g, err := n.list.blocks[0].mlp.FC.Weight.Grad().Full(ctx)
			if err != nil {
				return err
			}
			mu.Lock()
			grads[mode] = g.([]float64)
			mu.Unlock()
			return nil
		})
		for r, err := range errs {
			if mode == "unknown" {
				if !errors.Is(err, ErrInvalid) {
					t.Errorf("unknown unit: rank %d: %v, want ErrInvalid", r, err)
				}
			} else if err != nil {
				t.Fatalf("%s rank %d: %v", mode, r, err)
			}
		}
	}
	if len(grads["default"]) == 0 {
		t.Fatal("no gradient")
	}
	for k, w := range grads["default"] {
		if g := grads["explicit"][k]; g != w {
			t.Fatalf("explicit prefetch: h.0.mlp.fc.weight[%d] = %g, default %g", k, g, w)
		}
	}
}

// TestFSDPSlotConflict wraps units so that a unit and one nested in it
// share a pooled buffer slot (h.0.mlp and h.0 are both even in wrap order
// among resharded units): the forward fails with ErrInvalid naming the
// slot's holder on every rank, rather than overwrite gathered parameters.
func TestFSDPSlotConflict(t *testing.T) {
	errs := fsdpRun(t, 2, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newFnet(m, comm.Float64)
		if err != nil {
			return err
		}
		f, err := New(ctx, m)
		if err != nil {
			return err
		}
		for _, w := range []struct {
			path string
			m    parallel.Module
		}{{"h.0.mlp", n.list.blocks[0].mlp}, {"h.1", n.list.blocks[1]}, {"h.0", n.list.blocks[0]}, {"", n}} {
			if err := f.Wrap(ctx, w.path, w.m); err != nil {
				return err
			}
		}
		_, err = n.forward(ctx, m, 1, fnetB)
		return errors.Join(err, f.Discard(ctx))
	})
	for r, err := range errs {
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `is held by unit "h.0`) {
			t.Errorf("rank %d: %v; want ErrInvalid naming the slot's holder", r, err)
		}
	}
}

// TestFSDPErrorsNameUnit: under WithReshardTo(2) on fsdp=4, rank 3 sleeps in
// proj's enter hook past the timeout. Every rank's error is a timeout
// wrapped with the FSDP operation and the unit it was in; rank 2, which
// waits for rank 3 in proj's all-gather within their WithReshardTo group,
// says which shard-axis rank each rank of the group's communicator is
// (its errors count from 0 within the group, so its "rank 1" is rank 3).
func TestFSDPErrorsNameUnit(t *testing.T) {
	const timeout = 300 * time.Millisecond
	errs := make([]error, 4)
	_ = local.Run(context.Background(), 4, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, []int{4}, []string{"fsdp"})
		if err != nil {
			return err
		}
		err = func() error {
			mlp, tape, x, err := newShardMLP(m, comm.Float64)
			if err != nil {
				return err
			}
			f, err := FullyShard(ctx, mlp, []string{"fc", "proj"}, WithReshardTo(2))
			if err != nil {
				return err
			}
			if m.Rank() == 3 {
				mlp.Proj.OnEnter(func(context.Context) error {
					time.Sleep(2 * timeout)
					return nil
				})
			}
			y, err := mlp.Forward(ctx, x)
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
		errs[world.Rank()] = err
		return err
	}, local.WithOptions(comm.Options{Timeout: timeout}))
	op := regexp.MustCompile(`fsdp: FSDP (all-gather|reduce-scatter|SPMD check) .*unit "(fc|proj)"`)
	for r, err := range errs {
		if !errors.Is(err, comm.ErrTimeout) || !op.MatchString(err.Error()) {
			t.Errorf("rank %d: %v; want a timeout naming the FSDP operation and unit", r, err)
		}
	}
	const group = `fsdp: FSDP all-gather of unit "proj" within its WithReshardTo(2) group (on its communicator group rank 0 is rank 2, group rank 1 is rank 3)`
	if err := errs[2]; err == nil || !strings.Contains(err.Error(), group) {
		t.Errorf("rank 2: %v; want %s", err, group)
	}
}
