package gpt

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TrainOptions says how a Trainer lays the model out.
type TrainOptions struct {
	// DP and TP name the data- and tensor-parallel mesh axes; an empty name
	// means that kind of parallelism is off. A name the mesh lacks is an
	// error (a misspelt axis would otherwise silently replicate the work),
	// and so is one axis named twice.
	DP, TP string
	// SP turns on sequence parallelism on the TP axis.
	SP bool
	// DDP are extra DDP options (bucket sizes); the dp axis is set from DP.
	DDP []parallel.Option
	// Tape are options for the model's tape (a BLAS, an observer).
	Tape []autograd.Option
}

// Trainer trains the tiny GPT of reference/TINY_GPT.md on a (dp × tp) mesh: the batch
// rows are sharded over dp, the model over tp by Plan, data-parallel
// gradients are all-reduced by DDP while backward runs, and AdamW updates
// each rank's shards. Every rank draws the same global batches (§2.3) and
// keeps its rows, so any layout trains on exactly the batches one rank
// would.
type Trainer struct {
	Model   *Model
	tape    *autograd.Tape
	opt     *optim.AdamW
	ddp     *parallel.DDP
	sampler *tinygpt.Sampler
	places  []placement.Placement
}

// NewTrainer builds the model from init on m, parallelizes it as opts say,
// and prepares DDP and AdamW (cfg's hyper-parameters). It is collective
// over m. A tensor-parallel axis of size 1 leaves the model replicated: the
// plan would only add no-op redistributions and the slower vocab-parallel
// cross-entropy.
func NewTrainer(ctx context.Context, m *mesh.Mesh, cfg tinygpt.Config, init map[string][]float32, opts TrainOptions) (*Trainer, error) {
	// Step ends each step's values before the next forward pass, so the
	// tape may reuse their memory.
	tape := autograd.NewTape(append([]autograd.Option{autograd.WithRecycling()}, opts.Tape...)...)
	md, err := New(tape, m, cfg, init)
	if err != nil {
		return nil, err
	}
	names := m.Names()
	for _, ax := range []string{opts.DP, opts.TP} {
		if ax != "" && !slices.Contains(names, ax) {
			return nil, fmt.Errorf("gpt: trainer: the mesh has no axis %q (its axes are %v)", ax, names)
		}
	}
	if opts.DP != "" && opts.DP == opts.TP {
		return nil, fmt.Errorf("gpt: trainer: axis %q named for both data and tensor parallelism", opts.DP)
	}
	// The layouts Forward needs: whole heads per tensor-parallel rank (the
	// [B, T, D] -> [B, T, H, Dh] split of a sharded D), and whole batch
	// rows per data-parallel rank (the [B, T] -> [B·T] merge of a sharded B).
	if i := slices.Index(names, opts.TP); i >= 0 && cfg.H%m.Shape()[i] != 0 {
		return nil, fmt.Errorf("gpt: trainer: %d heads do not split over %d tensor-parallel ranks", cfg.H, m.Shape()[i])
	}
	if i := slices.Index(names, opts.DP); i >= 0 && cfg.B%m.Shape()[i] != 0 {
		return nil, fmt.Errorf("gpt: trainer: a batch of %d rows does not split over %d data-parallel ranks", cfg.B, m.Shape()[i])
	}
	tr := &Trainer{Model: md, tape: tape, places: make([]placement.Placement, m.NDim())}
	for i := range tr.places {
		tr.places[i] = placement.Replicate()
	}
	if i := slices.Index(names, opts.TP); i >= 0 && m.Shape()[i] > 1 {
		if err := parallel.Parallelize(ctx, md, opts.TP, Plan(opts.SP)); err != nil {
			return nil, fmt.Errorf("gpt: trainer: %w", err)
		}
	} else if opts.TP == "" && opts.SP {
		return nil, fmt.Errorf("gpt: trainer: sequence parallelism needs a tensor-parallel axis (TP is empty)")
	}
	if i := slices.Index(names, opts.DP); opts.DP != "" && i >= 0 {
		tr.places[i] = placement.Shard(0)
		if m.Shape()[i] > 1 {
			ddpOpts := append(slices.Clone(opts.DDP), parallel.WithAxis(opts.DP), parallel.GradientAsBucketView())
			if tr.ddp, err = parallel.New(ctx, md.Params(), ddpOpts...); err != nil {
				return nil, fmt.Errorf("gpt: trainer: %w", err)
			}
		}
	}
	if tr.opt, err = optim.NewAdamW(md.Params(), cfg.LR, cfg.WD, cfg.Beta1, cfg.Beta2, cfg.Eps); err != nil {
		return nil, fmt.Errorf("gpt: trainer: %w", err)
	}
	if tr.sampler, err = tinygpt.NewSampler(cfg, tinygpt.Corpus(cfg)); err != nil {
		return nil, fmt.Errorf("gpt: trainer: %w", err)
	}
	return tr, nil
}

