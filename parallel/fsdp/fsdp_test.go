package fsdp

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// fnet is a small residual network built from this package's layers:
// x -> for each block: x + mlp(ln(x)) -> head -> cross entropy. The head
// has fewer rows (fnetV) than 4 ranks, so fsdp=4 has an empty shard; D and
// H split unevenly over 3.
type fnet struct {
	parallel.Hooks
	list  *flist
	head  *parallel.Linear
	spare *parallel.Linear // never used: no rank gives it a gradient
	tape  *autograd.Tape
	dt    comm.DType
	d, v  int
}

type flist struct {
	parallel.Hooks
	blocks []*fblock
}

type fblock struct {
	parallel.Hooks
	ln  *parallel.LayerNorm
	mlp *parallel.MLP
}

const (
	fnetB, fnetD, fnetH, fnetV, fnetBlocks = 24, 5, 7, 3, 3
)

func (n *fnet) Children() []parallel.Child {
	return []parallel.Child{{Name: "h", Module: n.list}, {Name: "head", Module: n.head}, {Name: "spare", Module: n.spare}}
}

func (l *flist) Children() []parallel.Child {
	out := make([]parallel.Child, len(l.blocks))
	for i, b := range l.blocks {
		out[i] = parallel.Child{Name: fmt.Sprint(i), Module: b}
	}
	return out
}

func (b *fblock) Children() []parallel.Child {
	return []parallel.Child{{Name: "ln", Module: b.ln}, {Name: "mlp", Module: b.mlp}}
}

func (b *fblock) Forward(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
	return b.Run(ctx, x, func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
		y, err := b.ln.Forward(ctx, x)
		if err != nil {
			return nil, err
		}
		if y, err = b.mlp.Forward(ctx, y); err != nil {
			return nil, err
		}
		return autograd.Add(x, y)
	})
}

func newFnet(m *mesh.Mesh, dt comm.DType, opts ...autograd.Option) (*fnet, error) {
	return newFnetSized(m, dt, fnetD, fnetH, fnetV, fnetBlocks, opts...)
}

// newFnetSized is newFnet with width d, hidden width h, v classes and the
// given number of blocks.
func newFnetSized(m *mesh.Mesh, dt comm.DType, d, h, v, blocks int, opts ...autograd.Option) (*fnet, error) {
	tape := autograd.NewTape(opts...)
	n := &fnet{tape: tape, dt: dt, list: &flist{}, d: d, v: v}
	for i := range blocks {
		name := fmt.Sprintf("h.%d", i)
		ln, err := parallel.NewLayerNorm(tape, m, d, parallel.WithName(name+".ln"), parallel.WithDType(dt), parallel.WithInit(parallel.Normal(0.5, uint64(10+i))), parallel.WithBiasInit(parallel.Normal(0.1, uint64(20+i))))
		if err != nil {
			return nil, err
		}
		mlp, err := parallel.NewMLP(tape, m, d, h, parallel.WithName(name+".mlp"), parallel.WithDType(dt), parallel.WithInit(parallel.Normal(0.3, uint64(30+i))), parallel.WithBiasInit(parallel.Normal(0.1, uint64(40+i))))
		if err != nil {
			return nil, err
		}
		n.list.blocks = append(n.list.blocks, &fblock{ln: ln, mlp: mlp})
	}
	var err error
	if n.head, err = parallel.NewLinear(tape, m, d, v, parallel.WithName("head"), parallel.WithDType(dt), parallel.WithInit(parallel.Normal(0.3, 50)), parallel.WithBiasInit(parallel.Normal(0.1, 51))); err != nil {
		return nil, err
	}
	n.spare, err = parallel.NewLinear(tape, m, 2, 2, parallel.WithName("spare"), parallel.WithDType(dt))
	return n, err
}

// step runs forward and backward on the first full batch and, when f is
// not nil, f.Finish.
func (n *fnet) step(ctx context.Context, m *mesh.Mesh, f *FSDP) error {
	l, err := n.forward(ctx, m, 1, fnetB)
	if err != nil {
		return err
	}
	if err := n.tape.Backward(ctx, l); err != nil {
		return err
	}
	if f == nil {
		return nil
	}
	return f.Finish(ctx)
}

