package gpt

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/models/internal/batches"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// WithWindows trains on a user's token file instead of the reference's
// corpus: step s's global batch is the next B windows of w (train.Windows,
// whose T must be the model's sequence length) in the order of a
// train.Sampler with opts (train.WithShuffle), every rank reading the
// global batch and keeping its rows, so any layout trains on the batches
// one rank would. Hold out a validation split with Windows.Split and
// measure it with ValLoss.
func WithWindows(w *train.Windows, opts ...train.SamplerOption) TrainOption {
	return func(c *trainConfig) { c.data, c.file, c.opts = w, true, opts }
}

// source is the Trainer's batches as the options say.
func (c trainConfig) source(data tinygpt.Config) (batches.Source, error) {
	return batches.Select(data, batches.Choice{Windows: c.data, Opts: c.opts, File: c.file, Random: c.random, Seed: c.seed}, ErrConfig)
}

// Steps is the number of steps taken, or resumed from: the next Step is
// Steps()+1.
func (tr *Trainer) Steps() int { return tr.sampler.Step() }

// Parts returns the trainer's state for package checkpoint, by part:
// "model", the parameters by name (checkpoint.Module: after tensor
// parallelism or FSDP, this rank's shards); "optim", AdamW's moments
// (with the parameters' placements), step counts and hyper-parameters
// (optim.AdamW.StateDict); "data", the batches' position. Give them to
// checkpoint.JobState with Steps() to save, and to checkpoint.LoadJob to
// resume on any layout and device: the next Step then trains on the
// batch the saved run would have trained on next.
func (tr *Trainer) Parts() checkpoint.Parts {
	return checkpoint.Parts{"model": checkpoint.Module(tr.Model), "optim": tr.opt, "data": batches.NewPart(tr.sampler, "gpt", ErrConfig)}
}

// ValLoss is the mean loss over the first n global batches (n ≥ 1) of
// w in order (a validation split: the same batches at every call, so that
// the losses compare across a run and across layouts), with no backward
// and no update. It is collective over the mesh like Step. w's T must be
// the model's sequence length and each batch is Step's batch size.
func (tr *Trainer) ValLoss(ctx context.Context, w *train.Windows, n int) (float64, error) {
	if err := numcheck.Count(ErrConfig, "ValLoss: validation batches", n); err != nil {
		return 0, err
	}
	if w == nil || w.T() != tr.Model.Config().SeqLen {
		return 0, fmt.Errorf("%w: ValLoss: windows %v for a model of sequence length %d", ErrConfig, w, tr.Model.Config().SeqLen)
	}
	src, err := batches.Windows(w, tr.batch)
	if err != nil {
		return 0, fmt.Errorf("gpt: ValLoss: %w", err)
	}
	var sum float64
	for i := range n {
		b, err := src.Next()
		if err == nil {
			var l float64
			if l, err = tr.loss(ctx, b); err == nil {
				sum += l
				continue
			}
		}
		return 0, fmt.Errorf("gpt: ValLoss: batch %d: %w", i+1, err)
	}
	return sum / float64(n), nil
}

// loss is the global loss of batch b, forward only: the ops it records
// are dropped after.
func (tr *Trainer) loss(ctx context.Context, b tinygpt.Batch) (float64, error) {
	tr.tape.Recycle()
	defer tr.tape.Reset()
	x, y, err := tr.Model.Inputs(b, tr.places)
	if err != nil {
		return 0, err
	}
	l, err := tr.Model.Forward(ctx, tr.tape, x, y)
	if err != nil {
		return 0, err
	}
	return train.Item(ctx, l)
}
