package pp_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/trace"
)

// The balanced pipeline of BenchmarkBubble: a model of benchLayers
// products [benchRows, benchD]·[benchD, benchD] split evenly over the
// schedule's stages, so that every stage costs the same and the whole
// model the same whatever the number of stages.
const (
	benchRows, benchD, benchLayers = 256, 512, 4
	// benchWait is one rank's share of a micro-batch's forward in the
	// waiting stages (pp=4): each stage's F, I and W wait
	// benchWait·pp/stages, on activations of benchSmall × benchSmall (no
	// compute to speak of, nor garbage to collect).
	benchWait  = 4 * time.Millisecond
	benchSmall = 16
)

// BenchmarkBubble measures the runtime's bubble, the idle fraction of a
// step (1 − time in F, I, W, B over the time from one step's start to the
// next's, the steps starting together at a barrier; mean over the ranks,
// the steps after a warm-up step), for every schedule at pp=2
// M=4 and pp=4 M=8 with balanced stages, beside the theory: the
// schedule's simulated bubble with the costs of F, B, I and W measured in
// the same run ("theory"), and with unit costs ("unit"). At pp=2 the
// stages compute (GEMMs on one thread per rank); at pp=4 each stage's F,
// I and W wait a fixed time instead (time.Sleep), so that the
// measurement is of the schedule and the runtime's overhead, not of four
// ranks contending for two cores. Run it on a quiet machine:
//
//	go test ./parallel/pp -run '^$' -bench Bubble -benchtime 5x
func BenchmarkBubble(b *testing.B) {
	blas, err := kernels.Load(kernels.WithThreads(1), kernels.WithRanksInProcess(2))
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		ranks, m int
		wait     bool
	}{{2, 4, false}, {2, 4, true}, {4, 8, true}} {
		for _, name := range []string{"gpipe", "1f1b", "interleaved", "zb1", "zbv"} {
			what := "compute"
			if c.wait {
				what = "wait"
			}
			b.Run(fmt.Sprintf("pp%d/M%d/%s/%s", c.ranks, c.m, what, name), func(b *testing.B) {
				s, err := pp.Build(name, c.ranks, c.m, 0)
				if err != nil {
					b.Fatal(err)
				}
				measured, costs, err := bubbleRun(context.Background(), s, b.N, c.wait, blas)
				if err != nil {
					b.Fatal(err)
				}
				theory, err := s.Bubble(costs)
				if err != nil {
					b.Fatal(err)
				}
				unit, err := s.Bubble(pp.UnitCosts())
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(measured, "bubble")
				b.ReportMetric(theory, "theory")
				b.ReportMetric(unit, "unit")
				b.ReportMetric(costs.F*1e3, "F-ms")
				b.ReportMetric(costs.B*1e3, "B-ms")
				b.ReportMetric(costs.I*1e3, "I-ms")
				b.ReportMetric(costs.W*1e3, "W-ms")
			})
		}
	}
}

// bubbleRun runs steps steps of s (after one warm-up step) on s.Ranks
// in-process ranks with balanced stages (computing, or waiting when wait
// is set) and returns the mean measured bubble and the mean durations of
// F, B, I and W in seconds (B as I+W where the schedule splits every
// backward, I and W as B's halves where it splits none).
func bubbleRun(ctx context.Context, s *pp.Schedule, steps int, wait bool, blas *kernels.BLAS) (float64, pp.Costs, error) {
	tl := trace.NewTimeline()
	var mu sync.Mutex
	var bubble float64
	err := local.Run(ctx, s.Ranks, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{s.Ranks, 1}, []string{"pp", "dp"})
		if err != nil {
			return err
		}
		tr, err := pp.NewTransport(ctx, m, "pp")
		if err != nil {
			return err
		}
		tape := autograd.NewTape(autograd.WithBLAS(blas))
		funcs := map[int]pp.StageFunc{}
		var params []*autograd.Value
		for _, k := range s.StagesOf(tr.Rank()) {
			var ps []*autograd.Value
			if funcs[k], ps, err = benchStage(tape, tr.Mesh(), s, k, wait); err != nil {
				return err
			}
			params = append(params, ps...)
		}
		rt, err := pp.NewRuntime(s, tape, tr, funcs, pp.WithTimeline(tl, c.Rank()))
		if err != nil {
			return err
		}
		// Every step starts at a barrier, as the example's steps do at
		// its loss all-reduce (without one, a rank that finishes early
		// starts the next step's forwards while the others drain, and
		// steps overlap). A rank's bubble is 1 − busy/period, the period
		// from one barrier's exit to the next: the simulation's measure,
		// busy time over the makespan.
		var busy, period time.Duration
		var t0 time.Time
		for i := range steps + 2 {
			if err := comm.Barrier(ctx, c); err != nil {
				return err
			}
			if i >= 2 {
				period += time.Since(t0)
			}
			if i == steps+1 {
				break
			}
			if i == 1 { // the warm-up step's spans are dropped
				if c.Rank() == 0 {
					tl.Reset()
				}
				if err := comm.Barrier(ctx, c); err != nil {
					return err
				}
			}
			t0 = time.Now()
			st, err := rt.Step(ctx)
			if err != nil {
				return err
			}
			if i > 0 {
				busy += st.Busy
			}
			for _, p := range params {
				if p == nil {
					continue
				}
				p.ZeroGrad()
			}
		}
		sum := 1 - float64(busy)/float64(period)
		mu.Lock()
		defer mu.Unlock()
		bubble += sum / float64(s.Ranks)
		return nil
	})
	if err != nil {
		return 0, pp.Costs{}, err
	}
	return bubble, measuredCosts(tl.Events()), nil
}