// forward records the loss of micro-batch rows (seed-drawn).
func (n *fnet) forward(ctx context.Context, m *mesh.Mesh, seed uint64, rows int) (*autograd.Value, error) {
	if err := n.Enter(ctx); err != nil {
		return nil, err
	}
	spec, err := placement.NewSpec(m, []int{rows, n.d}, n.dt, ptest.DataPlaces(m))
	if err != nil {
		return nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{rows, n.d}, n.dt, seed))
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	targets := make([]int64, rows)
	for i := range targets {
		targets[i] = int64(rng.IntN(n.v))
	}
	y, err := autograd.IndicesFromFull(m, []int{rows}, ptest.DataPlaces(m), targets)
	if err != nil {
		return nil, err
	}
	x, err := n.tape.Constant(xd)
	if err != nil {
		return nil, err
	}
	for _, b := range n.list.blocks {
		if x, err = b.Forward(ctx, x); err != nil {
			return nil, err
		}
	}
	logits, err := n.head.Forward(ctx, x)
	if err != nil {
		return nil, err
	}
	l, err := autograd.CrossEntropy(logits, y)
	if err != nil {
		return nil, err
	}
	return n.Output(ctx, l)
}

// trainCase is one FSDP configuration trained against the serial net.
type trainCase struct {
	name    string
	shape   []int
	names   []string
	opts    []Option
	dt      comm.DType
	accum   int  // micro-batches per step (NoSync for all but the last)
	noRep   bool // NoReplicaSync instead of NoSync
	recycle bool
	tol     float64
	// paramTol, when set, bounds the final parameters' absolute error
	// instead of tol.
	paramTol float64
}

