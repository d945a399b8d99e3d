package pp_test

import (
	"context"
	"fmt"
	"log"
	"sync"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/pp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/trace"
)

// A GPT of 4 blocks on two pipeline ranks, 1F1B over 3 micro-batches of
// a batch of 4 sequences (2, 1 and 1 rows: uneven, weighted by size). Each
// rank builds its stage's parameters only, runs one step, and reduces its
// gradients at the schedule's ReduceGrad; the last stage's rank reports
// the batch's loss, and every rank its peak of micro-batches held.
func ExampleNewRuntime() {
	cfg := gpt.Config{Vocab: 16, Width: 8, Heads: 2, Layers: 4, MLPWidth: 16, SeqLen: 4, InitStd: 0.1, LNEps: 1e-5}
	const batch, T = 4, 4
	init := gpt.RandomInit(cfg, 1)
	s, err := pp.Build("1f1b", 2, 3, 0)
	if err != nil {
		log.Fatal(err)
	}
	if s, err = pp.Lower(s, pp.WithReduceGrad()); err != nil {
		log.Fatal(err)
	}
	tl := trace.NewTimeline()
	var mu sync.Mutex
	lines := make([]string, 2)
	err = local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2, 1, 1}, []string{"pp", "dp", "tp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		rank := c.Rank()
		k := rank // 1F1B: stage k on rank k
		first, last := k*cfg.Layers/2, (k+1)*cfg.Layers/2
		tr, err := pp.NewTransport(ctx, m, "pp") // m: a (pp, dp, tp) mesh; stages live on m without pp
		if err != nil {
			return err
		}
		rows, err := pp.MicroBatches(batch, s.MicroBatches) // uneven sizes: weights n_i/N
		if err != nil {
			return err
		}
		ids := func(r pp.Range) *autograd.Indices { return tokens(tr.Mesh(), r, T, cfg.Vocab, 3) }
		targets := func(r pp.Range) *autograd.Indices { return tokens(tr.Mesh(), r, T, cfg.Vocab, 5) }
		st, err := gpt.NewStage(tape, tr.Mesh(), cfg, first, last, init) // only this stage's parameters
		if err != nil {
			return err
		}
		reduce := func(ctx context.Context, stage int) error { return tp.ReduceGrads(ctx, st.Params()) }
		stages := map[int]pp.StageFunc{k: func(ctx context.Context, mb int, h *autograd.Value) (*autograd.Value, error) {
			x, y := ids(rows[mb]), targets(rows[mb])
			return st.Forward(ctx, h, x, y, rows[mb].Weight) // the last stage: mean CE × n_mb/N
		}}
		rt, err := pp.NewRuntime(s, tape, tr, stages, pp.WithGradReduction(reduce), pp.WithTimeline(tl, rank))
		if err != nil {
			return err
		}
		stats, err := rt.Step(ctx) // stats.Loss, stats.Bubble, stats.PeakHeld, stats.PeakActivationBytes
		if err != nil {
			return err
		}
		line := fmt.Sprintf("rank %d: stage %d holds blocks [%d, %d), at most %d micro-batches' activations", rank, k, first, last, stats.PeakHeld[k])
		if k == s.Stages()-1 {
			line += fmt.Sprintf("; loss %.3f", stats.Loss)
		}
		mu.Lock()
		defer mu.Unlock()
		lines[rank] = line
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range lines {
		fmt.Println(l)
	}
	// Output:
	// rank 0: stage 0 holds blocks [0, 2), at most 2 micro-batches' activations
	// rank 1: stage 1 holds blocks [2, 4), at most 1 micro-batches' activations; loss 2.765
}

// tokens are rows r of a deterministic [batch, T] id matrix, replicated
// on the stage mesh sm.
func tokens(sm *mesh.Mesh, r pp.Range, T, vocab, mul int) *autograd.Indices {
	v := make([]int64, (r.Hi-r.Lo)*T)
	for i := range v {
		v[i] = int64((r.Lo*T + mul*i) % vocab)
	}
	rep := make([]placement.Placement, sm.NDim())
	for i := range rep {
		rep[i] = placement.Replicate()
	}
	x, err := autograd.IndicesFromFull(sm, []int{r.Hi - r.Lo, T}, rep, v)
	if err != nil {
		log.Fatal(err)
	}
	return x
}
