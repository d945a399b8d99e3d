package train

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/mesh"
)

// Persist is the flags of a run that trains on a user's token file and
// saves and resumes checkpoints (the examples' -data, -val, -val-batches,
// -checkpoint, -save-every, -resume, -async-save and -keep): Register
// defines them, Validate checks them before any rank starts, Prepare finds
// the checkpoint to resume from, and each rank's Checkpointer loads it
// and saves the job's parts (package checkpoint) as the run goes.
type Persist struct {
	// Data is -data: a token file (OpenTokens: text as bytes, nanoGPT's
	// uint16 .bin, llm.c's), empty for the model's own data.
	Data string
	// ValFrac is -val: the fraction of Data's windows held out for the
	// validation loss.
	ValFrac float64
	// ValBatches is -val-batches: the global batches of the validation
	// loss.
	ValBatches int
	// Dir is -checkpoint: the folder of the checkpoints, empty for none.
	Dir string
	// SaveEvery is -save-every: save after every SaveEvery-th step (0:
	// only after the last).
	SaveEvery int
	// Resume is -resume: go on from Dir's latest complete checkpoint.
	Resume bool
	// Async is -async-save: save in the background (checkpoint.Saver).
	Async bool
	// Keep is -keep: keep the newest Keep checkpoints (0: all).
	Keep int

	// latest is the checkpoint Prepare found, step its step.
	latest string
	step   int
}

// Register defines the flags on fs, storing their values in p.
func (p *Persist) Register(fs *flag.FlagSet) {
	fs.StringVar(&p.Data, "data", "", "train on this token file: text (one token a byte), nanoGPT's uint16 .bin or llm.c's .bin")
	fs.Float64Var(&p.ValFrac, "val", 0.1, "with -data: the fraction of the file held out for the validation loss")
	fs.IntVar(&p.ValBatches, "val-batches", 4, "with -data: global batches of the validation loss (printed with the training loss)")
	fs.StringVar(&p.Dir, "checkpoint", "", "save checkpoints in this folder (after the last step, and every -save-every steps)")
	fs.IntVar(&p.SaveEvery, "save-every", 0, "with -checkpoint: save after every N-th step too")
	fs.BoolVar(&p.Resume, "resume", false, "with -checkpoint: go on from its latest complete checkpoint, on the layout and device the flags give now")
	fs.BoolVar(&p.Async, "async-save", false, "with -checkpoint: write checkpoints in the background while training goes on")
	fs.IntVar(&p.Keep, "keep", 0, "with -checkpoint: keep the newest K checkpoints (0: all)")
}

// Validate reports every problem of the flags at once, each wrapping
// ErrInvalid: negative counts, a validation fraction outside (0, 1), and
// checkpoint flags without -checkpoint.
func (p Persist) Validate() error {
	var errs []error
	if p.Data != "" && (p.ValFrac <= 0 || p.ValFrac >= 1) {
		errs = append(errs, fmt.Errorf("%w: -val %v; want a fraction in (0, 1)", ErrInvalid, p.ValFrac))
	}
	for _, c := range []struct {
		name string
		n    int
	}{{"-save-every", p.SaveEvery}, {"-keep", p.Keep}} {
		if err := numcheck.NonNegativeCount(ErrInvalid, c.name, c.n); err != nil {
			errs = append(errs, err)
		}
	}
	if err := numcheck.Count(ErrInvalid, "-val-batches", p.ValBatches); err != nil {
		errs = append(errs, err)
	}
	if p.Dir == "" && (p.SaveEvery > 0 || p.Resume || p.Async || p.Keep > 0) {
		errs = append(errs, fmt.Errorf("%w: -save-every, -resume, -async-save and -keep need -checkpoint DIR", ErrInvalid))
	}
	return errors.Join(errs...)
}

// Prepare finds, with -resume, the latest complete checkpoint of Dir and
// returns its step, from which the run goes on (0 without -resume), for a
// run of total steps in all. No checkpoint there, or one at step total or
// later (nothing left to train), is an error wrapping ErrInvalid that
// names the folder or the steps; nothing is written.
func (p *Persist) Prepare(total int) (int, error) {
	if !p.Resume {
		return 0, nil
	}
	dir, err := checkpoint.Latest(p.Dir)
	if err != nil {
		return 0, fmt.Errorf("%w: -resume: no checkpoint to resume from in %s (%w); run without -resume to start one", ErrInvalid, p.Dir, err)
	}
	step, err := checkpoint.StepOf(dir)
	if err != nil {
		return 0, fmt.Errorf("train: -resume: %w", err)
	}
	if step >= total {
		return 0, fmt.Errorf("%w: -resume: the latest checkpoint is at step %d and -steps is %d (the run's total): nothing left to train", ErrInvalid, step, total)
	}
	p.latest, p.step = dir, step
	return step, nil
}

// From is the checkpoint Prepare found for -resume ("" without).
func (p Persist) From() string { return p.latest }

