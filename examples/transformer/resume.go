package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/train"
)

// Training on a user's file, checkpoints and resuming (train.Persist's
// flags): -data FILE trains on FILE's tokens with -val of it held out
// for a validation loss printed with the training loss; -checkpoint DIR
// saves the job's state there after the last step and every -save-every
// steps (-async-save in the background, -keep K the newest K); -resume
// goes on from DIR's latest complete checkpoint on the layout and device
// the flags give now, so -steps is the run's total: a run saved at step
// 100 and resumed with -steps 200 trains steps 101 to 200.

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
// o's run to the steps left: it returns the step the run starts after.
func prepareResume(o *options) (int, error) {
	start, err := o.persist.Prepare(o.loop.Steps)
	if err != nil {
		return 0, err
	}
	o.loop.Steps -= start
	return start, nil
}

// resumeLine says, with -resume, which checkpoint the run goes on from.
func resumeLine(out io.Writer, o options) {
	if o.start > 0 {
		fmt.Fprintf(out, "resuming from %s: steps %d to %d\n", o.persist.From(), o.start+1, o.start+o.loop.Steps)
	}
}

// dataOptions opens -data on m (nil options without it) and returns the
// trainer's options for it with the rank's persisted state (its
// validation windows).
func dataOptions(o options, m *mesh.Mesh, out io.Writer) ([]gpt.TrainOption, *persisted, error) {
	p := &persisted{every: o.loop.Every, valN: o.persist.ValBatches, last: o.start + o.loop.Steps, out: out}
	tw, vw, f, err := o.persist.Windows(o.cfg.Vocab, o.cfg.SeqLen, m)
	if err != nil || tw == nil {
		return nil, p, err
	}
	p.val, p.file = vw, f
	return []gpt.TrainOption{gpt.WithWindows(tw)}, p, nil
}

// load makes the rank's Checkpointer, loading -resume's checkpoint into
// tr.
func (p *persisted) load(ctx context.Context, o *options, tr *gpt.Trainer) error {
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
func (p *persisted) after(ctx context.Context, tr *gpt.Trainer, loss float64) error {
	step := tr.Steps()
	if p.val != nil && (step%p.every == 0 || step == p.last) {
		vl, err := tr.ValLoss(ctx, p.val, p.valN)
		if err != nil {
			return err
		}
		fmt.Fprintf(p.out, "step %4d  validation loss %.6f (training loss %.6f)\n", step, vl, loss)
	}
	return p.ck.After(ctx, step)
}

// finish saves after the last step, waits for a background save and
// reports the saves.
func (p *persisted) finish(ctx context.Context, tr *gpt.Trainer) error {
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
