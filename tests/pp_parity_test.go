package tests

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// ppCfg is a small GPT of 8 blocks, so that every stage of pp=4 with two
// stages per rank holds one.
var ppCfg = gpt.Config{Vocab: 32, Width: 16, Heads: 2, Layers: 8, MLPWidth: 32, SeqLen: 8, InitStd: 0.1, LNEps: 1e-5}

const (
	ppRows = 10 // the batch: 10 sequences of SeqLen tokens
	ppLR   = 0.5
)

// ppBatch returns step's token ids and targets, [ppRows·SeqLen] each.
func ppBatch(step int) (x, y []int64) {
	n := ppRows * ppCfg.SeqLen
	x, y = make([]int64, n), make([]int64, n)
	for i := range x {
		x[i] = int64((i*7 + step*13 + i/5) % ppCfg.Vocab)
		y[i] = int64((i*3 + step*5 + 1) % ppCfg.Vocab)
	}
	return x, y
}

// sgd steps every parameter by −lr·grad and zeroes the gradients; each
// gradient must be laid out like its parameter (local blocks alike).
func sgd(ps []*autograd.Value) error {
	for _, p := range ps {
		if p.Grad() == nil {
			return fmt.Errorf("%s has no gradient", p.Name())
		}
		if !p.Grad().Spec().Equal(p.Spec()) {
			return fmt.Errorf("%s: gradient %v, parameter %v", p.Name(), p.Grad().Spec(), p.Spec())
		}
		d := p.Data().LocalData().([]float32)
		for i, gi := range p.Grad().LocalData().([]float32) {
			d[i] -= ppLR * gi
		}
		p.ZeroGrad()
	}
	return nil
}

// ppInit is the initial model: with tied, lm_head starts as a copy of
// wte (a tied embedding, each stage holding a copy).
func ppInit(tied bool) map[string][]float32 {
	init := gpt.RandomInit(ppCfg, 1)
	if tied {
		init[tinygpt.ParamLMHead] = slices.Clone(init[tinygpt.ParamWTE])
	}
	return init
}

// ppReference trains the whole model on one rank for steps steps and
// returns the losses and the final parameters.
func ppReference(t *testing.T, steps int, tied bool) ([]float64, map[string][]float32) {
	ctx := context.Background()
	w, err := local.NewWorld(1)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mesh.New(w.Comm(0), []int{1}, []string{"dp"})
	if err != nil {
		t.Fatal(err)
	}
	tape := autograd.NewTape()
	md, err := gpt.New(tape, m, ppCfg, gpt.WithParams(ppInit(tied)))
	if err != nil {
		t.Fatal(err)
	}
	var losses []float64
	for step := range steps {
		xs, ys := ppBatch(step)
		r := []placement.Placement{placement.Replicate()}
		x, err := autograd.IndicesFromFull(m, []int{ppRows, ppCfg.SeqLen}, r, xs)
		if err != nil {
			t.Fatal(err)
		}
		y, err := autograd.IndicesFromFull(m, []int{ppRows, ppCfg.SeqLen}, r, ys)
		if err != nil {
			t.Fatal(err)
		}
		loss, err := md.Forward(ctx, tape, x, y)
		if err != nil {
			t.Fatal(err)
		}
		l, _ := gpt.Loss(loss)
		losses = append(losses, l)
		if err := tape.Backward(ctx, loss); err != nil {
			t.Fatal(err)
		}
		if tied {
			// One weight used twice: its gradient is the sum of both
			// uses', the embedding's first (as the pipeline adds them).
			wte, head := md.Param(tinygpt.ParamWTE), md.Param(tinygpt.ParamLMHead)
			a, b := wte.Grad().LocalData().([]float32), head.Grad().LocalData().([]float32)
			sum := make([]float32, len(a))
			for i := range a {
				sum[i] = a[i] + b[i]
			}
			g, err := placement.NewLocal(wte.Grad().Spec(), sum)
			if err != nil {
				t.Fatal(err)
			}
			if err := errors.Join(wte.SetGrad(g), head.SetGrad(g)); err != nil {
				t.Fatal(err)
			}
		}
		if err := sgd(md.Params()); err != nil {
			t.Fatal(err)
		}
	}
	out := map[string][]float32{}
	for _, p := range md.Params() {
		out[p.Name()] = append([]float32(nil), p.Data().LocalData().([]float32)...)
	}
	return losses, out
}

