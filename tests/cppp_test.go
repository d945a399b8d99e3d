package tests

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
)

// cpppLayout is a pipeline with context parallelism: the schedule, its
// micro-batches, the dp and cp sizes and the attention method.
type cpppLayout struct {
	schedule string
	m        int // micro-batches
	dp, cp   int
	method   cp.Method
}

func (l cpppLayout) String() string {
	return fmt.Sprintf("%s/M%d/dp%d/cp%d/%v", l.schedule, l.m, max(l.dp, 1), l.cp, l.method)
}

// cpppRun trains ppCfg pipelined on a (pp=2, dp, cp) mesh for steps
// steps, with SGD as ppReference: every stage's attention is
// cp.Attention over "cp" (gpt.WithStageContextParallel), the ids and
// targets have their rows sharded over dp and their sequence load
// balanced over cp, and each stage's gradients are summed over dp and cp
// once per step at the schedule's ReduceGrad actions (tp.ReduceGrads). It
// returns the losses (the last stage's, summed over dp and cp) and the
// final parameters.
func cpppRun(ctx context.Context, l cpppLayout, steps int) ([]float64, map[string][]float32, error) {
	s, err := pp.Build(l.schedule, 2, l.m, 0)
	if err != nil {
		return nil, nil, err
	}
	if s, err = pp.Lower(s, pp.WithReduceGrad()); err != nil {
		return nil, nil, err
	}
	dpN, cpN := max(l.dp, 1), max(l.cp, 1)
	var mu sync.Mutex
	params := map[string][]float32{}
	losses := make([]float64, steps)
	err = local.Run(ctx, s.Ranks*dpN*cpN, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{s.Ranks, dpN, cpN}, []string{"pp", "dp", "cp"})
		if err != nil {
			return err
		}
		tr, err := pp.NewTransport(ctx, m, "pp")
		if err != nil {
			return err
		}
		sm := tr.Mesh()
		batchGroup, err := sm.Group(ctx, "dp", "cp")
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
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
			st, err := gpt.NewStage(tape, sm, ppCfg, k*ppCfg.Layers/S, (k+1)*ppCfg.Layers/S, ppInit(false),
				gpt.WithStageContextParallel("cp", cp.WithMethod(l.method)))
			if err != nil {
				return err
			}
			byStage[k] = st.Params()
			all = append(all, byStage[k]...)
			funcs[k] = func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
				xs, ys := ppBatch(step, ppRows)
				rg, T := rows[mb], ppCfg.SeqLen
				shape := []int{rg.Hi - rg.Lo, T}
				r := []placement.Placement{placement.Shard(0), placement.ShardBalanced(1)}
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
		rt, err := pp.NewRuntime(s, tape, tr, funcs, pp.WithGradReduction(func(ctx context.Context, stage int) error {
			return tp.ReduceGrads(ctx, byStage[stage])
		}))
		if err != nil {
			return err
		}
		for ; step < steps; step++ {
			st, err := rt.Step(ctx)
			if err != nil {
				return err
			}
			if !math.IsNaN(st.Loss) {
				// The loss is Partial(sum) over dp and cp.
				v := []float64{st.Loss}
				if err := comm.AllReduce(ctx, batchGroup, comm.Host(v), comm.Host(v), comm.Sum); err != nil {
					return err
				}
				losses[step] = v[0]
			}
			if err := sgd(all); err != nil {
				return err
			}
		}
		return gatherParams(ctx, all, &mu, params)
	})
	return losses, params, err
}

// TestContextParallelPipeline: context parallelism inside pipeline
// stages trains as one rank does. cp=2 × pp=2 with 1F1B and ZB-H1 (split
// backward), the ring and Ulysses, and pp=2 × dp=2 × cp=2 (8 ranks) with
// 1F1B: the sequence-sharded activations cross stages in their load
// balanced layout, the last stage's loss is the mean cross-entropy over
// [B, T, V], and each stage's gradients are summed over cp (with dp's)
// once per step at ReduceGrad. The losses and final parameters equal
// ppReference's within compare's 2e-5 (float32: attention merged by
// log-sum-exp over blocks, gradients summed over ranks; a dropped or
// doubled cp sum, or a balanced activation read as plain shards, is off
// by far more).
func TestContextParallelPipeline(t *testing.T) {
	steps := 20
	if testing.Short() {
		steps = 3
	}
	wantLoss, wantParams := ppReference(t, steps, false)
	for _, l := range []cpppLayout{
		{schedule: "1f1b", m: 4, cp: 2, method: cp.Ring},
		{schedule: "zb1", m: 4, cp: 2, method: cp.Ring},
		{schedule: "1f1b", m: 4, cp: 2, method: cp.Ulysses},
		{schedule: "1f1b", m: 5, dp: 2, cp: 2, method: cp.Ring},
	} {
		t.Run(l.String(), func(t *testing.T) {
			losses, params, err := cpppRun(context.Background(), l, steps)
			if err != nil {
				t.Fatal(err)
			}
			compare(t, losses, params, wantLoss, wantParams)
		})
	}
}
