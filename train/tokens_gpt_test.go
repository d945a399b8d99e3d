package train_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// TestGPTOnText trains a tiny GPT (vocabulary 256, one token per byte) a
// few steps on a text file, shuffled, on one rank and on dp=2×tp=2 (DDP
// on dp, the model's tensor-parallel plan on tp): the training losses and
// the validation losses (ValLoss on the held-out tail) agree within 1e-6
// relative, about 8 float32 ulps. The layouts differ only in the order of
// float32 sums (the dp all-reduce adds two half-batch gradients, the tp
// layers split their matrix products and the vocab-parallel
// cross-entropy its reductions), measured at 1e-7 relative here. ValLoss
// gives the same value twice and leaves the sampler where it was.
func TestGPTOnText(t *testing.T) {
	path := writeFile(t, "input.txt", corpus(3000))
	c := tinygpt.Default()
	c.D, c.H, c.L, c.F, c.T, c.B = 16, 2, 2, 32, 8, 4
	cfg := gpt.FromReference(c)
	init := gpt.RandomInit(cfg, 5)
	const steps = 4
	type result struct{ train, val []float64 }
	run := func(shape []int) result {
		var res result
		placementtest.Run(t, shape, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
			f, err := train.OpenTokens(path, cfg.Vocab)
			if err != nil {
				return err
			}
			defer f.Close()
			all, err := train.NewWindows(f, c.T, m, "dp")
			if err != nil {
				return err
			}
			data, held, err := all.Split(0.1)
			if err != nil {
				return err
			}
			tape := autograd.NewTape()
			md, err := gpt.New(tape, m, cfg, gpt.WithParams(init))
			if err != nil {
				return err
			}
			if shape[1] > 1 {
				if err := tp.Parallelize(ctx, md, "tp", gpt.Plan(false)); err != nil {
					return err
				}
			}
			opts := []train.Option{}
			if shape[0] > 1 {
				d, err := ddp.New(ctx, md.Params(), ddp.WithAxis("dp"))
				if err != nil {
					return err
				}
				opts = append(opts, train.WithReducer(d))
			}
			opts = append(opts, train.WithReducer(train.SyncGrads(md.Params())))
			opt, err := optim.NewAdamW(md.Params(), optim.WithLR(1e-2))
			if err != nil {
				return err
			}
			loss := func(ctx context.Context, b train.LM) (*autograd.Value, error) {
				return md.Forward(ctx, tape, b.X, b.Y)
			}
			tr, err := train.NewTrainer(md, tape, opt, loss, opts...)
			if err != nil {
				return err
			}
			s, err := data.Sampler(c.B, train.WithShuffle(9))
			if err != nil {
				return err
			}
			vs, err := held.Sampler(c.B)
			if err != nil {
				return err
			}
			for range steps {
				b, err := data.Batch(ctx, s.Next())
				if err != nil {
					return err
				}
				r, err := tr.Step(ctx, []train.LM{b}, c.B)
				if err != nil {
					return err
				}
				// The second ValLoss starts from another position: it must
				// still see the same batches, and leave the position alone.
				var val [2]float64
				for i := range val {
					vs.Next()
					st := vs.State()
					if val[i], err = train.ValLoss(ctx, tape, held, vs, 3, loss); err != nil {
						return err
					}
					if vs.State() != st {
						return fmt.Errorf("ValLoss moved the sampler from %+v to %+v", st, vs.State())
					}
				}
				if val[0] != val[1] {
					return fmt.Errorf("ValLoss gave %v then %v", val[0], val[1])
				}
				if m.Rank() == 0 {
					res.train = append(res.train, r.Loss)
					res.val = append(res.val, val[0])
				}
			}
			return nil
		})
		return res
	}
	one, four := run([]int{1, 1}), run([]int{2, 2})
	if t.Failed() {
		return
	}
	t.Logf("1 rank: train %v val %v", one.train, one.val)
	t.Logf("dp=2×tp=2: train %v val %v", four.train, four.val)
	for i := range steps {
		for _, p := range []struct {
			what string
			a, b float64
		}{{"training", one.train[i], four.train[i]}, {"validation", one.val[i], four.val[i]}} {
			if d := math.Abs(p.a - p.b); !(d <= 1e-6*math.Abs(p.a)) {
				t.Errorf("step %d: %s loss %v on one rank, %v on dp=2×tp=2", i+1, p.what, p.a, p.b)
			}
		}
	}
	if !(one.val[steps-1] < one.val[0]) {
		t.Errorf("validation loss %v did not fall", one.val)
	}
}
