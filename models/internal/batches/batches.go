// Package batches is where the models' trainers take their global
// batches from: the tiny GPT's corpus, random tokens, or a user's token
// file (train.Windows), each able to seek to a step so that a run resumed
// from a checkpoint draws the batches the uninterrupted run would.
package batches

import (
	"fmt"

	"github.com/b7ea7098/loom/models/internal/randtok"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// Source gives step after step of global batches, the same on every
// rank (each keeps its rows).
type Source interface {
	// Next returns the next step's global batch; its Step counts from 1.
	Next() (tinygpt.Batch, error)
	// Seek moves the source so that Next gives step+1's batch (step ≥ 0
	// batches drawn).
	Seek(step int) error
	// Step is the number of batches drawn (or sought to).
	Step() int
}

// Corpus returns the tiny GPT's sampler over its corpus (cfg's seeds,
// batch and sequence length).
func Corpus(cfg tinygpt.Config) (Source, error) {
	s, err := tinygpt.NewSampler(cfg, tinygpt.Corpus(cfg))
	if err != nil {
		return nil, err
	}
	return &corpus{cfg: cfg, s: s}, nil
}

type corpus struct {
	cfg tinygpt.Config
	s   *tinygpt.Sampler
}

func (c *corpus) Next() (tinygpt.Batch, error) { return c.s.Next(), nil }
func (c *corpus) Step() int                    { return c.s.Step() }

// Seek replays the sampler's stream from the start (B draws a step, no
// tokens built), since each step's offsets come from one LCG.
func (c *corpus) Seek(step int) error {
	if step < 0 {
		return fmt.Errorf("batches: seek to step %d", step)
	}
	s, err := tinygpt.NewSampler(c.cfg, tinygpt.Corpus(c.cfg))
	if err != nil {
		return err
	}
	for s.Step() < step {
		s.NextOffsets()
	}
	c.s = s
	return nil
}

// Random returns randtok's batches of b rows of t tokens below v.
func Random(seed uint64, b, t, v int) Source { return random{randtok.New(seed, b, t, v)} }

type random struct{ *randtok.Sampler }

func (r random) Next() (tinygpt.Batch, error) { return r.Sampler.Next(), nil }

// Choice is what a trainer's data options select: Windows (WithWindows:
// a user's token file and its sampler options), else with Random set
// random tokens from Seed, else the reference's corpus.
type Choice struct {
	Windows *train.Windows
	Opts    []train.SamplerOption
	File    bool // WithWindows was given (Windows may still be nil: refused)
	Random  bool
	Seed    uint64
}

// Select returns the batches c chooses for data (the model's batch,
// sequence length and vocabulary). A nil token file or one whose windows
// are not data.T tokens long is refused with an error wrapping invalid
// (the model package's ErrConfig).
func Select(data tinygpt.Config, c Choice, invalid error) (Source, error) {
	switch {
	case c.File:
		if c.Windows == nil {
			return nil, fmt.Errorf("%w: WithWindows: nil windows", invalid)
		}
		if c.Windows.T() != data.T {
			return nil, fmt.Errorf("%w: WithWindows: windows of %d tokens for a model of sequence length %d", invalid, c.Windows.T(), data.T)
		}
		return Windows(c.Windows, data.B, c.Opts...)
	case c.Random:
		return Random(c.Seed, data.B, data.T, data.V), nil
	}
	return Corpus(data)
}

// Windows returns the global batches of b windows of w (a user's token
// file), drawn by a train.Sampler over the whole global batch (rank 0 of
// 1: every rank reads the global batch and keeps its rows), with opts
// (train.WithShuffle).
func Windows(w *train.Windows, b int, opts ...train.SamplerOption) (Source, error) {
	s, err := train.NewSampler(w.Len(), b, 0, 1, opts...)
	if err != nil {
		return nil, err
	}
	return &windows{w: w, s: s}, nil
}

type windows struct {
	w    *train.Windows
	s    *train.Sampler
	step int
}

func (w *windows) Next() (tinygpt.Batch, error) {
	rows := w.s.Next().Global
	x, y, err := w.w.Rows(rows)
	if err != nil {
		return tinygpt.Batch{}, err
	}
	w.step++
	return tinygpt.Batch{Step: w.step, B: len(rows), T: w.w.T(), Offsets: rows, X: x, Y: y}, nil
}

func (w *windows) Step() int { return w.step }

// Seek restores the sampler's position after step batches: its epochs are
// whole numbers of batches, so the position follows from the count.
func (w *windows) Seek(step int) error {
	if step < 0 {
		return fmt.Errorf("batches: seek to step %d", step)
	}
	n := w.s.BatchesPerEpoch()
	if err := w.s.Restore(train.SamplerState{Epoch: step / n, Index: step % n}); err != nil {
		return err
	}
	w.step = step
	return nil
}

// Part is a Source's position as a checkpoint part (it implements
// checkpoint.Stateful), so that a resumed trainer draws the batches the
// uninterrupted run would have drawn next.
type Part struct {
	src     Source
	name    string // the model package, for errors
	invalid error  // its invalid-argument sentinel
}

// NewPart returns src's position as a checkpoint part; errors name the
// model package name and wrap invalid where an entry is bad.
func NewPart(src Source, name string, invalid error) Part {
	return Part{src: src, name: name, invalid: invalid}
}

// StateDict implements checkpoint.Stateful: the int64 entry
// prefix+"step", the batches drawn.
func (p Part) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	return map[string]*placement.DTensor{}, map[string]any{prefix + "step": int64(p.src.Step())}, nil
}

// LoadStateDict implements checkpoint.Stateful: it seeks the batches to
// the saved step.
func (p Part) LoadStateDict(prefix string, entries map[string]any) error {
	v, ok := entries[prefix+"step"].(int64)
	if !ok || v < 0 {
		return fmt.Errorf("%w: the batch position: entry %q is %v (%T), want a step count", p.invalid, prefix+"step", entries[prefix+"step"], entries[prefix+"step"])
	}
	if err := p.src.Seek(int(v)); err != nil {
		return fmt.Errorf("%s: the batch position: %w", p.name, err)
	}
	return nil
}