// ppRun trains the model pipelined with the schedule s for steps steps on
// a (pp, dp, tp) mesh of s.Ranks·dp·tp in-process ranks: batch rows
// sharded over dp, each stage laid out by gpt.Plan over tp, the stages'
// gradients reduced once per step at the schedule's ReduceGrad actions
// (tp.ReduceGrads: the dp sum, and what TP leaves partial). It
// returns the losses (summed over dp on the last stage's ranks), the final
// parameters (whole), and each pp rank's stats of the last step.
// ppLayout is how ppRun lays the pipeline out beside pp.
type ppLayout struct {
	dp, tp int  // data- and tensor-parallel ranks (0 counts as 1)
	tied   bool // lm_head starts as wte's copy; SumTied after each step
	emu    bool // each rank computes on its emulated device
	ddp    bool // with dp > 1: DDP (ddp.New) reduces once per step, after it, instead of ReduceGrad actions
}

func ppRun(ctx context.Context, s *pp.Schedule, steps int, l ppLayout) ([]float64, map[string][]float32, []*pp.StepStats, error) {
	dpN, tpN, tied, emuDev := max(l.dp, 1), max(l.tp, 1), l.tied, l.emu
	var mu sync.Mutex
	params := map[string][]float32{}
	losses := make([]float64, steps)
	stats := make([]*pp.StepStats, s.Ranks)
	err := local.Run(ctx, s.Ranks*dpN*tpN, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{s.Ranks, dpN, tpN}, []string{"pp", "dp", "tp"})
		if err != nil {
			return err
		}
		tr, err := pp.NewTransport(ctx, m, "pp")
		if err != nil {
			return err
		}
		sm := tr.Mesh()
		dpc, err := sm.Comm(ctx, "dp")
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		if emuDev {
			d, err := emu.New(c.Rank())
			if err != nil {
				return err
			}
			defer d.Close()
			tape = autograd.NewTape(autograd.WithDevice(d))
		}
		init := ppInit(tied)
		rows, err := pp.MicroBatches(ppRows, s.MicroBatches)
		if err != nil {
			return err
		}
		step := 0
		funcs := map[int]pp.StageFunc{}
		byStage := map[int][]*autograd.Value{}
		var all []*autograd.Value
		S := s.Stages()
		for _, k := range s.StagesOf(tr.Rank()) {
			st, err := gpt.NewStage(tape, sm, ppCfg, k*ppCfg.Layers/S, (k+1)*ppCfg.Layers/S, init)
			if err != nil {
				return err
			}
			if tpN > 1 {
				if err := tp.Parallelize(ctx, st, "tp", st.Plan(false)); err != nil {
					return err
				}
			}
			byStage[k] = st.Params()
			all = append(all, byStage[k]...)
			funcs[k] = func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
				xs, ys := ppBatch(step)
				rg, T := rows[mb], ppCfg.SeqLen
				shape := []int{rg.Hi - rg.Lo, T}
				r := []placement.Placement{placement.Shard(0), placement.Replicate()}
				x, err := autograd.IndicesFromFull(sm, shape, r, xs[rg.Lo*T:rg.Hi*T])
				if err != nil {
					return nil, err
				}
				y, err := autograd.IndicesFromFull(sm, shape, r, ys[rg.Lo*T:rg.Hi*T])
				if err != nil {
					return nil, err
				}
				return st.Forward(ctx, h, x, y, rg.Weight)
			}
		}
		var opts []pp.Option
		var dd *ddp.DDP
		if l.ddp {
			// Every micro-batch's backward accumulates locally (NoSync);
			// one bucketed all-reduce per step after the pipeline's.
			if dd, err = ddp.New(ctx, all, ddp.WithAxis("dp")); err != nil {
				return err
			}
		} else {
			opts = append(opts, pp.WithGradReduction(func(ctx context.Context, stage int) error {
				return tp.ReduceGrads(ctx, byStage[stage])
			}))
		}
		rt, err := pp.NewRuntime(s, tape, tr, funcs, opts...)
		if err != nil {
			return err
		}
		stepFn := func(ctx context.Context) (*pp.StepStats, error) {
			if dd == nil {
				return rt.Step(ctx)
			}
			var st *pp.StepStats
			err := dd.NoSync(func() (err error) {
				st, err = rt.Step(ctx)
				return err
			})
			if err != nil {
				return nil, err
			}
			return st, dd.Finish(ctx)
		}
		update := func() error { return sgd(all) }
		if emuDev {
			// The device's own SGD kernel: p −= lr·g, as sgd.
			opt, err := optim.NewSGD(all, ppLR)
			if err != nil {
				return err
			}
			update = func() error {
				if err := opt.Step(); err != nil {
					return err
				}
				for _, p := range all {
					p.ZeroGrad()
				}
				return nil
			}
		}
		for ; step < steps; step++ {
			st, err := stepFn(ctx)
			if err != nil {
				return err
			}
			if !math.IsNaN(st.Loss) {
				v := []float64{st.Loss}
				if err := comm.AllReduce(ctx, dpc, comm.Host(v), comm.Host(v), comm.Sum); err != nil {
					return err
				}
				losses[step] = v[0]
			}
			stats[tr.Rank()] = st
			if tied {
				first, last := s.RankOf(0), s.RankOf(S-1)
				for _, p := range all {
					switch {
					case p.Name() == tinygpt.ParamWTE && tr.Rank() == first:
						err = pp.SumTied(ctx, tr, p, last)
					case p.Name() == tinygpt.ParamLMHead && tr.Rank() == last:
						err = pp.SumTied(ctx, tr, p, first)
					}
					if err != nil {
						return err
					}
				}
			}
			if err := update(); err != nil {
				return err
			}
		}
		full := map[string][]float32{}
		for _, p := range all {
			h, err := p.Data().To(device.Host())
			if err != nil {
				return err
			}
			f, err := h.Full(ctx)
			if err != nil {
				return err
			}
			full[p.Name()] = f.([]float32)
		}
		mu.Lock()
		defer mu.Unlock()
		for n, f := range full {
			params[n] = f
		}
		return nil
	})
	return losses, params, stats, err
}

