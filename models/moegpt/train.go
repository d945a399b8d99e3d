package moegpt

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/internal/batches"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// TrainOption configures NewTrainer.
type TrainOption func(*trainConfig)

type trainConfig struct {
	model []Option
	ddp   []ddp.Option
	tape  []autograd.Option
	run   tinygpt.Config
	// random: random tokens (WithRandomTokens) instead of the corpus.
	random bool
	seed   uint64
	data   *train.Windows // a user's token file (WithWindows) instead of the corpus
	opts   []train.SamplerOption
	file   bool // WithWindows was given
}

// WithRandomTokens trains on random tokens instead of the tiny GPT's
// corpus, for throughput runs of a model of any vocabulary: step s's
// global batch is B rows of T+1 token ids drawn uniformly from [0, V) by
// a generator keyed on seed and s, inputs the first T and targets the
// last T. Every rank draws the same batch and keeps its rows, as with the
// corpus.
func WithRandomTokens(seed uint64) TrainOption {
	return func(c *trainConfig) { c.random, c.seed = true, seed }
}

// WithRun sets the training run: the batch size, corpus and sampler seeds
// (reference/TINY_GPT.md §2) and AdamW's hyper-parameters (§4) are read
// from run; its model fields and Steps are not (the model's shape is the
// Config, the number of steps the caller's). Default: tinygpt.Default(),
// the tiny GPT's run.
func WithRun(run tinygpt.Config) TrainOption {
	return func(c *trainConfig) { c.run = run }
}

// WithModel adds options for New (the data-parallel axis, the BLAS,
// diagnostics).
func WithModel(opts ...Option) TrainOption {
	return func(c *trainConfig) { c.model = append(c.model, opts...) }
}

// WithDevice trains on device d: the tape's device (autograd.WithDevice),
// where New places the parameters and the ops, gradients and AdamW's state
// follow them. Default: the host.
func WithDevice(d device.Device) TrainOption {
	return func(c *trainConfig) { c.tape = append(c.tape, autograd.WithDevice(d)) }
}

// WithDDP adds options for both DDPs (bucket sizes); the axes are set by
// the trainer.
func WithDDP(opts ...ddp.Option) TrainOption {
	return func(c *trainConfig) { c.ddp = append(c.ddp, opts...) }
}

// WithTape adds options for the model's tape (a BLAS, an observer).
func WithTape(opts ...autograd.Option) TrainOption {
	return func(c *trainConfig) { c.tape = append(c.tape, opts...) }
}

// Trainer trains the model with AdamW on a mesh with an expert-parallel
// axis and optionally a data-parallel one: the batch rows are sharded over
// both, the replicated parameters' gradients are all-reduced over both
// and the expert parameters' over the data-parallel axis (see the package
// documentation). Every rank draws the same global batches and keeps its
// rows, so any layout trains on exactly the batches one rank would.
type Trainer struct {
	// Model is the model being trained.
	Model   *Model
	opt     *optim.AdamW
	dense   *ddp.DDP          // replicated parameters over the ep axis
	experts *ddp.DDP          // expert parameters over the dp axis
	sampler batches.Source    // the corpus, random tokens or a token file
	batch   int               // the global batch, in sequences
	group   comm.Communicator // the token axes, for the reported scalars
}

