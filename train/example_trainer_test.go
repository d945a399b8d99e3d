package train_test

import (
	"context"
	"fmt"
	"io"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/train"
)

// Train an MLP classifier of one's own with FSDP on two in-process ranks:
// a Sequential of Linear, ReLU, Dropout and Linear on a synthetic set,
// with warmup and cosine decay, clipping, two micro-batches per step and
// an evaluation on held-out rows. examples/mlp is the same program with
// flags for data, tensor and fully sharded parallelism.
func ExampleTrainer() {
	x, y, err := train.Blobs(1024, 8, 3, 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	const steps = 40
	log := io.Discard // os.Stdout shows the progress line
	job, err := launch.InProcess(2)
	if err != nil {
		fmt.Println(err)
		return
	}
	err = job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2}, []string{"fsdp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		fc1, err := parallel.NewLinear(tape, m, 8, 32, parallel.WithName("0"))
		if err != nil {
			return err
		}
		fc2, err := parallel.NewLinear(tape, m, 32, 3, parallel.WithName("3"))
		if err != nil {
			return err
		}
		drop, err := parallel.NewDropout(0.1, 7)
		if err != nil {
			return err
		}
		model, err := parallel.NewSequential(fc1, parallel.NewReLU(), drop, fc2) // children "0".."3"
		if err != nil {
			return err
		}
		f, err := fsdp.FullyShard(ctx, model, []string{"0", "3"}) // or ddp.New(ctx, params): DDP
		if err != nil {
			return err
		}
		params, err := parallel.Params(model)
		if err != nil {
			return err
		}
		opt, err := optim.NewAdamW(params, optim.WithLR(1e-2))
		if err != nil {
			return err
		}
		sched, err := train.WarmupCosine(1e-2, 1e-3, 4, steps)
		if err != nil {
			return err
		}
		all := &train.InMemory{X: x, Features: 8, Y: y, Tape: tape, Mesh: m, Axes: []string{"fsdp"}}
		data, held, err := all.Split(896)
		if err != nil {
			return err
		}
		sampler, err := data.Sampler(32, train.WithShuffle(1)) // this rank's rows of each batch
		if err != nil {
			return err
		}
		heldSampler, err := held.Sampler(held.Len())
		if err != nil {
			return err
		}
		loss := func(ctx context.Context, b train.Classification) (*autograd.Value, error) {
			logits, err := model.Forward(ctx, b.X)
			if err != nil {
				return nil, err
			}
			return autograd.CrossEntropy(logits, b.Y)
		}
		opts := []train.Option{train.WithReducer(f),
			train.WithSchedule(sched, &opt.LR), train.WithClip(1), train.WithAccumulation(2),
			train.WithEval(steps, train.ClassifierEval(model, tape, held, heldSampler))}
		if c.Rank() == 0 {
			opts = append(opts, train.WithProgress(log, 10), train.WithJSON("")) // a path writes -json metrics
		}
		tr, err := train.NewTrainer(model, tape, opt, loss, opts...)
		if err != nil {
			return err
		}
		history, err := tr.Fit(ctx, data, sampler, steps)
		if err != nil {
			return err
		}
		if c.Rank() == 0 {
			first, last := history.Steps[0], history.Steps[steps-1]
			fmt.Printf("loss %.2f at step 1, %.2f at step %d\n", first.Loss, last.Loss, last.Step)
			fmt.Printf("held-out accuracy %.2f\n", history.Evals[0].Metrics["accuracy"])
		}
		return nil
	})
	fmt.Println(err)
	// Output:
	// loss 1.10 at step 1, 0.23 at step 40
	// held-out accuracy 0.94
	// <nil>
}