// TestPipelineParity: 20 steps of a GPT trained pipelined, with every
// schedule, pp = 2 and 4, and M = pp, 2·pp and 2·pp−1 (which does not
// divide the batch of 10 evenly), match the one-rank run: the losses and
// the final parameters within 2e-5 (float32: the pipeline sums the
// micro-batches' weight gradients where one rank computes them in one
// GEMM, and weights the micro-batches' mean losses rather than taking one
// mean, so the roundings differ; 20 steps of SGD at lr 0.5 keep the drift
// near 1e-6). A schedule that cannot run with the given M is refused with
// ErrInvalid before anything runs, and nothing else.
func TestPipelineParity(t *testing.T) {
	steps := 20
	if testing.Short() {
		steps = 3
	}
	wantLoss, wantParams := ppReference(t, steps, false)
	for _, ranks := range []int{2, 4} {
		for _, m := range []int{ranks, 2 * ranks, 2*ranks - 1} {
			for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
				t.Run(fmt.Sprintf("pp%d/M%d/%s", ranks, m, name), func(t *testing.T) {
					s, err := pp.Build(name, ranks, m, 0)
					if err != nil {
						if !errors.Is(err, pp.ErrInvalid) {
							t.Fatalf("Build: %v, want ErrInvalid", err)
						}
						t.Logf("refused: %v", err)
						return
					}
					losses, params, stats, err := ppRun(context.Background(), s, steps, ppLayout{})
					if err != nil {
						t.Fatal(err)
					}
					compare(t, losses, params, wantLoss, wantParams)
					peaks, err := s.PeakActivations()
					if err != nil {
						t.Fatal(err)
					}
					for r, st := range stats {
						for stage, held := range st.PeakHeld {
							if held != peaks[stage] {
								t.Errorf("rank %d stage %d: held %d micro-batches at most, the schedule predicts %d", r, stage, held, peaks[stage])
							}
						}
					}
				})
			}
		}
	}
}

