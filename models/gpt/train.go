package gpt

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/internal/batches"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// TrainOption configures NewTrainer.
type TrainOption func(*trainConfig)

type trainConfig struct {
	dp, tp string
	fsdp   string
	fsOpts []fsdp.Option
	cp     string
	cpOpts []cp.Option
	cpu    string // Hybrid's inner (Ulysses) axis
	plain  bool   // the cp axis shards T in plain blocks, not balanced
	flatCP bool   // FSDP shards over the flattened fsdp × cp axes
	sp     bool
	ckpt   []autograd.CheckpointOption
	ac     bool
	ddp    []ddp.Option
	tape   []autograd.Option
	model  []Option
	run    tinygpt.Config
	random bool // random tokens (WithRandomTokens) instead of the corpus
	seed   uint64
	data   *train.Windows // a user's token file (WithWindows) instead of the corpus
	opts   []train.SamplerOption
	file   bool // WithWindows was given
}

// WithDataParallel shards the batch rows over the named mesh axis, with
// DDP's overlapped gradient all-reduce there (default: no data
// parallelism).
func WithDataParallel(axis string) TrainOption { return func(c *trainConfig) { c.dp = axis } }

// WithTensorParallel shards the model over the named mesh axis by Plan
// (default: no tensor parallelism). An axis of size 1 leaves the model
// replicated: the plan would only add no-op redistributions and the slower
// vocab-parallel cross-entropy.
func WithTensorParallel(axis string) TrainOption { return func(c *trainConfig) { c.tp = axis } }

// WithSequenceParallel adds sequence parallelism on the tensor-parallel
// axis (Plan(true)); it needs WithTensorParallel.
func WithSequenceParallel() TrainOption { return func(c *trainConfig) { c.sp = true } }

// WithFullyShard shards the parameters, gradients and AdamW's state over
// the named mesh axis (FSDP; ZeRO-3 unless opts say otherwise:
// fsdp.WithZeROStage, Reshard, WithReshardTo, WithMixedPrecision, Prefetch): each
// block is a unit of its own, the root holds the embeddings, the final
// norm and the head. The batch rows are sharded over it as well, after
// WithDataParallel's axis, which then becomes HSDP's replicate axis
// (gradients reduce-scattered over this axis and all-reduced over that
// one, with no DDP). An axis of size 1 leaves the model unsharded.
func WithFullyShard(axis string, opts ...fsdp.Option) TrainOption {
	return func(c *trainConfig) { c.fsdp, c.fsOpts = axis, append(c.fsOpts, opts...) }
}

// WithContextParallel shards the sequence dim of the batch, and so of
// every activation, over the named mesh axis (context parallelism): each
// block's attention is parallel/cp's Attention over it, with opts (the
// method, cp.WithMethod; default Auto); the position ids and targets
// follow the layout. The sequence is load balanced
// (placement.ShardBalanced: rank r of k holds chunks r and 2k−1−r of 2k)
// unless WithPlainSequenceShards. The loss is the mean over batch ×
// sequence as one rank's, and the parameters' gradients are summed over
// the axis after backward. An axis of size 1 is no context parallelism.
// It combines with the data, fully sharded and tensor-parallel axes, not
// with sequence parallelism.
func WithContextParallel(axis string, opts ...cp.Option) TrainOption {
	return func(c *trainConfig) { c.cp, c.cpOpts = axis, append(c.cpOpts, opts...) }
}

// WithUlyssesAxis makes WithContextParallel hybrid (cp.Hybrid): the
// sequence is sharded over its axis (outer, load balanced unless
// WithPlainSequenceShards) and then over the named axis (inner, plain
// blocks); attention runs Ulysses within the inner groups and the ring
// across them.
func WithUlyssesAxis(name string) TrainOption { return func(c *trainConfig) { c.cpu = name } }

