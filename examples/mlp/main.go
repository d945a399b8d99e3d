// Command mlp trains a model of one's own, an MLP classifier (Sequential of
// Linear, ReLU, Dropout, Linear), on a synthetic dataset with train's loop,
// as dp × fsdp × tp ranks in this process: the skeleton to copy.
//
//	go run ./examples/mlp -dp 2 -tp 2
//	go run ./examples/mlp -fsdp 4 -steps 200 -json metrics.jsonl
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/train"
)

const features, hidden, classes, rows = 16, 64, 4, 4096

type options struct {
	dp, tp, fsdp, steps, batch int
	json                       string
}

func main() {
	var o options
	flag.IntVar(&o.dp, "dp", 1, "data-parallel ranks (DDP; with -fsdp, HSDP)")
	flag.IntVar(&o.tp, "tp", 1, "tensor-parallel ranks (the hidden layer split over them)")
	flag.IntVar(&o.fsdp, "fsdp", 1, "fully sharded data-parallel ranks (FSDP)")
	flag.IntVar(&o.steps, "steps", 100, "optimizer steps")
	flag.IntVar(&o.batch, "batch", 64, "global batch in rows")
	flag.StringVar(&o.json, "json", "", "write each step's metrics to this file as JSON lines")
	flag.Parse()
	if _, err := run(context.Background(), os.Stdout, o); err != nil {
		fmt.Fprintln(os.Stderr, "mlp:", err)
		os.Exit(1)
	}
}

// newModel is the user's model, written once in global terms and laid out
// over the mesh: "tp" splits the hidden layer (Megatron's column then row
// split), "fsdp" shards the parameters (FSDP) and "dp" replicates them
// (DDP, or HSDP with "fsdp"). It returns the reducer that completes each step's gradients.
func newModel(ctx context.Context, tape *autograd.Tape, m *mesh.Mesh, o options) (*parallel.Sequential, train.Reducer, error) {
	fc1, err1 := parallel.NewLinear(tape, m, features, hidden, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.25, 1)))
	fc2, err2 := parallel.NewLinear(tape, m, hidden, classes, parallel.WithName("3"), parallel.WithInit(parallel.Normal(0.125, 2)))
	drop, err3 := parallel.NewDropout(0.1, 7)
	if err := errors.Join(err1, err2, err3); err != nil {
		return nil, nil, err
	}
	model, err := parallel.NewSequential(fc1, parallel.NewReLU(), drop, fc2)
	if err != nil {
		return nil, nil, err
	}
	plan := tp.Plan{{Pattern: "0", Style: tp.ColwiseParallel{}}, {Pattern: "3", Style: tp.RowwiseParallel{}}}
	if err := tp.Parallelize(ctx, model, "tp", plan); err != nil {
		return nil, nil, err
	}
	switch {
	case o.fsdp > 1:
		var hsdp []fsdp.Option // with -dp too: HSDP, replicas of the shards
		if o.dp > 1 {
			hsdp = append(hsdp, fsdp.WithReplicateAxis("dp"))
		}
		f, err := fsdp.FullyShard(ctx, model, []string{"0", "3"}, hsdp...)
		return model, f, err
	case o.dp > 1:
		params, err := parallel.Params(model)
		if err != nil {
			return nil, nil, err
		}
		d, err := ddp.New(ctx, params)
		return model, d, err
	}
	return model, nil, nil
}

// run trains on dp × fsdp × tp ranks — in-process when started by hand,
// one per process under loomrun, torchrun or mpirun (launch.Auto) — and
// returns rank 0's history; rank 0 reports progress to out.
func run(ctx context.Context, out io.Writer, o options) (*train.History, error) {
	job, err := launch.Auto(o.dp * o.fsdp * o.tp)
	if err != nil {
		return nil, err
	}
	var hist *train.History
	err = job.Run(ctx, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{o.dp, o.fsdp, o.tp}, []string{"dp", "fsdp", "tp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		model, sync, err := newModel(ctx, tape, m, o)
		if err != nil {
			return err
		}
		params, err := parallel.Params(model) // after FullyShard: the shards
		if err != nil {
			return err
		}
		opt, err1 := optim.NewAdamW(params, optim.WithLR(1e-2))
		sched, err2 := train.WarmupCosine(1e-2, 1e-3, o.steps/10, o.steps)
		x, y, err3 := train.Blobs(rows, features, classes, 1) // the same on every rank
		all := &train.InMemory{X: x, Features: features, Y: y, Tape: tape, Mesh: m, Axes: []string{"dp", "fsdp"}}
		data, held, err4 := all.Split(rows * 7 / 8)
		if err := errors.Join(err1, err2, err3, err4); err != nil {
			return err
		}
		sampler, err1 := data.Sampler(o.batch, train.WithShuffle(3))
		heldOut, err2 := held.Sampler(held.Len()) // one batch of every held-out row
		if err := errors.Join(err1, err2); err != nil {
			return err
		}
		loss := func(ctx context.Context, b train.Classification) (*autograd.Value, error) {
			logits, err := model.Forward(ctx, b.X)
			if err != nil {
				return nil, err
			}
			return autograd.CrossEntropy(logits, b.Y)
		}
		opts := []train.Option{train.WithSchedule(sched, &opt.LR), train.WithClip(1), train.WithEval(max(1, o.steps/4), train.ClassifierEval(model, tape, held, heldOut)), train.WithReducer(sync)}
		if c.Rank() == 0 {
			opts = append(opts, train.WithProgress(out, 10), train.WithJSON(o.json))
		}
		tr, err := train.NewTrainer(model, tape, opt, loss, opts...)
		if err != nil {
			return err
		}
		h, err := tr.Fit(ctx, data, sampler, o.steps)
		if c.Rank() == 0 {
			hist = h
		}
		return err
	})
	return hist, err
}
