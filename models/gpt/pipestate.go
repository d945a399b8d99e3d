package gpt

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/models/internal/batches"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// BatchSource is the global batches a Trainer draws (the reference's
// corpus, WithRandomTokens's or WithWindows's), for a training loop of
// one's own: each rank of a pipeline draws them to feed its stages. Its
// position is a checkpoint part, the same as a Trainer's, so a pipelined
// run resumes a Trainer's checkpoint and the other way round.
type BatchSource struct{ src batches.Source }

// NewBatchSource returns the batches a Trainer for cfg with opts draws:
// WithRun, WithRandomTokens and WithWindows are read, the other options
// ignored. Errors wrap ErrConfig.
func NewBatchSource(cfg Config, opts ...TrainOption) (*BatchSource, error) {
	tc := trainConfig{run: tinygpt.Default()}
	for _, o := range opts {
		if o == nil {
			return nil, fmt.Errorf("%w: NewBatchSource: nil option", ErrConfig)
		}
		o(&tc)
	}
	data := cfg.reference(tc.run)
	data.Steps = max(data.Steps, 1) // the caller counts the steps
	if err := data.Validate(); err != nil {
		return nil, fmt.Errorf("%w: NewBatchSource: %w", ErrConfig, err)
	}
	src, err := tc.source(data)
	if err != nil {
		return nil, fmt.Errorf("gpt: NewBatchSource: %w", err)
	}
	return &BatchSource{src: src}, nil
}

// Next returns the next global batch (its Step counts from 1). Errors
// are the token file's.
func (b *BatchSource) Next() (tinygpt.Batch, error) { return b.src.Next() }

// Steps is the number of batches drawn, or resumed from.
func (b *BatchSource) Steps() int { return b.src.Step() }

// Part returns the position as a checkpoint part: the int64 entry
// "step" under its prefix, as Trainer.Parts's "data" part saves it.
func (b *BatchSource) Part() checkpoint.Stateful { return batches.NewPart(b.src, "gpt", ErrConfig) }

// PartsOption configures PipelineParts.
type PartsOption func(*partsConfig)

type partsConfig struct{ tied bool }

// WithTiedHead says the LM head is tied to the token embedding: the last
// stage's lm_head.weight is a copy of the first stage's wte, kept equal
// (pp.SumTied sums their gradients), so it is saved once, as wte from the
// stage that holds the embedding, with its optimizer moments (which are
// equal too); a load fills the head and its moments from wte's. A rank
// that holds both (a one-stage model, or a V schedule's first rank)
// copies wte's values into the head after the load.
func WithTiedHead() PartsOption { return func(c *partsConfig) { c.tied = true } }

// PipelineParts returns a pipelined rank's state for package checkpoint,
// under the prefixes of Trainer.Parts: "model", the parameters of stages
// (the rank's stages, any number) under the Model's names; "optim", opt's
// state (an optimizer over exactly those parameters, optim.AdamW; nil
// leaves the part out); "data", data's position (nil leaves it out). The
// storage is by the Model's names, whatever stage holds a parameter, so a
// checkpoint loads into a pipeline of any split (another pp, schedule or
// stages per rank) and into a Trainer on any layout, and back. The
// rank's step count and the pp rank are not part of it: every rank saves
// with checkpoint.JobState and loads with checkpoint.LoadJob, which
// return the job's step. Errors wrap ErrConfig: no stage, a nil stage.
func PipelineParts(stages []*Stage, opt checkpoint.Stateful, data *BatchSource, opts ...PartsOption) (checkpoint.Parts, error) {
	var pc partsConfig
	for _, o := range opts {
		if o == nil {
			return nil, fmt.Errorf("%w: PipelineParts: nil option", ErrConfig)
		}
		o(&pc)
	}
	if len(stages) == 0 || slices.Contains(stages, nil) {
		return nil, fmt.Errorf("%w: PipelineParts: %d stages, or a nil one", ErrConfig, len(stages))
	}
	var model checkpoint.Stateful = stagesPart(stages)
	if pc.tied {
		model = tiedPart{model}
	}
	parts := checkpoint.Parts{"model": model}
	if opt != nil {
		if pc.tied {
			opt = tiedPart{opt}
		}
		parts["optim"] = opt
	}
	if data != nil {
		parts["data"] = data.Part()
	}
	return parts, nil
}

// stagesPart is the parameters of a rank's stages, by the Model's names.
type stagesPart []*Stage

