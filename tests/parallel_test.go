package tests

import (
	"context"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// trainOptions trains on cfg's data from init on the "dp" × "tp" mesh,
// with sequence parallelism if sp.
func trainOptions(cfg tinygpt.Config, init map[string][]float32, sp bool) []gpt.TrainOption {
	opts := []gpt.TrainOption{gpt.WithRun(cfg), gpt.WithModel(gpt.WithParams(init)), gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp")}
	if sp {
		opts = append(opts, gpt.WithSequenceParallel())
	}
	return opts
}

// run trains steps steps of the tiny GPT on a dp × tp mesh of in-process
// ranks and returns the losses and the final parameters (gathered).
func run(t *testing.T, cfg tinygpt.Config, init map[string][]float32, dp, tp int, sp bool, steps int) ([]float64, map[string][]float32) {
	t.Helper()
	var (
		mu     sync.Mutex
		losses []float64
		params map[string][]float32
	)
	err := placementtest.Simulate(context.Background(), []int{dp, tp}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), trainOptions(cfg, init, sp)...)
		if err != nil {
			return err
		}
		var ls []float64
		for range steps {
			_, l, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			ls = append(ls, l)
		}
		full, err := tr.Full(ctx)
		if err != nil {
			return err
		}
		if m.Rank() == 0 {
			mu.Lock()
			losses, params = ls, full
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("dp=%d tp=%d sp=%v: %v", dp, tp, sp, err)
	}
	return losses, params
}

// Every (dp, tp, sp) layout trains the tiny GPT exactly as one rank does:
// the same losses for 20 steps and the same parameters after them.
//
// Tolerances: the layouts differ from one rank only in float32 summation
// order (dp all-reduce, tp partial sums, vocab-parallel softmax sums),
// which perturbs each step's loss in the 6th-7th digit and gradients by
// about 1e-6 relative; 20 AdamW steps amplify that to about 1e-4 relative
// in the parameters (measured: loss |Δ| ≤ 1.3e-5, relative L2 ≤ 1.3e-4).
// The key bias is the exception: softmax is invariant to it, so its exact
// gradient is zero and what each layout computes is rounding noise, which
// AdamW normalises into steps of up to lr each; it is held to the max-abs
// limit only. Limits: loss 1e-4; parameters 2e-3 max-abs (below one
// worst-case run of updates) and 1e-3 relative L2. A layout bug (a wrong
// shard, a missing reduction, a bias added twice) is off by orders of
// magnitude more.
func TestParallelLayoutsMatchOneRank(t *testing.T) {
	const steps = 20
	cfg := tinygpt.Default()
	init := gpt.RandomInit(gpt.FromReference(cfg), 3)
	want, wantParams := run(t, cfg, init, 1, 1, false, steps)
	cases := []struct {
		dp, tp int
		sp     bool
	}{
		{1, 2, false}, {2, 1, false}, {2, 2, false}, {2, 2, true}, {1, 4, true}, {4, 1, false},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("dp=%d,tp=%d,sp=%v", c.dp, c.tp, c.sp), func(t *testing.T) {
			got, params := run(t, cfg, init, c.dp, c.tp, c.sp, steps)
			var worst float64
			for i := range want {
				d := math.Abs(got[i] - want[i])
				worst = max(worst, d)
				if !(d <= 1e-4) {
					t.Errorf("step %d: loss %.7f, one rank %.7f (|Δ| %.2g > 1e-4)", i+1, got[i], want[i], d)
				}
			}
			var worstAbs, worstRel float64
			for name, w := range wantParams {
				g, ok := params[name]
				if !ok || len(g) != len(w) {
					t.Errorf("parameter %q: %d values, want %d", name, len(g), len(w))
					continue
				}
				a := maxAbs(g, w)
				var r float64
				if strings.HasSuffix(name, tinygpt.BlockQKVB) {
					// q and v parts only; the k part is rounding noise.
					d := cfg.D
					r = max(relL2(g[:d], w[:d]), relL2(g[2*d:], w[2*d:]))
				} else {
					r = relL2(g, w)
				}
				worstAbs, worstRel = max(worstAbs, a), max(worstRel, r)
				if !(a <= 2e-3 && r <= 1e-3) {
					t.Errorf("parameter %q after %d steps: max |Δ| %.2g (limit 2e-3), relative L2 %.2g (limit 1e-3)", name, steps, a, r)
				}
			}
			t.Logf("largest loss difference %.2g; parameters: max |Δ| %.2g, relative L2 %.2g", worst, worstAbs, worstRel)
		})
	}
}

// BenchmarkLayouts trains the tiny GPT on each layout of in-process ranks
// and reports tokens/s (the median step time after two warm-up steps), with
// GEMM threads sized so that ranks × threads = CPUs and the GEMM backend
// that train.LoadBLAS would choose for that many in-process ranks
// (kernels.WithRanksInProcess; LOOM_BLAS=go|openblas forces one); "bind" layouts bind
// each rank to CPUs of its own (local.WithCPUBinding). Run it with -count
// so that the layouts alternate and a noisy machine affects them alike,
// and compare medians:
//
//	go test ./tests -run XXX -bench Layouts -benchtime 30x -count 5
func BenchmarkLayouts(b *testing.B) {
	cfg := tinygpt.Default()
	init := gpt.RandomInit(gpt.FromReference(cfg), 1)
	for _, l := range []struct {
		dp, tp  int
		sp      bool
		threads int // GEMM threads per rank; 0: CPUs / ranks
		bind    bool
	}{
		{1, 1, false, 0, false}, {1, 1, false, 1, false},
		{2, 1, false, 0, false}, {2, 1, false, 0, true},
		{1, 2, false, 0, false}, {1, 2, false, 0, true}, {1, 2, true, 0, false},
		{2, 2, false, 0, false},
	} {
		ranks := l.dp * l.tp
		threads := l.threads
		if threads == 0 {
			threads = max(1, runtime.NumCPU()/ranks)
		}
		name := fmt.Sprintf("dp=%d,tp=%d,sp=%v,threads=%d", l.dp, l.tp, l.sp, threads)
		if l.bind {
			name += ",bind"
		}
		b.Run(name, func(b *testing.B) {
			if l.bind && ranks > runtime.NumCPU() {
				b.Skipf("%d ranks cannot be bound to %d CPUs", ranks, runtime.NumCPU())
			}
			bl, err := kernels.Load(kernels.WithThreads(threads), kernels.WithRanksInProcess(ranks))
			if err != nil {
				b.Fatal(err)
			}
			b.Logf("GEMM %s (%s)", bl.Name(), bl.Reason())
			var tokensPerS float64
			err = local.Run(context.Background(), ranks, func(ctx context.Context, c comm.Communicator) error {
				m, err := mesh.New(c, []int{l.dp, l.tp}, []string{"dp", "tp"})
				if err != nil {
					return err
				}
				tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(cfg), append(trainOptions(cfg, init, l.sp), gpt.WithTape(autograd.WithBLAS(bl)))...)
				if err != nil {
					return err
				}
				rate, err := medianStepRate(b.N, cfg.B*cfg.T, func(int) error {
					_, _, err := tr.Step(ctx)
					return err
				})
				if m.Rank() == 0 {
					tokensPerS = rate
				}
				return err
			}, local.WithCPUBinding(l.bind))
			if err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(tokensPerS, "tokens/s")
		})
	}
}
