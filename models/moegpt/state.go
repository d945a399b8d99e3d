package moegpt

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/models/internal/batches"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// WithWindows trains on a user's token file instead of the tiny GPT's
// corpus: step s's global batch is the next B windows of w (train.Windows,
// whose T must be the model's sequence length) in the order of a
// train.Sampler with opts (train.WithShuffle), every rank reading the
// global batch and keeping its rows, so any layout trains on the batches
// one rank would. Measure a validation split with ValLoss.
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
// "model", the parameters by name, the experts' as the global [E, …]
// tensors sharded over the expert-parallel axis, so that a checkpoint
// saved with ep=2 loads with ep=4 (each rank reading its experts by
// global index); "optim", AdamW's moments (with the parameters'
// placements), step counts and hyper-parameters; "data", the batches'
// position. Give them to checkpoint.JobState with Steps() to save and to
// checkpoint.LoadJob to resume.
func (tr *Trainer) Parts() checkpoint.Parts {
	return checkpoint.Parts{"model": modelPart{tr.Model}, "optim": tr.opt, "data": batches.NewPart(tr.sampler, "moegpt", ErrConfig)}
}

// modelPart is a Model's parameters as a checkpoint part.
type modelPart struct{ md *Model }

// StateDict implements checkpoint.Stateful: the parameters under their
// names.
func (m modelPart) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	ts := make(map[string]*placement.DTensor, len(m.md.params))
	for _, p := range m.md.params {
		ts[prefix+p.Name()] = p.Data()
	}
	return ts, map[string]any{}, nil
}

// LoadStateDict implements checkpoint.Stateful: the parameters are all
// the model's state.
func (modelPart) LoadStateDict(string, map[string]any) error { return nil }

// ValLoss is the mean cross-entropy over the first n global batches
// (n ≥ 1) of w in order (a validation split: the same batches at every
// call), with no backward and no update. It is collective over the mesh
// like Step.
func (tr *Trainer) ValLoss(ctx context.Context, w *train.Windows, n int) (float64, error) {
	if err := numcheck.Count(ErrConfig, "ValLoss: validation batches", n); err != nil {
		return 0, err
	}
	if w == nil || w.T() != tr.Model.cfg.T {
		return 0, fmt.Errorf("%w: ValLoss: windows %v for a model of sequence length %d", ErrConfig, w, tr.Model.cfg.T)
	}
	src, err := batches.Windows(w, tr.batch)
	if err != nil {
		return 0, fmt.Errorf("moegpt: ValLoss: %w", err)
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
		return 0, fmt.Errorf("moegpt: ValLoss: batch %d: %w", i+1, err)
	}
	return sum / float64(n), nil
}

// loss is the global cross-entropy of batch b, forward only: the ops it
// records are dropped after.
func (tr *Trainer) loss(ctx context.Context, b tinygpt.Batch) (float64, error) {
	tape := tr.Model.tape
	tape.Recycle()
	defer tape.Reset()
	x, y, err := tr.Model.Inputs(b)
	if err != nil {
		return 0, err
	}
	out, err := tr.Model.Forward(ctx, x, y)
	if err != nil {
		return 0, err
	}
	return train.Item(ctx, out.CE)
}