// Step runs one training step on the next batch: forward, backward (with
// the dp all-reduces overlapping it), the remaining gradient reductions,
// AdamW, and ZeroGrad. It returns the batch's step number (from 1) and its
// global loss, computed before the update.
//
// On an error the step's recorded ops and gradients are dropped, so the
// next Step starts clean (on the next batch); an error from a collective
// usually means the communicator is unusable, though, and every rank must
// see the same errors to stay in step.
func (tr *Trainer) Step(ctx context.Context) (step int, loss float64, err error) {
	b := tr.sampler.Next()
	tr.tape.Recycle() // the previous step's values are dead
	if loss, err = tr.step(ctx, b); err != nil {
		tr.tape.Reset()
		tr.Model.ZeroGrad()
		return b.Step, loss, fmt.Errorf("gpt: step %d: %w", b.Step, err)
	}
	return b.Step, loss, nil
}

func (tr *Trainer) step(ctx context.Context, b tinygpt.Batch) (float64, error) {
	x, y, err := tr.Model.Inputs(b, tr.places)
	if err != nil {
		return 0, err
	}
	l, err := tr.Model.Forward(ctx, tr.tape, x, y)
	if err != nil {
		return 0, err
	}
	if err := tr.tape.Backward(ctx, l); err != nil {
		if tr.ddp != nil {
			if derr := tr.ddp.Discard(ctx); derr != nil {
				err = fmt.Errorf("%w (and DDP's discard of the step: %v)", err, derr)
			}
		}
		return 0, err
	}
	if tr.ddp != nil {
		if err := tr.ddp.Finish(ctx); err != nil {
			return 0, err
		}
	}
	params := tr.Model.Params()
	if err := parallel.ReduceGrads(ctx, params); err != nil {
		return 0, err
	}
	// The loss is Partial(sum) over the batch-sharding axis: the one
	// collective of the step that is only for reporting.
	full, err := l.Data().Full(ctx)
	if err != nil {
		return 0, fmt.Errorf("loss: %w", err)
	}
	var loss float64
	switch d := full.(type) {
	case []float32:
		loss = float64(d[0])
	default:
		return 0, fmt.Errorf("loss: unexpected data %T", d)
	}
	if err := tr.opt.Step(); err != nil {
		return loss, err
	}
	tr.Model.ZeroGrad()
	return loss, nil
}

// Full gathers every parameter's global value, in param_order (collective
// over the mesh).
func (tr *Trainer) Full(ctx context.Context) (map[string][]float32, error) {
	out := map[string][]float32{}
	for _, p := range tr.Model.Params() {
		f, err := p.Data().Full(ctx)
		if err != nil {
			return nil, fmt.Errorf("gpt: gather %q: %w", p.Name(), err)
		}
		out[p.Name()] = slices.Clone(f.([]float32))
	}
	return out, nil
}