// measuredCosts are the mean durations of the runtime's F, B, I and W
// spans ("F s0 mb1") in seconds.
func measuredCosts(events []trace.Event) pp.Costs {
	sum, n := map[string]time.Duration{}, map[string]int{}
	for _, e := range events {
		kind, _, ok := strings.Cut(e.Name, " s")
		if e.Lane == trace.LaneCompute && ok && slices.Contains([]string{"F", "B", "I", "W"}, kind) {
			sum[kind] += e.End - e.Start
			n[kind]++
		}
	}
	mean := func(k string) float64 {
		if n[k] == 0 {
			return 0
		}
		return (sum[k] / time.Duration(n[k])).Seconds()
	}
	c := pp.Costs{F: mean("F"), B: mean("B"), I: mean("I"), W: mean("W")}
	switch {
	case n["B"] == 0:
		c.B = c.I + c.W
	case n["I"] == 0:
		c.I, c.W = c.B/2, c.B/2
	}
	return c
}

// benchStage returns stage k's StageFunc for BenchmarkBubble, its
// parameters on tape: the stage's share of the model's products, or, with
// wait, an op that waits its share in forward and in the input half of
// backward and one that waits it in the weight half. The first stage
// starts from a weight of its own (so that its input half has work, as
// a real first stage's has below its embedding), the last sums to a
// scalar loss.
func benchStage(tape *autograd.Tape, sm *mesh.Mesh, s *pp.Schedule, k int, wait bool) (pp.StageFunc, []*autograd.Value, error) {
	param := func(name string, shape []int, v float32) (*autograd.Value, error) {
		n := 1
		for _, d := range shape {
			n *= d
		}
		full := make([]float32, n)
		for i := range full {
			full[i] = v * float32(1+i%7)
		}
		spec, err := placement.NewSpec(sm, shape, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return nil, err
		}
		dt, err := placement.FromFull(spec, full)
		if err != nil {
			return nil, err
		}
		return tape.Param(name, dt)
	}
	S := s.Stages()
	prefix := fmt.Sprintf("stage%d.", k)
	var first *autograd.Value
	var err error
	rows, width := benchRows, benchD
	if wait {
		rows, width = benchSmall, benchSmall
	}
	if k == 0 {
		if first, err = param(prefix+"input", []int{rows, width}, 0.01); err != nil {
			return nil, nil, err
		}
	}
	var ws []*autograd.Value
	var d time.Duration
	if wait {
		d = benchWait * time.Duration(s.Ranks) / time.Duration(S)
		w, err := param(prefix+"w", []int{1}, 0)
		if err != nil {
			return nil, nil, err
		}
		ws = append(ws, w)
	} else {
		for l := range benchLayers / S {
			w, err := param(fmt.Sprintf("%sw%d", prefix, l), []int{benchD, benchD}, 1.0/benchD)
			if err != nil {
				return nil, nil, err
			}
			ws = append(ws, w)
		}
	}
	return func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
		var err error
		if k == 0 {
			// A copy of the stage's own input weight: an activation
			// that requires grad, so that the input half has work here.
			in := first
			if h, err = autograd.Custom("bench.embed", []*autograd.Value{in}, func() (*placement.DTensor, error) {
				return clone(in.Data())
			}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
				return []*placement.DTensor{g}, nil
			}); err != nil {
				return nil, err
			}
		}
		if wait {
			if h, err = waitOps(h, ws[0], d); err != nil {
				return nil, err
			}
		} else {
			for _, w := range ws {
				if h, err = autograd.MatMul(h, w); err != nil {
					return nil, err
				}
			}
		}
		if k < S-1 {
			return h, nil
		}
		return autograd.Sum(h)
	}, append(ws, first), nil // first is nil but on stage 0
}

// clone copies a host DTensor's local block into a new DTensor of its spec.
func clone(t *placement.DTensor) (*placement.DTensor, error) {
	return placement.NewLocal(t.Spec(), slices.Clone(t.LocalData().([]float32)))
}

// waitOps are a waiting stage: h's copy after d (F), whose backward waits
// d before passing the gradient on (the input half, I), plus a term of
// zeros from w whose backward waits d (the weight half, W: its only
// input is a weight, so the split backward leaves it to W).
func waitOps(h, w *autograd.Value, d time.Duration) (*autograd.Value, error) {
	a, err := autograd.Custom("bench.f", []*autograd.Value{h}, func() (*placement.DTensor, error) {
		time.Sleep(d)
		return clone(h.Data())
	}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		time.Sleep(d)
		return []*placement.DTensor{g}, nil
	})
	if err != nil {
		return nil, err
	}
	spec := h.Spec()
	z, err := autograd.Custom("bench.w", []*autograd.Value{w}, func() (*placement.DTensor, error) {
		return placement.NewLocal(spec, make([]float32, benchSmall*benchSmall))
	}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		time.Sleep(d)
		gw, err := placement.NewLocal(w.Spec(), []float32{0})
		return []*placement.DTensor{gw}, err
	})
	if err != nil {
		return nil, err
	}
	return autograd.Add(a, z)
}
