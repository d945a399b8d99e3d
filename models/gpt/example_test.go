package gpt_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// The tiny GPT of reference/TINY_GPT.md, from PyTorch's initial parameters,
// trained for two steps on four in-process ranks: the batch sharded over
// dp=2 (DDP all-reducing the gradients while backward runs) and the model
// over tp=2 by gpt.Plan. Its losses are PyTorch's.
func ExampleNewTrainer() {
	fx, err := tinygpt.LoadFixture() // embedded: tiny_gpt.json and its tensors
	if err != nil {
		fmt.Println(err)
		return
	}
	ref, err := fx.Cfg()
	if err != nil {
		fmt.Println(err)
		return
	}
	init, err := fx.Params(tinygpt.PrefixInit)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2, 2}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		tr, err := gpt.NewTrainer(ctx, m, gpt.FromReference(ref),
			gpt.WithRun(ref),                    // the reference's corpus, batches and AdamW
			gpt.WithModel(gpt.WithParams(init)), // PyTorch's initial parameters
			gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"))
		if err != nil {
			return err
		}
		for _, want := range []float64{fx.LossStep1, fx.LossStep2} {
			step, loss, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			if c.Rank() == 0 {
				fmt.Printf("step %d loss %.4f (PyTorch %.4f)\n", step, loss, want)
			}
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// step 1 loss 5.5207 (PyTorch 5.5207)
	// step 2 loss 4.9038 (PyTorch 4.9038)
}
