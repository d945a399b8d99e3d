package gpt_test

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// A tape that recycles op results computes exactly what a tape that
// allocates them does, pass after pass, on one rank and under tensor,
// sequence and data parallelism: every loss and every gradient is equal
// bit for bit. Its recycled memory is poisoned with NaN, so a read of a
// value after its Recycle would show; and a recycled value is refused.
func TestRecyclingMatchesFreshMemory(t *testing.T) {
	c := small()
	init := gpt.RandomInit(gpt.FromReference(c), 3)
	for _, l := range []struct {
		name  string
		shape []int
		sp    bool
	}{{"1 rank", []int{1, 1}, false}, {"dp=2,tp=2,sp", []int{2, 2}, true}, {"dp=2", []int{2, 1}, false}, {"tp=2", []int{1, 2}, false}} {
		t.Run(l.name, func(t *testing.T) {
			placementtest.Run(t, l.shape, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				tapes := []*autograd.Tape{autograd.NewTape(autograd.WithPoisonRecycled()), autograd.NewTape()}
				models := make([]*gpt.Model, 2)
				for i, tape := range tapes {
					md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(init))
					if err != nil {
						return err
					}
					if m.Shape()[1] > 1 {
						if err := tp.Parallelize(ctx, md, "tp", gpt.Plan(l.sp)); err != nil {
							return err
						}
					}
					models[i] = md
				}
				places := []placement.Placement{placement.Shard(0), placement.Replicate()}
				var stale *autograd.Value
				for pass := range 4 {
					b := randomBatch(c, uint64(100+pass))
					var losses [2]float64
					for i, md := range models {
						tapes[i].Recycle()
						x, y, err := md.Inputs(b, places)
						if err != nil {
							return err
						}
						loss, err := md.Forward(ctx, tapes[i], x, y)
						if err != nil {
							return err
						}
						full, err := loss.Data().Full(ctx)
						if err != nil {
							return err
						}
						switch d := full.(type) {
						case []float32:
							losses[i] = float64(d[0])
						}
						if err := tapes[i].Backward(ctx, loss); err != nil {
							return err
						}
						if i == 0 {
							stale = loss
						}
					}
					if losses[0] != losses[1] || math.IsNaN(losses[0]) {
						t.Errorf("rank %d, pass %d: loss %v recycling, %v not", m.Rank(), pass, losses[0], losses[1])
					}
					for j, p := range models[0].Params() {
						q := models[1].Params()[j]
						a, b := p.Grad().LocalData().([]float32), q.Grad().LocalData().([]float32)
						for k := range a {
							if a[k] != b[k] || math.IsNaN(float64(a[k])) {
								t.Errorf("rank %d, pass %d: %s[%d] = %v recycling, %v not", m.Rank(), pass, p.Name(), k, a[k], b[k])
								break
							}
						}
						p.ZeroGrad()
						q.ZeroGrad()
					}
				}
				tapes[0].Recycle()
				if stale.Data() != nil || stale.Spec() != nil {
					t.Errorf("a recycled value still has data %v", stale.Data())
				}
				if _, err := autograd.Scale(stale, 2); !errors.Is(err, autograd.ErrInvalid) {
					t.Errorf("Scale of a recycled value: got %v, want ErrInvalid", err)
				}
				return nil
			})
		})
	}
}