// WithPlainSequenceShards makes WithContextParallel shard the sequence in
// contiguous blocks (placement.Shard), the last rank doing the most
// causal attention work; for comparison with the balanced layout.
func WithPlainSequenceShards() TrainOption { return func(c *trainConfig) { c.plain = true } }

// WithShardOverCP makes WithFullyShard shard over the flattened
// (fsdp, cp) axes, as torchtitan's FSDP shards over dp_shard×cp: each
// rank holds 1/(fsdp·cp) of the parameters, gradients and AdamW's state
// instead of 1/fsdp, and the gradients are reduce-scattered over the
// flattened group, which also sums their context-parallel partials (no
// separate sum over cp). With WithUlyssesAxis the inner axis is flattened
// in too. It needs WithFullyShard and WithContextParallel (the fsdp axis
// may then have size 1: FSDP over cp alone); NewTrainer fails with
// ErrConfig without them.
func WithShardOverCP() TrainOption { return func(c *trainConfig) { c.flatCP = true } }

// WithCheckpointing checkpoints every block (parallel.Checkpoint on
// "h.*"): a block keeps only its input for backward and recomputes its
// forward there. With autograd.WithKeepMatrixProducts() (or WithKeepOps) it is
// selective: the blocks keep those ops' outputs and recompute the rest.
// The gradients are the same, bit for bit.
func WithCheckpointing(opts ...autograd.CheckpointOption) TrainOption {
	return func(c *trainConfig) { c.ac, c.ckpt = true, append(c.ckpt, opts...) }
}

// WithDDP adds DDP options (bucket sizes); the axis is WithDataParallel's.
func WithDDP(opts ...ddp.Option) TrainOption {
	return func(c *trainConfig) { c.ddp = append(c.ddp, opts...) }
}

// WithTape adds options for the model's tape (a BLAS, an observer).
func WithTape(opts ...autograd.Option) TrainOption {
	return func(c *trainConfig) { c.tape = append(c.tape, opts...) }
}

// WithDevice trains on device d: the tape's device (autograd.WithDevice),
// where New places the parameters and the ops, gradients and AdamW's state
// follow them. Default: the host.
func WithDevice(d device.Device) TrainOption {
	return func(c *trainConfig) { c.tape = append(c.tape, autograd.WithDevice(d)) }
}

// WithModel adds options for New (the initial parameters).
func WithModel(opts ...Option) TrainOption {
	return func(c *trainConfig) { c.model = append(c.model, opts...) }
}

// WithRun sets the training run: the batch size, corpus and sampler seeds
// (reference/TINY_GPT.md §2) and AdamW's hyper-parameters (§4) are read
// from run; its model fields and Steps are not (the model's shape is the
// Config, the number of steps the caller's). Default: tinygpt.Default(),
// the reference run.
func WithRun(run tinygpt.Config) TrainOption {
	return func(c *trainConfig) { c.run = run }
}

// WithRandomTokens trains on random tokens instead of the reference's
// corpus, for throughput runs of a model of any vocabulary: step s's
// global batch is B rows of T+1 token ids drawn uniformly from [0, Vocab)
// by a generator keyed on seed and s, inputs the first T and targets the
// last T. Every rank draws the same batch and keeps its rows, as with the
// corpus.
func WithRandomTokens(seed uint64) TrainOption {
	return func(c *trainConfig) { c.random, c.seed = true, seed }
}

// Trainer trains a GPT on a mesh with optional data- and tensor-parallel
// axes: the batch rows are sharded over dp, the model over tp by Plan,
// data-parallel gradients are all-reduced by DDP while backward runs, and
// AdamW updates each rank's shards. Every rank draws the same global
// batches of the reference's corpus (§2.3; or WithRandomTokens's, or
// WithWindows's from a token file) and keeps its rows, so any layout
// trains on exactly the batches one rank would. Parts gives its state to
// package checkpoint, to save and to resume on any layout.
type Trainer struct {
	Model   *Model
	fsdp    *fsdp.FSDP
	mesh    *mesh.Mesh
	tape    *autograd.Tape
	meter   memory.Meter
	params  []*autograd.Value // the leaves the optimizer updates
	opt     *optim.AdamW
	ddp     *ddp.DDP
	sampler batches.Source // the corpus, random tokens or a token file
	places  []placement.Placement
	batch   int // the global batch, in sequences
}