// Windows opens -data for a model of vocab tokens and sequence length T
// on mesh m and splits it: the training windows and the held-out
// validation windows (-val). Close the file when done. Without -data it
// returns nils.
func (p Persist) Windows(vocab, T int, m *mesh.Mesh) (training, validation *Windows, file *TokenFile, err error) {
	if p.Data == "" {
		return nil, nil, nil, nil
	}
	f, err := OpenTokens(p.Data, vocab)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("-data: %w", err)
	}
	w, err := NewWindows(f, T, m)
	if err == nil {
		training, validation, err = w.Split(p.ValFrac)
	}
	if err != nil {
		return nil, nil, nil, errors.Join(fmt.Errorf("-data %s: %w", p.Data, err), f.Close())
	}
	return training, validation, f, nil
}

// Checkpointer saves one rank's parts of the job as Persist says; every
// rank makes one and calls its methods at the same steps.
type Checkpointer struct {
	p      Persist
	parts  checkpoint.Parts
	saver  *checkpoint.Saver
	saved  int // the step of the last save
	count  int
	blocks []time.Duration
	peak   int64
	last   string
	note   string // what Note says
}

// Checkpointer returns this rank's Checkpointer of parts and, with
// -resume, loads the checkpoint Prepare found into them
// (checkpoint.LoadJob, on the layout and device the parts have now). A
// checkpoint of another model, or of another layout that cannot hold it,
// is refused before anything is written into the parts. Without
// -checkpoint it does nothing.
func (p *Persist) Checkpointer(ctx context.Context, parts checkpoint.Parts) (*Checkpointer, error) {
	c := &Checkpointer{p: *p, parts: parts, saved: -1}
	if p.Dir == "" {
		return c, nil
	}
	if p.Resume {
		step, user, err := checkpoint.LoadJob(ctx, p.latest, parts)
		if err != nil {
			return nil, fmt.Errorf("-resume from %s: %w", p.latest, err)
		}
		c.saved = step
		if was, _ := user["data"].(string); was != p.Data {
			c.note = fmt.Sprintf("note: the checkpoint was trained on %s, this run trains on %s, from the checkpoint's position in its data", dataName(was), dataName(p.Data))
		}
	}
	if p.Async {
		s, err := checkpoint.NewSaver(p.Dir, c.options()...)
		if err != nil {
			return nil, err
		}
		c.saver = s
	}
	return c, nil
}

// dataName describes a -data value.
func dataName(path string) string {
	if path == "" {
		return "the model's own data (no -data)"
	}
	return "-data " + path
}

// Note is a line to show the user about the resumed checkpoint (it was
// trained on another -data file), or "".
func (c *Checkpointer) Note() string { return c.note }

func (c *Checkpointer) options() []checkpoint.Option {
	return []checkpoint.Option{checkpoint.WithKeep(c.p.Keep)}
}

// After saves after step (the steps taken so far) when -save-every says
// so.
func (c *Checkpointer) After(ctx context.Context, step int) error {
	if c.p.Dir == "" || c.p.SaveEvery == 0 || step%c.p.SaveEvery != 0 {
		return nil
	}
	return c.save(ctx, step)
}

// Finish saves after the last step (unless After just did) and waits for
// a background save; it returns the save's error.
func (c *Checkpointer) Finish(ctx context.Context, step int) error {
	if c.p.Dir == "" {
		return nil
	}
	if step != c.saved {
		if err := c.save(ctx, step); err != nil {
			return err
		}
	}
	if c.saver != nil {
		return c.saver.Close()
	}
	return nil
}

func (c *Checkpointer) save(ctx context.Context, step int) error {
	// The data file, so that a resumed run can say when it differs.
	st, err := checkpoint.JobState(step, c.parts, map[string]any{"data": c.p.Data})
	if err != nil {
		return err
	}
	t0 := time.Now()
	if c.saver != nil {
		a, err := c.saver.Save(ctx, st, checkpoint.WithStep(step))
		if err != nil {
			return err
		}
		c.blocks = append(c.blocks, a.Blocked())
		c.peak = max(c.peak, a.PeakBytes())
		c.last = fmt.Sprintf("%s/step-%010d", c.p.Dir, step)
	} else {
		dir, err := checkpoint.Save(ctx, c.p.Dir, st, append(c.options(), checkpoint.WithStep(step))...)
		if err != nil {
			return err
		}
		c.blocks = append(c.blocks, time.Since(t0))
		c.last = dir
	}
	c.saved = step
	c.count++
	return nil
}

// Report writes one line about the saves: how many, the last folder, the
// median time training was blocked per save and, for background saves,
// the peak of the snapshot's host memory. Nothing without -checkpoint.
func (c *Checkpointer) Report(w io.Writer) {
	if c.p.Dir == "" || c.count == 0 {
		return
	}
	how := "saving"
	if c.saver != nil {
		how = fmt.Sprintf("snapshotting (background save; peak host memory %.2f MiB)", float64(c.peak)/(1<<20))
	}
	fmt.Fprintf(w, "checkpoints: %d saved, the last %s; training blocked a median %v per save, %s\n",
		c.count, c.last, median(c.blocks).Round(time.Microsecond), how)
}

// median is the median of ds (0 for none).
func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(ds))
	return s[len(s)/2]
}
