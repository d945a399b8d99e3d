package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/train"
)

// A pipelined run takes -data, -checkpoint, -save-every, -resume,
// -async-save and -keep as the other layouts do: every rank draws the
// global batches (-data's training windows, the reference's corpus, or
// random tokens from -seed) and saves its stages' parameters, AdamW's
// state and the batches' position under the model's names
// (gpt.PipelineParts), so a checkpoint resumes on another -pp, schedule
// or -stages-per-rank, and on the other layouts. The held-out split of
// -data is not evaluated on a pipeline (no validation loss is printed).

// pipePersist is a pipelined rank's part in -data and -checkpoint.
type pipePersist struct {
	ck   *train.Checkpointer
	file *train.TokenFile // -data's, closed by finish
	out  io.Writer        // world rank 0's, else io.Discard
}

// pipeData returns the global batches a pipelined rank draws, on m, and
// its persisted state.
func pipeData(o options, m *mesh.Mesh, out io.Writer) (*gpt.BatchSource, *pipePersist, error) {
	p := &pipePersist{out: out}
	if m.Rank() != 0 {
		p.out = io.Discard // world rank 0 reports for the job
	}
	tw, _, f, err := o.persist.Windows(o.cfg.Vocab, o.cfg.SeqLen, m)
	if err != nil {
		return nil, nil, err
	}
	p.file = f
	opts := []gpt.TrainOption{gpt.WithRun(o.run)}
	switch {
	case tw != nil:
		opts = append(opts, gpt.WithWindows(tw))
	case !o.fixture:
		opts = append(opts, gpt.WithRandomTokens(o.seed))
	}
	src, err := gpt.NewBatchSource(o.cfg, opts...)
	if err != nil {
		return nil, nil, errors.Join(err, p.close())
	}
	return src, p, nil
}

// load makes the rank's Checkpointer of its stages, AdamW and batches,
// loading -resume's checkpoint into them.
func (p *pipePersist) load(ctx context.Context, o *options, stages []*gpt.Stage, opt *optim.AdamW, data *gpt.BatchSource) error {
	parts, err := gpt.PipelineParts(stages, opt, data)
	if err == nil {
		p.ck, err = o.persist.Checkpointer(ctx, parts)
	}
	if err != nil {
		return errors.Join(err, p.close())
	}
	if n := p.ck.Note(); n != "" {
		fmt.Fprintln(p.out, n)
	}
	return nil
}

// finish saves after the last step (step, the batches drawn) unless
// -save-every just did, waits for a background save, and reports the
// saves.
func (p *pipePersist) finish(ctx context.Context, step int) error {
	err := p.ck.Finish(ctx, step)
	p.ck.Report(p.out)
	return errors.Join(err, p.close())
}

func (p *pipePersist) close() error {
	if p.file == nil {
		return nil
	}
	err := p.file.Close()
	p.file = nil
	return err
}