// StateDict implements checkpoint.Stateful.
func (sp stagesPart) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	ts, es := map[string]*placement.DTensor{}, map[string]any{}
	for _, s := range sp {
		t, e, err := checkpoint.Module(s).StateDict(prefix)
		if err != nil {
			return nil, nil, fmt.Errorf("gpt: stage [%d, %d): %w", s.First, s.Last, err)
		}
		for n, x := range t {
			if _, dup := ts[n]; dup {
				return nil, nil, fmt.Errorf("%w: stage [%d, %d): parameter %q is held by another of the rank's stages", ErrConfig, s.First, s.Last, n)
			}
			ts[n] = x
		}
		maps.Copy(es, e)
	}
	return ts, es, nil
}

// LoadStateDict implements checkpoint.Stateful.
func (sp stagesPart) LoadStateDict(prefix string, entries map[string]any) error {
	for _, s := range sp {
		if err := checkpoint.Module(s).LoadStateDict(prefix, entries); err != nil {
			return fmt.Errorf("gpt: stage [%d, %d): %w", s.First, s.Last, err)
		}
	}
	return nil
}

// tiedPart is a part whose tensors of the LM head (the weight, and an
// optimizer's moments of it) are copies of the token embedding's: they
// are not saved, and a load fills them from the embedding's.
type tiedPart struct{ inner checkpoint.Stateful }

// headTwin returns the embedding's name for a tensor of the LM head under
// prefix (lm_head.weight… → wte…), and whether it is one.
func headTwin(prefix, name string) (string, bool) {
	rest, ok := strings.CutPrefix(name, prefix+tinygpt.ParamLMHead)
	if !ok || rest != "" && !strings.HasPrefix(rest, ".") {
		return "", false
	}
	return prefix + tinygpt.ParamWTE + rest, true
}

// StateDict implements checkpoint.Stateful: the inner part's state
// without the head's tensors.
func (tp tiedPart) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	ts, es, err := tp.inner.StateDict(prefix)
	if err != nil {
		return nil, nil, err
	}
	for n := range ts {
		if _, ok := headTwin(prefix, n); ok {
			delete(ts, n)
		}
	}
	return ts, es, nil
}

// LoadTargets implements checkpoint.LoadTargeter: the head's tensors are
// filled from the embedding's, unless this rank holds the embedding too
// (then LoadStateDict copies them).
func (tp tiedPart) LoadTargets(prefix string) (map[string]*placement.DTensor, error) {
	ts, _, err := tp.inner.StateDict(prefix)
	if err != nil {
		return nil, err
	}
	out := make(map[string]*placement.DTensor, len(ts))
	for n, t := range ts {
		twin, ok := headTwin(prefix, n)
		switch {
		case !ok:
			out[n] = t
		case ts[twin] == nil:
			out[twin] = t
		}
	}
	return out, nil
}

// LoadStateDict implements checkpoint.Stateful: the inner part's, after
// copying the embedding's loaded tensors into the head's where this rank
// holds both.
func (tp tiedPart) LoadStateDict(prefix string, entries map[string]any) error {
	ts, _, err := tp.inner.StateDict(prefix)
	if err != nil {
		return err
	}
	for _, n := range slices.Sorted(maps.Keys(ts)) {
		twin, ok := headTwin(prefix, n)
		if !ok || ts[twin] == nil {
			continue
		}
		if dst, src := ts[n].Spec(), ts[twin].Spec(); !dst.Equal(src) {
			return fmt.Errorf("%w: tied head: %q is laid out as %v and %q as %v: a rank holding both copies of a tied weight needs them alike", ErrConfig, n, dst, twin, src)
		}
		if err := copyLocal(ts[n], ts[twin]); err != nil {
			return fmt.Errorf("gpt: tied head: %q from %q: %w", n, twin, err)
		}
	}
	return tp.inner.LoadStateDict(prefix, entries)
}

// copyLocal copies src's local block into dst's, on dst's device; both
// are laid out alike.
func copyLocal(dst, src *placement.DTensor) error {
	h, err := src.To(nil)
	if err != nil {
		return err
	}
	switch d := dst.LocalData().(type) {
	case []float32:
		copy(d, h.LocalData().([]float32))
	case []float64:
		copy(d, h.LocalData().([]float64))
	case device.Buffer:
		return dst.Device().CopyFromHost(d, h.LocalBuffer().(*comm.HostBuffer))
	default:
		return fmt.Errorf("local block of type %T", d)
	}
	return nil
}
