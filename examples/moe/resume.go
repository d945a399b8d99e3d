package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/train"
)

// Training on a user's file, checkpoints and resuming (train.Persist's
// flags), as in examples/transformer: -data FILE with -val of it held out
// for a validation loss; -checkpoint DIR, -save-every N, -async-save,
// -keep K; -resume goes on from DIR's latest complete checkpoint on the
// layout the flags give now (ep=2 → ep=4: the experts load by their
// global index), -steps being the run's total.

// persisted is one rank's part in -data and -checkpoint.
type persisted struct {
	ck    *train.Checkpointer
	val   *train.Windows
	file  *train.TokenFile
	every int
	valN  int       // -val-batches
	last  int       // the run's last step
	out   io.Writer // world rank 0's, else io.Discard
}

// prepareResume finds the checkpoint -resume goes on from and shortens
// o's run to the steps left.
func prepareResume(o *options) error {
	start, err := o.persist.Prepare(o.loop.Steps)
	if err != nil {
		return err
	}
	o.start, o.loop.Steps = start, o.loop.Steps-start
	return nil
}

// dataOptions opens -data on m (no options without it) and returns the
// trainer's options for it with the rank's persisted state.
func dataOptions(o options, cfg moegpt.Config, m *mesh.Mesh, out io.Writer) ([]moegpt.TrainOption, *persisted, error) {
	p := &persisted{every: o.loop.Every, valN: o.persist.ValBatches, last: o.start + o.loop.Steps, out: out}
	tw, vw, f, err := o.persist.Windows(cfg.V, cfg.T, m)
	if err != nil || tw == nil {
		return nil, p, err
	}
	p.val, p.file = vw, f
	return []moegpt.TrainOption{moegpt.WithWindows(tw)}, p, nil
}

// load makes the rank's Checkpointer, loading -resume's checkpoint into
// tr.
func (p *persisted) load(ctx context.Context, o *options, tr *moegpt.Trainer) error {
	ck, err := o.persist.Checkpointer(ctx, tr.Parts())
	if err != nil {
		return errors.Join(err, p.close())
	}
	p.ck = ck
	if n := ck.Note(); n != "" {
		fmt.Fprintln(p.out, n)
	}
	return nil
}

// after runs after each step: the validation loss every -every steps and
// after the last, and -save-every's saves.
func (p *persisted) after(ctx context.Context, tr *moegpt.Trainer) error {
	step := tr.Steps()
	if p.val != nil && (step%p.every == 0 || step == p.last) {
		vl, err := tr.ValLoss(ctx, p.val, p.valN)
		if err != nil {
			return err
		}
		fmt.Fprintf(p.out, "step %4d  validation loss %.6f\n", step, vl)
	}
	return p.ck.After(ctx, step)
}

// finish saves after the last step, waits for a background save and
// reports the saves.
func (p *persisted) finish(ctx context.Context, tr *moegpt.Trainer) error {
	err := p.ck.Finish(ctx, tr.Steps())
	p.ck.Report(p.out)
	return errors.Join(err, p.close())
}

func (p *persisted) close() error {
	if p.file == nil {
		return nil
	}
	return p.file.Close()
}