// TestPipelineComposed: pp=2 with dp=2 (batch rows sharded, the stage's
// gradients summed over dp once per step at ReduceGrad, or by DDP's
// bucketed all-reduce once after the step, the micro-batches' backwards
// inside its NoSync), with tp=2 (each
// stage laid out by gpt.Plan) and with both (8 ranks) match the one-rank
// run, for 1F1B and ZB-H1
// (split backward), within the same 2e-5 as TestPipelineParity.
func TestPipelineComposed(t *testing.T) {
	steps := 20
	if testing.Short() {
		steps = 3
	}
	wantLoss, wantParams := ppReference(t, steps, false)
	// M = 5 gives every micro-batch 2 of the 10 rows, one per dp rank.
	for _, c := range []struct {
		dp, tp, m int
		ddp       bool
	}{{2, 1, 5, false}, {1, 2, 4, false}, {2, 2, 5, false}, {2, 1, 5, true}} {
		for _, name := range []string{"1f1b", "zb1"} {
			t.Run(fmt.Sprintf("dp%d/tp%d/ddp=%v/%s", c.dp, c.tp, c.ddp, name), func(t *testing.T) {
				s, err := pp.Build(name, 2, c.m, 0)
				if err != nil {
					t.Fatal(err)
				}
				if !c.ddp {
					if s, err = pp.Lower(s, pp.WithReduceGrad()); err != nil {
						t.Fatal(err)
					}
				}
				losses, params, _, err := ppRun(context.Background(), s, steps, ppLayout{dp: c.dp, tp: c.tp, ddp: c.ddp})
				if err != nil {
					t.Fatal(err)
				}
				compare(t, losses, params, wantLoss, wantParams)
			})
		}
	}
}

// compare fails t where losses or params differ from the one-rank run's
// by more than 2e-5.
func compare(t *testing.T, losses []float64, params map[string][]float32, wantLoss []float64, wantParams map[string][]float32) {
	t.Helper()
	const tol = 2e-5
	for i := range wantLoss {
		if d := math.Abs(losses[i] - wantLoss[i]); d > tol {
			t.Errorf("step %d: loss %.7f, one rank %.7f", i, losses[i], wantLoss[i])
		}
	}
	if len(params) != len(wantParams) {
		t.Fatalf("%d parameters across the stages, the model has %d", len(params), len(wantParams))
	}
	worst := 0.0
	for n, w := range wantParams {
		for i := range w {
			worst = max(worst, math.Abs(float64(params[n][i]-w[i])))
		}
	}
	if worst > tol {
		t.Errorf("parameters differ by up to %g", worst)
	}
}

// TestPipelineTied: a tied embedding and LM head, a copy on the first
// stage and one on the last, with their gradients summed between the two
// ranks (pp.SumTied) after each step, trains as one rank's model whose
// one weight serves both (within 2e-5), and the copies stay equal bit
// for bit.
func TestPipelineTied(t *testing.T) {
	steps := 20
	if testing.Short() {
		steps = 3
	}
	wantLoss, wantParams := ppReference(t, steps, true)
	for _, name := range []string{"gpipe", "1f1b", "zb1"} {
		t.Run(name, func(t *testing.T) {
			s, err := pp.Build(name, 2, 4, 0)
			if err != nil {
				t.Fatal(err)
			}
			losses, params, _, err := ppRun(context.Background(), s, steps, ppLayout{tied: true})
			if err != nil {
				t.Fatal(err)
			}
			compare(t, losses, params, wantLoss, wantParams)
			a, b := params[tinygpt.ParamWTE], params[tinygpt.ParamLMHead]
			for i := range a {
				if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
					t.Fatalf("the copies differ at %d: %v and %v", i, a[i], b[i])
				}
			}
		})
	}
}

// TestPipelineEmu: each rank computing on its emulated device (device/emu:
// the parameters, activations and gradients in device buffers; tensors
// crossing stages go through host memory) trains as one rank on the host,
// for 1F1B and ZB-H1, within 2e-5.
func TestPipelineEmu(t *testing.T) {
	steps := 5
	if testing.Short() {
		steps = 2
	}
	wantLoss, wantParams := ppReference(t, steps, false)
	for _, name := range []string{"1f1b", "zb1"} {
		t.Run(name, func(t *testing.T) {
			s, err := pp.Build(name, 2, 4, 0)
			if err != nil {
				t.Fatal(err)
			}
			losses, params, _, err := ppRun(context.Background(), s, steps, ppLayout{emu: true})
			if err != nil {
				t.Fatal(err)
			}
			compare(t, losses, params, wantLoss[:steps], wantParams)
		})
	}
}