// NewTrainer builds the model from init on m with the experts sharded
// over the axis ep (New), and prepares the DDPs, AdamW and the batches
// (WithRun). It is collective over m. A run that is invalid, or whose
// batch the layout cannot split (Config.CheckLayout), is an error
// wrapping ErrConfig, before anything is communicated.
func NewTrainer(ctx context.Context, m *mesh.Mesh, cfg Config, init map[string][]float32, ep string, opts ...TrainOption) (*Trainer, error) {
	tc := trainConfig{run: tinygpt.Default()}
	for _, o := range opts {
		o(&tc)
	}
	var mo options
	for _, o := range tc.model {
		o(&mo)
	}
	data := cfg.reference(tc.run)
	if err := data.Validate(); err != nil {
		return nil, fmt.Errorf("%w: trainer: %w", ErrConfig, err)
	}
	if m != nil {
		if err := cfg.CheckLayout(data.B, axisSize(m, mo.dp), axisSize(m, ep)); err != nil {
			return nil, fmt.Errorf("moegpt: trainer: %w", err)
		}
	}
	// Step ends each step's values before the next forward pass, so the
	// tape may reuse their memory.
	tape := autograd.NewTape(append([]autograd.Option{autograd.WithRecycling()}, tc.tape...)...)
	md, err := New(tape, m, cfg, init, ep, tc.model...)
	if err != nil {
		return nil, err
	}
	tr := &Trainer{Model: md, batch: data.B}
	if axisSize(m, ep) > 1 {
		o := append(slices.Clone(tc.ddp), ddp.WithAxis(ep), ddp.WithGradientAsBucketView())
		if tr.dense, err = ddp.New(ctx, md.ReplicatedParams(), o...); err != nil {
			return nil, fmt.Errorf("moegpt: trainer: DDP over %q: %w", ep, err)
		}
	}
	if axisSize(m, mo.dp) > 1 {
		o := append(slices.Clone(tc.ddp), ddp.WithAxis(mo.dp), ddp.WithGradientAsBucketView())
		if tr.experts, err = ddp.New(ctx, md.ExpertParams(), o...); err != nil {
			return nil, fmt.Errorf("moegpt: trainer: DDP over %q: %w", mo.dp, err)
		}
	}
	if tr.group, err = m.Group(ctx, md.group...); err != nil {
		return nil, fmt.Errorf("moegpt: trainer: communicator of %v: %w", md.group, err)
	}
	if tr.opt, err = optim.NewAdamW(md.Params(), optim.WithLR(data.LR), optim.WithWeightDecay(data.WD), optim.WithBetas(data.Beta1, data.Beta2), optim.WithEps(data.Eps)); err != nil {
		return nil, fmt.Errorf("moegpt: trainer: %w", err)
	}
	if tr.sampler, err = tc.source(data); err != nil {
		return nil, fmt.Errorf("moegpt: trainer: %w", err)
	}
	return tr, nil
}

// axisSize is the size of m's axis named axis, 1 for "" or an axis m
// lacks (New reports that).
func axisSize(m *mesh.Mesh, axis string) int {
	if i := slices.Index(m.Names(), axis); axis != "" && i >= 0 {
		return m.Shape()[i]
	}
	return 1
}

// LayerStats are one MoE layer's numbers for one step.
type LayerStats struct {
	// Counts are the global tokens per expert (after dropping); Slots is
	// N·K, the global token slots.
	Counts []int64
	Slots  int64
	// Dropped is the number of slots dropped by the capacity limit and
	// Padded the padding rows of the static layout, over the global batch.
	Dropped, Padded int64
	// Aux and Z are the layer's global load-balancing loss and z-loss
	// (0 when turned off).
	Aux, Z float64
	// Dispatch are this rank's dispatch diagnostics, with the forward and
	// backward time split.
	Dispatch moe.Stats
}

// Balance is the largest tokens per expert over their mean (1 is perfect
// balance; E means one expert took every slot).
func (s LayerStats) Balance() float64 {
	if len(s.Counts) == 0 {
		return 0
	}
	var sum int64
	for _, c := range s.Counts {
		sum += c
	}
	if sum == 0 {
		return 0
	}
	return float64(slices.Max(s.Counts)) * float64(len(s.Counts)) / float64(sum)
}

// DroppedFraction is Dropped over the global slots.
func (s LayerStats) DroppedFraction() float64 {
	if s.Slots == 0 {
		return 0
	}
	return float64(s.Dropped) / float64(s.Slots)
}

// PaddedFraction is Padded over every row the static layout sends (the
// kept slots plus the padding).
func (s LayerStats) PaddedFraction() float64 {
	rows := s.Slots - s.Dropped + s.Padded
	if rows <= 0 {
		return 0
	}
	return float64(s.Padded) / float64(rows)
}

// StepResult is what one training step reports.
type StepResult struct {
	// Step is the batch's step number, from 1.
	Step int
	// Loss is the global loss that was differentiated: CE + Aux + Z.
	Loss float64
	// CE is the global mean cross-entropy; Aux and Z the layers'
	// auxiliary losses, summed over the layers.
	CE, Aux, Z float64
	// Layers are the MoE layers' numbers, in order.
	Layers []LayerStats
}

