package moe_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
)

// BenchmarkDispatchCombine measures the token payload throughput of
// Dispatch then Combine (no experts in between) on p in-process ranks of
// one expert-parallel axis, against a dense equal-split comm.AllToAll
// moving the same bytes per rank, in the same run: rounds of b.N
// iterations of each in turn (as cmd/loombench -compare interleaves its
// variants), an iteration's time being the slowest rank's, and the
// medians compared. Run it as
//
//	go test ./moe -run '^$' -bench DispatchCombine -benchtime 10x
//
// (-short skips the 32 MiB shapes).
//
// Metrics: GB/s is the MoE path's token payload (every row it sends,
// self-sends included: 2·n·K·D·4 bytes per rank forward, twice that with
// backward) over its median iteration time; dense-GB/s the same bytes over
// the dense all-to-alls' median (two forward, four with backward, each of
// n·K·D floats per rank, between buffers allocated once); x-dense their
// ratio (1 means the MoE path costs no more than a balanced all-to-all of
// its payload); x-chained the ratio against the same all-to-alls chained,
// each sending what the one before it received (as combine sends what
// dispatch delivered, so that every row a rank sends was written by
// another core since the rank last sent it, where the plain dense loop
// sends a buffer no core writes); x-dense-alloc the ratio against the
// plain all-to-alls receiving into freshly allocated buffers; ns/op the
// MoE path's median.
// The tape recycles (autograd.WithRecycling, Recycle before every
// iteration), as a training loop's does, so dispatch's and combine's
// results and gradients reuse the memory of the previous iteration's.
//
// The routing is balanced (every expert gets exactly n·K/E slots of every
// rank, in a random token order) or skewed (Zipf-like: expert e chosen
// with probability ∝ 1/(e+1), so rank 0 receives 1.5 (p = 2) and 2.0
// (p = 4) times the mean); the dense reference is the same balanced all-to-all in both,
// so the skewed ratio includes the cost of the imbalance itself.
// "fwd" is Dispatch and Combine forward (no tape recording); "fwdbwd"
// adds their backward: Combine's (the gate-scaled gather, the gate
// gradient, the rows back to the experts) and Dispatch's (the rows back
// and the scatter-add), driven by a sink op whose gradient is the combined
// tokens' gradient.
func BenchmarkDispatchCombine(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, bc := range []benchCase{
			{n: 512, d: 256, e: 8, k: 2},              // 1 MiB per rank and direction
			{n: 2048, d: 256, e: 8, k: 2},             // 4 MiB
			{n: 2048, d: 256, e: 8, k: 2, skew: true}, // 4 MiB, skewed
			{n: 4096, d: 1024, e: 8, k: 2, big: true}, // 32 MiB: both paths out of cache
		} {
			if bc.big && testing.Short() {
				continue
			}
			for _, bwd := range []bool{false, true} {
				b.Run(fmt.Sprintf("p=%d/%v/%s", p, bc, benchMode(bwd)), func(b *testing.B) {
					benchReport(b, p, bc, bwd, []benchPath{{name: "", ws: true}})
				})
			}
		}
	}
}

// BenchmarkDispatchCombinePaths compares, in one run, the payload paths
// dispatch and combine can take, each against the same dense all-to-all
// (x-dense metrics as in BenchmarkDispatchCombine): x-dense is the default
// (fused over the ranks' shared memory), x-coll the collective path that
// MPI and NCCL take (DispatchConfig.Collectives, a Workspace, split by
// local expert from 64 KiB per call), x-nosplit its one all-to-all-v and a
// regrouping pass on each side, x-alloc the same without a Workspace
// (every buffer allocated), and x-split the split path even where the
// default would not take it. Run it as
//
//	go test ./moe -run '^$' -bench DispatchCombinePaths -benchtime 10x
func BenchmarkDispatchCombinePaths(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, bc := range []benchCase{
			{n: 128, d: 256, e: 8, k: 2},  // 256 KiB per rank and direction
			{n: 512, d: 256, e: 8, k: 2},  // 1 MiB
			{n: 2048, d: 256, e: 8, k: 2}, // 4 MiB
		} {
			for _, bwd := range []bool{false, true} {
				b.Run(fmt.Sprintf("p=%d/%v/%s", p, bc, benchMode(bwd)), func(b *testing.B) {
					benchReport(b, p, bc, bwd, []benchPath{
						{name: "", ws: true},
						{name: "-coll", ws: true, coll: true},
						{name: "-nosplit", ws: true, split: -1, coll: true},
						{name: "-alloc", split: -1, coll: true},
						{name: "-split", ws: true, split: 1, coll: true},
					})
				})
			}
		}
	}
}

