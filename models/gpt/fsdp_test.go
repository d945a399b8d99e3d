package gpt_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestFSDPGPT shards a small GPT with fsdp.FullyShard (each block a
// unit, the model the root) over fsdp=3 (uneven shards) and checks one
// step's loss and every gradient against one rank: float32, so within
// 1e-5 (reduction order).
func TestFSDPGPT(t *testing.T) {
	cfg := gpt.Config{Vocab: 17, Width: 12, Heads: 2, Layers: 2, MLPWidth: 20, SeqLen: 8, InitStd: 0.2, LNEps: 1e-5}
	const B, T = 6, 8
	rng := rand.New(rand.NewPCG(1, 2))
	b := tinygpt.Batch{B: B, T: T, X: make([]int64, B*T), Y: make([]int64, B*T)}
	for i := range b.X {
		b.X[i], b.Y[i] = int64(rng.IntN(cfg.Vocab)), int64(rng.IntN(cfg.Vocab))
	}
	run := func(p int) (float64, map[string][]float32) {
		var mu sync.Mutex
		var loss float64
		grads := map[string][]float32{}
		err := placementtest.Simulate(context.Background(), []int{p}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
			tape := autograd.NewTape()
			md, err := gpt.New(tape, m, cfg, gpt.WithSeed(3))
			if err != nil {
				return err
			}
			var f *fsdp.FSDP
			if p > 1 {
				if f, err = fsdp.FullyShard(ctx, md, []string{"h.*"}); err != nil {
					return err
				}
			}
			x, y, err := md.Inputs(b, []placement.Placement{placement.Shard(0)})
			if err != nil {
				return err
			}
			l, err := md.Forward(ctx, tape, x, y)
			if err != nil {
				return err
			}
			full, err := l.Data().Full(ctx)
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, l); err != nil {
				return err
			}
			if f != nil {
				if err := f.Finish(ctx); err != nil {
					return err
				}
			}
			for _, q := range md.Params() {
				if q.Grad() == nil {
					return fmt.Errorf("%s: no gradient", q.Name())
				}
				g, err := q.Grad().Full(ctx)
				if err != nil {
					return err
				}
				if m.Rank() == 0 {
					mu.Lock()
					grads[q.Name()] = g.([]float32)
					mu.Unlock()
				}
			}
			if m.Rank() == 0 {
				loss = float64(full.([]float32)[0])
			}
			return nil
		})
		if err != nil {
			t.Fatalf("p=%d: %v", p, err)
		}
		return loss, grads
	}
	wantLoss, want := run(1)
	gotLoss, got := run(3)
	if math.Abs(gotLoss-wantLoss) > 1e-5 {
		t.Errorf("loss %v, serial %v", gotLoss, wantLoss)
	}
	if len(got) != len(want) {
		t.Fatalf("%d gradients, serial %d", len(got), len(want))
	}
	for name, w := range want {
		g := got[name]
		for k := range w {
			if math.Abs(float64(g[k]-w[k])) > 1e-5*math.Max(1, math.Abs(float64(w[k]))) {
				t.Fatalf("%s[%d] = %g, serial %g", name, k, g[k], w[k])
			}
		}
	}
}