// train runs steps of AdamW on the net (FSDP-wrapped unless fsdp is
// false) and returns every step's loss and the final full parameters.
func train(t *testing.T, c trainCase, fsdp bool, steps int) ([]float64, map[string][]float64) {
	t.Helper()
	shape, names := c.shape, c.names
	if !fsdp {
		shape, names = []int{1}, []string{"fsdp"}
	}
	accum := max(c.accum, 1)
	var (
		mu     sync.Mutex
		losses = make([]float64, steps)
		params = map[string][]float64{}
	)
	err := placementtest.Simulate(context.Background(), shape, names, func(ctx context.Context, m *mesh.Mesh) error {
		var topts []autograd.Option
		if c.recycle {
			topts = append(topts, autograd.WithRecycling())
		}
		n, err := newFnet(m, c.dt, topts...)
		if err != nil {
			return err
		}
		var f *FSDP
		var ps []*autograd.Value
		if fsdp {
			if f, err = FullyShard(ctx, n, []string{"h.*"}, c.opts...); err != nil {
				return err
			}
			ps = f.Params()
		} else if ps, err = parallel.Params(n); err != nil {
			return err
		}
		opt, err := optim.NewAdamW(ps, optim.WithAllowFrozen()) // the spare Linear is never used
		if err != nil {
			return err
		}
		opt.LR = 0.02
		for s := range steps {
			if c.recycle {
				n.tape.Recycle()
			}
			for _, p := range ps {
				p.ZeroGrad()
			}
			var stepLoss float64
			for mb := range accum {
				run := func() error {
					l, err := n.forward(ctx, m, uint64(1000*s+mb), fnetB/accum)
					if err != nil {
						return err
					}
					full, err := l.Data().Full(ctx)
					if err != nil {
						return err
					}
					stepLoss += toF64(full)[0]
					return n.tape.Backward(ctx, l)
				}
				switch {
				case f == nil || mb == accum-1:
					err = run()
				case c.noRep:
					err = f.NoReplicaSync(ctx, run)
				default:
					err = f.NoSync(run)
				}
				if err != nil {
					return err
				}
			}
			if f != nil {
				if err := f.Finish(ctx); err != nil {
					return err
				}
				if g := n.spare.Weight.Grad(); g != nil {
					return fmt.Errorf("the unused parameter has a gradient %v", g.Spec())
				}
			}
			if err := opt.Step(); err != nil {
				return err
			}
			if m.Rank() == 0 {
				losses[s] = stepLoss
			}
		}
		for _, p := range ps {
			full, err := p.Data().Full(ctx)
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				mu.Lock()
				params[p.Name()] = toF64(full)
				mu.Unlock()
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s (fsdp %v): %v", c.name, fsdp, err)
	}
	return losses, params
}

func toF64(d any) []float64 {
	switch s := d.(type) {
	case []float64:
		return s
	case []float32:
		out := make([]float64, len(s))
		for i, v := range s {
			out[i] = float64(v)
		}
		return out
	}
	return nil
}

func closeTo(a, b, tol float64) bool {
	return math.Abs(a-b) <= tol*math.Max(1, math.Abs(b))
}

// TestFSDPParity trains the net with FSDP in many configurations and
// compares every step's loss and the final parameters with one rank.
// Float64 runs differ from the serial run only by the order of the
// gradient sums (rounding, 1e-12 relative; AdamW's normalisation can
// amplify it on near-zero gradients, hence 1e-9); bfloat16 gathers round
// the weights to 8 bits of mantissa: the loss stays within 1e-2, and a
// parameter within two AdamW steps (2·lr a step: a rounded gradient near
// zero may flip sign).
func TestFSDPParity(t *testing.T) {
	const steps = 3
	f64, f32 := comm.Float64, comm.Float32
	one := []string{"fsdp"}
	hsdp := []string{"dp", "fsdp"}
	cases := []trainCase{
		{name: "fsdp2", shape: []int{2}, names: one, dt: f64},
		{name: "fsdp3 uneven", shape: []int{3}, names: one, dt: f64},
		{name: "fsdp4 empty shard", shape: []int{4}, names: one, dt: f64},
		{name: "hsdp 2x2", shape: []int{2, 2}, names: hsdp, dt: f64, opts: []Option{WithReplicateAxis("dp")}},
		{name: "reshard false", shape: []int{3}, names: one, dt: f64, opts: []Option{WithReshard(false)}},
		{name: "reshard to 2 of 4", shape: []int{4}, names: one, dt: f64, opts: []Option{WithReshardTo(2)}},
		{name: "no prefetch", shape: []int{3}, names: one, dt: f64, opts: []Option{WithPrefetch(false)}},
		{name: "zero1", shape: []int{3}, names: one, dt: f64, opts: []Option{WithZeROStage(1)}},
		{name: "zero2", shape: []int{3}, names: one, dt: f64, opts: []Option{WithZeROStage(2)}},
		{name: "nosync x4", shape: []int{2}, names: one, dt: f64, accum: 4},
		{name: "hsdp nosync x4", shape: []int{2, 2}, names: hsdp, dt: f64, accum: 4, opts: []Option{WithReplicateAxis("dp")}},
		{name: "hsdp noreplicasync x4", shape: []int{2, 2}, names: hsdp, dt: f64, accum: 4, noRep: true, opts: []Option{WithReplicateAxis("dp")}},
		{name: "recycling tape", shape: []int{3}, names: one, dt: f64, recycle: true},
		{name: "float32", shape: []int{2}, names: one, dt: f32, tol: 1e-4},
		{name: "bfloat16 gathers", shape: []int{2}, names: one, dt: f32, tol: 1e-2, paramTol: 2 * 0.02 * steps, opts: []Option{WithMixedPrecision(comm.BFloat16)}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tol := c.tol
			if tol == 0 {
				tol = 1e-9
			}
			wantLoss, wantParams := train(t, c, false, steps)
			gotLoss, gotParams := train(t, c, true, steps)
			for s := range steps {
				if !closeTo(gotLoss[s], wantLoss[s], tol) {
					t.Errorf("step %d: loss %.15g, serial %.15g", s, gotLoss[s], wantLoss[s])
				}
			}
			if len(gotParams) != len(wantParams) {
				t.Fatalf("%d parameters, serial %d", len(gotParams), len(wantParams))
			}
			for name, w := range wantParams {
				g := gotParams[name]
				if len(g) != len(w) {
					t.Fatalf("%s: %d elements, serial %d", name, len(g), len(w))
				}
				for k := range w {
					if c.paramTol > 0 && math.Abs(g[k]-w[k]) <= c.paramTol {
						continue
					}
					if c.paramTol > 0 || !closeTo(g[k], w[k], tol) {
						t.Fatalf("%s[%d] = %.15g, serial %.15g", name, k, g[k], w[k])
					}
				}
			}
		})
	}
}