func benchMode(bwd bool) string {
	if bwd {
		return "fwdbwd"
	}
	return "fwd"
}

// benchPath is one way through dispatch and combine: fused or by
// collectives, with or without a Workspace, and its split threshold (0:
// the default).
type benchPath struct {
	name  string // metric suffix
	ws    bool
	split int
	coll  bool // DispatchConfig.Collectives
}

// benchReport measures the paths against the dense all-to-all and reports
// the metrics: GB/s, dense-GB/s and ns/op for the first path, and x-dense
// (with the path's suffix) for each.
func benchReport(b *testing.B, p int, bc benchCase, bwd bool, paths []benchPath) {
	const rounds = 5
	times, err := benchDispatchCombine(p, bc, bwd, paths, rounds, b.N)
	if err != nil {
		b.Fatal(err)
	}
	chained, dense, denseAlloc := times[len(times)-3], times[len(times)-2], times[len(times)-1]
	b.ReportMetric(chained.Seconds()/times[0].Seconds(), "x-chained")
	passes := 2
	if bwd {
		passes = 4
	}
	bytes := float64(passes * bc.n * bc.k * bc.d * 4)
	b.ReportMetric(bytes/times[0].Seconds()/1e9, "GB/s")
	b.ReportMetric(bytes/dense.Seconds()/1e9, "dense-GB/s")
	for i, path := range paths {
		b.ReportMetric(dense.Seconds()/times[i].Seconds(), "x-dense"+path.name)
	}
	b.ReportMetric(denseAlloc.Seconds()/times[0].Seconds(), "x-dense-alloc")
	b.ReportMetric(float64(times[0].Nanoseconds()), "ns/op")
}

// benchCase is one benchmark shape: n tokens of width d per rank, top-k
// of e experts.
type benchCase struct {
	n, d, e, k int
	skew       bool
	big        bool // skipped with -short
}

func (c benchCase) String() string {
	r := "balanced"
	if c.skew {
		r = "skewed"
	}
	return fmt.Sprintf("%s/n=%d/d=%d/e=%d/k=%d", r, c.n, c.d, c.e, c.k)
}

// routing returns the expert slots [n·k] of rank's tokens.
func (c benchCase) routing(rank int) []int32 {
	rng := rand.New(rand.NewPCG(uint64(rank)+1, 99))
	ex := make([]int32, c.n*c.k)
	if !c.skew {
		// Token t takes experts r_t + j·e/k (mod e), with r_t a random
		// permutation of the tokens mod e: every expert gets exactly
		// n·k/e slots when e divides n.
		perm := rng.Perm(c.n)
		for t := range c.n {
			for j := range c.k {
				ex[t*c.k+j] = int32((perm[t] + j*c.e/c.k) % c.e)
			}
		}
		return ex
	}
	w := make([]float64, c.e)
	var sum float64
	for e := range w {
		w[e] = 1 / float64(e+1)
		sum += w[e]
	}
	draw := func() int32 {
		u := rng.Float64() * sum
		for e, x := range w {
			if u < x {
				return int32(e)
			}
			u -= x
		}
		return int32(c.e - 1)
	}
	for t := range c.n {
		for j := range c.k {
			for {
				x := draw()
				if !slices.Contains(ex[t*c.k:t*c.k+j], x) {
					ex[t*c.k+j] = x
					break
				}
			}
		}
	}
	return ex
}

