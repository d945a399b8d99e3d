package gpt_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// parallel.Checkpoint on the real GPT's blocks ("h.*"), full or
// selective, gives every gradient (and the loss) of the model without
// checkpointing bit for bit, on one rank and under data, tensor and
// sequence parallelism, pass after pass on recycling tapes; with every
// block checkpointed the peak of activation bytes is at most half.
func TestCheckpointMatchesPlain(t *testing.T) {
	c := small()
	c.L = 4
	init := gpt.RandomInit(gpt.FromReference(c), 5)
	for _, l := range []struct {
		name  string
		shape []int
		sp    bool
	}{{"1 rank", []int{1, 1}, false}, {"dp=2", []int{2, 1}, false}, {"tp=2,sp", []int{1, 2}, true}, {"dp=2,tp=2", []int{2, 2}, false}} {
		for _, mode := range []string{"full", "selective"} {
			t.Run(l.name+" "+mode, func(t *testing.T) {
				placementtest.Run(t, l.shape, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
					tapes := []*autograd.Tape{autograd.NewTape(autograd.WithPoisonRecycled()), autograd.NewTape(autograd.WithPoisonRecycled())}
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
						if i == 1 {
							var opts []autograd.CheckpointOption
							if mode == "selective" {
								opts = append(opts, autograd.WithKeepMatrixProducts())
							}
							if err := parallel.Checkpoint(md, []string{"h.*"}, opts...); err != nil {
								return err
							}
						}
						models[i] = md
					}
					places := []placement.Placement{placement.Shard(0), placement.Replicate()}
					for pass := range 2 {
						b := randomBatch(c, uint64(200+pass))
						var losses [2]float32
						var peaks [2]int64
						for i, md := range models {
							tapes[i].Recycle()
							tapes[i].ResetPeak()
							x, y, err := md.Inputs(b, places)
							if err != nil {
								return err
							}
							loss, err := md.Forward(ctx, tapes[i], x, y)
							if err != nil {
								return err
							}
							losses[i] = loss.Data().LocalData().([]float32)[0]
							if err := tapes[i].Backward(ctx, loss); err != nil {
								return err
							}
							peaks[i] = tapes[i].PeakActivationBytes()
						}
						if math.Float32bits(losses[0]) != math.Float32bits(losses[1]) {
							t.Errorf("rank %d, pass %d: loss %v checkpointed, %v not", m.Rank(), pass, losses[1], losses[0])
						}
						ratio := float64(peaks[1]) / float64(peaks[0])
						if m.Rank() == 0 && pass == 0 {
							t.Logf("peak activation bytes %d checkpointed, %d not: %.3f", peaks[1], peaks[0], ratio)
						}
						if mode == "full" && ratio > 0.5 {
							t.Errorf("rank %d: full checkpointing's peak is %.3f of the plain one; want <= 0.5", m.Rank(), ratio)
						}
						if ratio >= 1 {
							t.Errorf("rank %d: %s checkpointing's peak %d is not below the plain %d", m.Rank(), mode, peaks[1], peaks[0])
						}
						for j, p := range models[0].Params() {
							q := models[1].Params()[j]
							a, b := p.Grad().LocalData().([]float32), q.Grad().LocalData().([]float32)
							if len(a) != len(b) {
								return fmt.Errorf("%s: gradient blocks of %d and %d", p.Name(), len(a), len(b))
							}
							for k := range a {
								if math.Float32bits(a[k]) != math.Float32bits(b[k]) {
									t.Errorf("rank %d, pass %d: %s[%d] = %v checkpointed, %v not", m.Rank(), pass, p.Name(), k, b[k], a[k])
									break
								}
							}
							p.ZeroGrad()
							q.ZeroGrad()
						}
					}
					return nil
				})
			})
		}
	}
}

// BenchmarkCheckpointStep times one training step's forward and backward
// (recycling tape, one rank) of a GPT of 4 blocks without checkpointing,
// with every block fully checkpointed and with the matrix products kept.
func BenchmarkCheckpointStep(b *testing.B) {
	c := small()
	c.D, c.H, c.L, c.F, c.T, c.B = 64, 4, 4, 256, 32, 8
	init := gpt.RandomInit(gpt.FromReference(c), 5)
	batch := randomBatch(c, 9)
	for _, mode := range []string{"none", "full", "selective"} {
		b.Run(mode, func(b *testing.B) {
			placementtest.Run(b, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				tape := autograd.NewTape(autograd.WithRecycling())
				md, err := gpt.New(tape, m, gpt.FromReference(c), gpt.WithParams(init))
				if err != nil {
					return err
				}
				switch mode {
				case "full":
					err = parallel.Checkpoint(md, []string{"h.*"})
				case "selective":
					err = parallel.Checkpoint(md, []string{"h.*"}, autograd.WithKeepMatrixProducts())
				}
				if err != nil {
					return err
				}
				x, y, err := md.Inputs(batch, nil)
				if err != nil {
					return err
				}
				var peak int64
				for b.Loop() {
					tape.Recycle()
					tape.ResetPeak()
					loss, err := md.Forward(ctx, tape, x, y)
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, loss); err != nil {
						return err
					}
					peak = tape.PeakActivationBytes()
					md.ZeroGrad()
				}
				b.ReportMetric(float64(peak), "peak-act-B")
				return nil
			})
		})
	}
}
