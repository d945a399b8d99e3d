package train_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// loss adapts gpt.Trainer to train.Stepper: each step reports its loss.
type loss struct{ tr *gpt.Trainer }

func (l loss) Step(ctx context.Context) (float64, error) {
	_, v, err := l.tr.Step(ctx)
	return v, err
}

// Train a small GPT for six steps on dp=2 in-process ranks (the batch
// sharded over them, DDP reducing the gradients), printing rank 0's loss
// every two steps.
func ExampleRun() {
	run := tinygpt.Default() // the reference's data and AdamW settings
	run.T, run.B = 16, 4
	cfg := gpt.Config{Vocab: 256, Width: 32, Heads: 2, Layers: 1, MLPWidth: 64, SeqLen: run.T, InitStd: 0.02, LNEps: 1e-5}
	loop := train.Loop{Ranks: 2, Steps: 6, Every: 2, Tokens: run.B * run.T, Flags: train.Flags{Threads: 1, TraceSteps: 1}}
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		m, err := mesh.New(r.Comm, []int{2}, []string{"dp"})
		if err != nil {
			return nil, err
		}
		tr, err := gpt.NewTrainer(ctx, m, cfg, gpt.WithRun(run), gpt.WithDataParallel("dp"),
			gpt.WithModel(gpt.WithSeed(1)), gpt.WithTape(r.Tape...))
		if err != nil {
			return nil, err
		}
		return loss{tr}, nil
	}
	progress := func(step int, l, _ float64) { fmt.Printf("step %d loss %.3f\n", step, l) }
	job, err := launch.InProcess(loop.Ranks)
	if err != nil {
		fmt.Println(err)
		return
	}
	res, err := train.Run(context.Background(), nil, job, loop, setup, progress)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(len(res.Steps), "steps")
	// Output:
	// step 2 loss 5.455
	// step 4 loss 5.273
	// step 6 loss 4.932
	// 6 steps
}