// benchDispatchCombine returns the median iteration time of every path
// and, last, of the dense all-to-alls (chained, between buffers allocated
// once, then into fresh ones), over rounds rounds of iters iterations of
// each in turn.
func benchDispatchCombine(p int, bc benchCase, bwd bool, paths []benchPath, rounds, iters int) ([]time.Duration, error) {
	n := rounds * iters
	variants := len(paths) + 3
	durs := make([][][]time.Duration, variants) // [variant][rank][iteration]
	for v := range durs {
		durs[v] = make([][]time.Duration, p)
		for r := range durs[v] {
			durs[v][r] = make([]time.Duration, n)
		}
	}
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{p}, []string{"ep"})
		if err != nil {
			return err
		}
		rank := c.Rank()
		tape := autograd.NewTape(autograd.WithRecycling())
		leaf := func(shape []int, data []float32) (*autograd.Value, error) {
			spec, err := placement.NewSpec(m, shape, comm.Float32, []placement.Placement{placement.Shard(0)})
			if err != nil {
				return nil, err
			}
			dt, err := placement.NewLocal(spec, data)
			if err != nil {
				return nil, err
			}
			if bwd {
				return tape.Param("leaf", dt)
			}
			return tape.Constant(dt)
		}
		rng := rand.New(rand.NewPCG(uint64(rank), 7))
		xd := make([]float32, bc.n*bc.d)
		for i := range xd {
			xd[i] = rng.Float32()
		}
		gd := make([]float32, bc.n*bc.k)
		for i := range gd {
			gd[i] = rng.Float32()
		}
		x, err := leaf([]int{p * bc.n, bc.d}, xd)
		if err != nil {
			return err
		}
		gates, err := leaf([]int{p * bc.n, bc.k}, gd)
		if err != nil {
			return err
		}
		r := &moe.Routing{NumExperts: bc.e, K: bc.k, Experts: bc.routing(rank), Gates: gates}
		pass := func(cfg moe.DispatchConfig) error {
			tape.Recycle()
			rows, h, err := moe.Dispatch(ctx, x, r, cfg)
			if err != nil {
				return err
			}
			y, err := moe.Combine(ctx, rows, h, gates)
			if err != nil {
				return err
			}
			if !bwd {
				return nil
			}
			loss, err := sink(m, y)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			x.ZeroGrad()
			gates.ZeroGrad()
			return nil
		}
		fs := make([]func() error, 0, variants)
		for _, path := range paths {
			cfg := moe.DispatchConfig{Axis: "ep", Collectives: path.coll}
			if path.ws {
				cfg.Workspace = new(moe.Workspace)
				moe.SetSplitMinBytes(cfg.Workspace, path.split)
			} else if path.split != -1 {
				return fmt.Errorf("benchmark path %q: without a workspace the split threshold is the default", path.name)
			}
			fs = append(fs, func() error { return pass(cfg) })
		}
		calls := 2
		if bwd {
			calls = 4
		}
		count := bc.n * bc.k * bc.d
		send, recv := make([]float32, count), make([]float32, count)
		dense := func(fresh bool) func() error {
			return func() error {
				for range calls {
					if fresh {
						recv = make([]float32, count)
					}
					if err := comm.AllToAll(ctx, c, comm.Host(send), comm.Host(recv)); err != nil {
						return err
					}
				}
				return nil
			}
		}
		// chained: each all-to-all sends what the previous one received
		// (on every rank, from the peers), as combine sends what dispatch
		// delivered: the rows cross cores as the MoE path's do.
		chained := func() error {
			for range calls {
				if err := comm.AllToAll(ctx, c, comm.Host(send), comm.Host(recv)); err != nil {
					return err
				}
				send, recv = recv, send
			}
			return nil
		}
		fs = append(fs, chained, dense(false), dense(true))
		for round := range rounds {
			for v, f := range fs {
				if err := f(); err != nil { // warm-up
					return err
				}
				for it := range iters {
					t0 := time.Now()
					if err := f(); err != nil {
						return err
					}
					durs[v][rank][round*iters+it] = time.Since(t0)
				}
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	out := make([]time.Duration, variants)
	for v := range out {
		it := make([]time.Duration, n)
		for _, d := range durs[v] {
			for i, t := range d {
				it[i] = max(it[i], t)
			}
		}
		slices.Sort(it)
		out[v] = it[n/2]
	}
	return out, nil
}

// sink records a scalar loss on y [N, W] (Shard(0) on the one mesh axis)
// whose value is 0 and whose gradient is zeros laid out like y: it ends
// the tape without a reduction whose cost would count in the benchmark.
// The gradient is the tape's scratch, as any op's would be, rather than a
// fresh allocation that the benchmark would time.
func sink(m *mesh.Mesh, y *autograd.Value) (*autograd.Value, error) {
	return autograd.Custom("sink", []*autograd.Value{y},
		func() (*placement.DTensor, error) {
			spec, err := placement.NewSpec(m, []int{}, comm.Float32, []placement.Placement{placement.Partial(comm.Sum)})
			if err != nil {
				return nil, err
			}
			return placement.NewLocal(spec, []float32{0})
		},
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			zeros := autograd.ScratchBlock[float32](y.Tape(), y.Data().Spec().LocalShape()[0]*y.Spec().Shape()[1])
			clear(zeros)
			dy, err := placement.NewLocal(y.Spec(), zeros)
			return []*placement.DTensor{dy}, err
		})
}