// Step runs one training step on the next batch: forward, backward (the
// DDP all-reduces overlapping it), the remaining gradient reductions,
// AdamW and ZeroGrad. Its numbers are computed before the update; the one
// collective that is only for reporting is an all-reduce of 1+2L scalars.
func (tr *Trainer) Step(ctx context.Context) (*StepResult, error) {
	b, err := tr.sampler.Next()
	if err != nil {
		return nil, fmt.Errorf("moegpt: step %d: the batch: %w", tr.sampler.Step()+1, err)
	}
	tr.Model.tape.Recycle() // the previous step's values are dead
	res, err := tr.step(ctx, b)
	if err != nil {
		return nil, fmt.Errorf("moegpt: step %d: %w", b.Step, err)
	}
	res.Step = b.Step
	return res, nil
}

func (tr *Trainer) step(ctx context.Context, b tinygpt.Batch) (*StepResult, error) {
	md := tr.Model
	x, y, err := md.Inputs(b)
	if err != nil {
		return nil, err
	}
	out, err := md.Forward(ctx, x, y)
	if err != nil {
		return nil, err
	}
	// This rank's shares of the reported losses: CE, then every layer's
	// aux and z.
	shares := make([]float64, 1+2*len(out.Layers))
	if shares[0], err = localScalar(out.CE); err != nil {
		return nil, fmt.Errorf("loss: %w", err)
	}
	for l, lo := range out.Layers {
		if shares[1+2*l], err = localScalar(lo.Routing.Aux); err != nil {
			return nil, fmt.Errorf("block %d aux loss: %w", l, err)
		}
		if shares[2+2*l], err = localScalar(lo.Routing.Z); err != nil {
			return nil, fmt.Errorf("block %d z-loss: %w", l, err)
		}
	}
	if err := md.tape.Backward(ctx, out.Loss); err != nil {
		var errs []error
		for _, d := range []*ddp.DDP{tr.dense, tr.experts} {
			if d != nil {
				errs = append(errs, d.Discard(ctx))
			}
		}
		if derr := errors.Join(errs...); derr != nil {
			err = fmt.Errorf("%w (DDP discard: %v)", err, derr)
		}
		return nil, fmt.Errorf("backward: %w", err)
	}
	for _, d := range []*ddp.DDP{tr.dense, tr.experts} {
		if d != nil {
			if err := d.Finish(ctx); err != nil {
				return nil, err
			}
		}
	}
	if err := tp.ReduceGrads(ctx, md.params); err != nil {
		return nil, err
	}
	if err := comm.AllReduce(ctx, tr.group, comm.Host(shares), comm.Host(shares), comm.Sum); err != nil {
		return nil, fmt.Errorf("reported losses: %w", err)
	}
	res := &StepResult{CE: shares[0], Loss: shares[0]}
	for l, lo := range out.Layers {
		r := lo.Routing
		ls := LayerStats{
			Counts: slices.Clone(r.Counts), Slots: int64(b.B * b.T * r.K),
			Dropped: r.Dropped, Padded: r.Padded,
			Aux: shares[1+2*l], Z: shares[2+2*l],
			Dispatch: lo.Handle.Stats(),
		}
		res.Aux += ls.Aux
		res.Z += ls.Z
		res.Layers = append(res.Layers, ls)
	}
	res.Loss += res.Aux + res.Z
	if err := tr.opt.Step(); err != nil {
		return nil, err
	}
	md.ZeroGrad()
	return res, nil
}

// Full gathers every parameter's global value (collective over the mesh).
func (tr *Trainer) Full(ctx context.Context) (map[string][]float32, error) {
	out := map[string][]float32{}
	for _, p := range tr.Model.params {
		f, err := p.Data().Full(ctx)
		if err != nil {
			return nil, fmt.Errorf("moegpt: gather %q: %w", p.Name(), err)
		}
		d, ok := f.([]float32)
		if !ok {
			return nil, fmt.Errorf("moegpt: gather %q: unexpected data %T", p.Name(), f)
		}
		out[p.Name()] = slices.Clone(d)
	}
	return out, nil
}