// NewTrainer builds the model for cfg on m, parallelizes it as the options
// say, and prepares DDP and AdamW. It is collective over m. The layout is
// checked first (Config.CheckLayout): a bad one is an error wrapping
// ErrConfig, before anything is communicated.
func NewTrainer(ctx context.Context, m *mesh.Mesh, cfg Config, opts ...TrainOption) (*Trainer, error) {
	tc := trainConfig{run: tinygpt.Default()}
	for _, o := range opts {
		o(&tc)
	}
	if m == nil {
		return nil, fmt.Errorf("%w: trainer: nil mesh", ErrConfig)
	}
	data := cfg.reference(tc.run)
	data.Steps = max(data.Steps, 1) // the caller counts the steps
	if err := data.Validate(); err != nil {
		return nil, fmt.Errorf("%w: trainer: %w", ErrConfig, err)
	}
	names := m.Names()
	size := map[string]int{}
	if tc.cpu != "" && tc.cp == "" {
		return nil, fmt.Errorf("%w: trainer: WithUlyssesAxis(%q) needs WithContextParallel", ErrConfig, tc.cpu)
	}
	for _, ax := range []string{tc.dp, tc.fsdp, tc.tp, tc.cp, tc.cpu} {
		if ax == "" {
			continue
		}
		i := slices.Index(names, ax)
		if i < 0 {
			return nil, fmt.Errorf("%w: trainer: the mesh has no axis %q (its axes are %v)", ErrConfig, ax, names)
		}
		size[ax] = m.Shape()[i]
	}
	for _, pair := range []struct{ a, b, kinds string }{
		{tc.dp, tc.tp, "data and tensor"},
		{tc.dp, tc.fsdp, "data and fully sharded data"},
		{tc.fsdp, tc.tp, "fully sharded data and tensor"},
		{tc.cp, tc.dp, "context and data"},
		{tc.cp, tc.fsdp, "context and fully sharded data"},
		{tc.cp, tc.tp, "context and tensor"},
		{tc.cpu, tc.dp, "context and data"},
		{tc.cpu, tc.fsdp, "context and fully sharded data"},
		{tc.cpu, tc.tp, "context and tensor"},
		{tc.cpu, tc.cp, "both context"},
	} {
		if pair.a != "" && pair.a == pair.b {
			return nil, fmt.Errorf("%w: trainer: axis %q named for both %s parallelism", ErrConfig, pair.a, pair.kinds)
		}
	}
	if tc.cpu != "" && slices.Index(names, tc.cpu) < slices.Index(names, tc.cp) {
		return nil, fmt.Errorf("%w: trainer: the Ulysses axis %q must come after the context-parallel axis %q in the mesh (axes %v)", ErrConfig, tc.cpu, tc.cp, names)
	}
	if tc.flatCP && (tc.fsdp == "" || tc.cp == "") {
		return nil, fmt.Errorf("%w: trainer: WithShardOverCP needs WithFullyShard and WithContextParallel", ErrConfig)
	}
	if tc.sp && tc.tp == "" {
		return nil, fmt.Errorf("%w: trainer: sequence parallelism needs a tensor-parallel axis (WithTensorParallel)", ErrConfig)
	}
	dp, nfsdp, ntp, ncp := max(size[tc.dp], 1), max(size[tc.fsdp], 1), max(size[tc.tp], 1), max(size[tc.cp], 1)*max(size[tc.cpu], 1)
	method, err := cp.MethodOf(tc.cpOpts...)
	if err != nil {
		return nil, fmt.Errorf("%w: trainer: WithContextParallel: %w", ErrConfig, err)
	}
	if tc.cpu != "" {
		method = cp.Hybrid
	}
	if err := cfg.CheckLayout(data.B, Layout{DP: dp, FSDP: nfsdp, TP: ntp, SP: tc.sp, CP: ncp, CPMethod: method, CPInner: size[tc.cpu], CPPlain: tc.plain}); err != nil {
		return nil, fmt.Errorf("gpt: trainer: %w", err)
	}
	// Step ends each step's values before the next forward pass, so the
	// tape may reuse their memory.
	// The memory meter samples after every op.
	tr := &Trainer{mesh: m, places: make([]placement.Placement, m.NDim()), batch: data.B}
	sample := autograd.WithObserver(func(string, string, time.Time, time.Time) { tr.meter.Sample() })
	tr.tape = autograd.NewTape(append([]autograd.Option{autograd.WithRecycling(), sample}, tc.tape...)...)
	md, err := New(tr.tape, m, cfg, tc.model...)
	if err != nil {
		return nil, err
	}
	tr.Model = md
	for i := range tr.places {
		tr.places[i] = placement.Replicate()
	}
	if ntp > 1 {
		if err := tp.Parallelize(ctx, md, tc.tp, Plan(tc.sp)); err != nil {
			return nil, fmt.Errorf("gpt: trainer: %w", err)
		}
	}
	if tc.ac {
		if err := parallel.Checkpoint(md, []string{"h.*"}, tc.ckpt...); err != nil {
			return nil, fmt.Errorf("gpt: trainer: %w", err)
		}
	}
	if tc.dp != "" {
		tr.places[slices.Index(names, tc.dp)] = placement.Shard(0)
	}
	if ncp > 1 {
		seq := placement.ShardBalanced(1)
		if tc.plain {
			seq = placement.Shard(1)
		}
		tr.places[slices.Index(names, tc.cp)] = seq
		axis, cpOpts := tc.cp, slices.Clone(tc.cpOpts)
		if tc.cpu != "" {
			// The inner axis shards each outer shard in plain blocks;
			// Inputs lays the ids out in mesh order, which must be
			// outer first.
			tr.places[slices.Index(names, tc.cpu)] = placement.Shard(1)
			cpOpts = append(cpOpts, cp.WithMethod(cp.Hybrid), cp.WithUlyssesAxis(tc.cpu))
		}
		for _, b := range md.Blocks {
			b.Attn.Core = func(ctx context.Context, q, k, v *autograd.Value) (*autograd.Value, error) {
				return cp.Attention(ctx, q, k, v, axis, cpOpts...)
			}
		}
	}
	flat := tc.flatCP && nfsdp*ncp > 1
	switch {
	case nfsdp > 1 || flat:
		tr.places[slices.Index(names, tc.fsdp)] = placement.Shard(0)
		fsOpts := []fsdp.Option{fsdp.WithShardAxis(tc.fsdp)}
		if flat {
			fsOpts = []fsdp.Option{fsdp.WithShardAxes(tc.shardAxes()...)}
		}
		if dp > 1 {
			fsOpts = append(fsOpts, fsdp.WithReplicateAxis(tc.dp))
		}
		var units []string // one unit per block; a model of no blocks has the root alone
		if len(md.Blocks) > 0 {
			units = []string{"h.*"}
		}
		if tr.fsdp, err = fsdp.FullyShard(ctx, md, units, append(fsOpts, tc.fsOpts...)...); err != nil {
			return nil, fmt.Errorf("gpt: trainer: %w", err)
		}
	case dp > 1:
		ddpOpts := append(slices.Clone(tc.ddp), ddp.WithAxis(tc.dp), ddp.WithGradientAsBucketView())
		if tr.ddp, err = ddp.New(ctx, md.Params(), ddpOpts...); err != nil {
			return nil, fmt.Errorf("gpt: trainer: %w", err)
		}
	}
	tr.params = md.Params()
	tr.meter.Add(tr.memoryUse)
	// On a device, Memory reports its allocator too ("mem".device in -json).
	tr.meter.SetDevice(tr.tape.Device())
	if tr.opt, err = optim.NewAdamW(tr.params, optim.WithLR(data.LR), optim.WithWeightDecay(data.WD), optim.WithBetas(data.Beta1, data.Beta2), optim.WithEps(data.Eps)); err != nil {
		return nil, fmt.Errorf("gpt: trainer: %w", err)
	}
	if tr.sampler, err = tc.source(data); err != nil {
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
	b, err := tr.sampler.Next()
	if err != nil {
		return tr.sampler.Step() + 1, 0, fmt.Errorf("gpt: step %d: the batch: %w", tr.sampler.Step()+1, err)
	}
	tr.tape.Recycle() // the previous step's values are dead
	tr.meter.Reset()
	defer tr.meter.Sample() // after the update: the optimizer's state
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
		if derr := tr.discard(ctx); derr != nil {
			err = fmt.Errorf("%w (and the discard of the step's gradient reduction: %v)", err, derr)
		}
		return 0, err
	}
	switch {
	case tr.ddp != nil:
		if err := tr.ddp.Finish(ctx); err != nil {
			return 0, err
		}
	case tr.fsdp != nil:
		if err := tr.fsdp.Finish(ctx); err != nil {
			return 0, err
		}
	}
	if err := tp.ReduceGrads(ctx, tr.params); err != nil {
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

// discard completes the gradient reduction of a step whose Backward failed.
func (tr *Trainer) discard(ctx context.Context) error {
	switch {
	case tr.ddp != nil:
		return tr.ddp.Discard(ctx)
	case tr.fsdp != nil:
		return tr.fsdp.Discard(ctx)
	}
	return nil
}

// memoryUse is what this rank holds now: the parameters (local blocks,
// and FSDP's gathered buffers), the gradients (FSDP's or DDP's buffers,
// which hold them, or the leaves'), AdamW's state, the tape's
// activations and FSDP's staging buffers.
func (tr *Trainer) memoryUse() memory.Use {
	var u memory.Use
	switch {
	case tr.fsdp != nil:
		// The sharded leaves' gradients are views of FSDP's buffers.
		b := tr.fsdp.Bytes()
		u.Params = b.Sharded + b.Unsharded + b.Kept
		u.Grads = b.ShardedGrads + b.UnshardedGrads
		u.Comm = b.Staging
	case tr.ddp != nil:
		for _, p := range tr.params {
			u.Params += memory.Tensor(p.Data())
		}
		u = u.Add(tr.ddp.Bytes())
	default:
		for _, p := range tr.params {
			u.Params += memory.Tensor(p.Data())
		}
		for _, p := range tr.params {
			u.Grads += p.GradBytes()
		}
	}
	if tr.opt != nil {
		u.Optim = tr.opt.StateBytes()
	}
	u.Activations = tr.tape.ActivationBytes()
	return u
}

// Memory returns the bytes held during the last Step, by kind, each the
// maximum over the ranks of the mesh (collective over it): parameters,
// gradients, optimizer state, activations saved for backward and
// communication buffers, each at its peak during the step, and Peak, the
// largest total at one moment (sampled after every op of the step and
// after the update). The first step allocates what later steps reuse, so
// read it after a later one.
func (tr *Trainer) Memory(ctx context.Context) (memory.Report, error) {
	c, err := tr.mesh.Group(ctx, tr.mesh.Names()...)
	if err != nil {
		return memory.Report{}, fmt.Errorf("gpt: memory: %w", err)
	}
	return memory.MaxOverRanks(ctx, c, tr.meter.Report())
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

// shardAxes are the axes WithShardOverCP flattens: fsdp, cp and Hybrid's
// inner axis, outer first.
func (tc *trainConfig) shardAxes() []string {
	axes := []string{tc.fsdp, tc.cp}
	if tc.cpu != "" {
		axes = append(axes, tc.cpu)
	}
	return axes
}
