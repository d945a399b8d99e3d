// Package gpt is a pre-LayerNorm GPT of any size on loom's autograd,
// built from parallel's modules: token and position embeddings, Layers
// blocks of h += attn(LN1(h)); h += mlp(LN2(h)), a final LayerNorm and an
// untied lm_head without bias (reference/TINY_GPT.md §3). Config is its
// shape; Tiny is the reference's, whose PyTorch numbers the tests in
// tests/ reproduce.
//
// New lays every parameter out Replicate on every mesh axis; Plan, applied
// with tp.Parallelize on the tensor-parallel axis, shards them
// (Megatron's layout, optionally with sequence parallelism). The module
// paths a Plan matches, which are also the parameter names' prefixes, are
//
//	wte, wpe                          embeddings (tables "wte", "wpe")
//	h.<l>.ln1, h.<l>.ln2              LayerNorms ("h.<l>.ln1.weight", ".bias")
//	h.<l>.attn.qkv, h.<l>.attn.proj   attention (parallel.Attention)
//	h.<l>.mlp.fc, h.<l>.mlp.proj      MLP (parallel.MLP)
//	ln_f, lm_head                     final LayerNorm, output projection
//
// with <l> from 0 to Layers−1. The token ids may be Replicate or sharded on
// the batch dim (data parallelism) and on the sequence dim (context
// parallelism, with every block's Attn.Core set to parallel/cp's
// Attention: WithContextParallel); the loss is then Partial(sum) on the
// sharding axes and the parameter gradients Partial(sum) there as well. Trainer puts it together with DDP and AdamW on the reference's
// data.
package gpt

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Model is a GPT (see the package documentation). It is a tree of
// parallel modules written in global terms: tp.Parallelize (with
// Plan) lays it out for tensor and sequence parallelism without changing
// its code. Its parameters are leaves of one tape (the tape given to New).
type Model struct {
	parallel.Hooks
	cfg    Config
	tape   *autograd.Tape
	mesh   *mesh.Mesh
	WTE    *parallel.Embedding
	WPE    *parallel.Embedding
	Blocks []*Block
	LNF    *parallel.LayerNorm
	LMHead *parallel.Linear
	h      blocks // the "h" container: its hooks run around the blocks
}

// Block is one pre-LN transformer block: h += attn(ln1(h)); h +=
// mlp(ln2(h)).
type Block struct {
	parallel.Hooks
	LN1, LN2 *parallel.LayerNorm
	Attn     *parallel.Attention
	MLP      *parallel.MLP
}

// Children returns ln1, attn, ln2 and mlp.
func (b *Block) Children() []parallel.Child {
	return []parallel.Child{{Name: "ln1", Module: b.LN1}, {Name: "attn", Module: b.Attn}, {Name: "ln2", Module: b.LN2}, {Name: "mlp", Module: b.MLP}}
}

// Forward runs the block on h [B, T, D].
func (b *Block) Forward(ctx context.Context, h *autograd.Value) (*autograd.Value, error) {
	return b.Run(ctx, h, b.compute)
}

// compute is the block's body, after its input hooks.
func (b *Block) compute(ctx context.Context, h *autograd.Value) (*autograd.Value, error) {
	for _, sub := range []struct {
		ln *parallel.LayerNorm
		f  func(context.Context, *autograd.Value) (*autograd.Value, error)
	}{{b.LN1, b.Attn.Forward}, {b.LN2, b.MLP.Forward}} {
		a, err := sub.ln.Forward(ctx, h)
		if err != nil {
			return nil, err
		}
		o, err := sub.f(ctx, a)
		if err != nil {
			return nil, err
		}
		if h, err = autograd.Add(h, o); err != nil {
			return nil, fmt.Errorf("residual: %w", err)
		}
	}
	return h, nil
}

// blocks is the "h" container: its children are named 0 … L−1. Forward
// runs its input hooks before the first block and its output hooks after
// the last.
type blocks struct {
	parallel.Hooks
	list []*Block
}

// Children returns the blocks, named 0 … L−1.
func (bs *blocks) Children() []parallel.Child {
	out := make([]parallel.Child, len(bs.list))
	for i, b := range bs.list {
		out[i] = parallel.Child{Name: strconv.Itoa(i), Module: b}
	}
	return out
}

// Children returns wte, wpe, h (the blocks, named h.0 … h.L−1), ln_f and
// lm_head: module paths that, followed by the parameter's own suffix, are
// the parameter names of reference/TINY_GPT.md.
func (md *Model) Children() []parallel.Child {
	md.h.list = md.Blocks
	return []parallel.Child{
		{Name: "wte", Module: md.WTE},
		{Name: "wpe", Module: md.WPE},
		{Name: "h", Module: &md.h},
		{Name: "ln_f", Module: md.LNF},
		{Name: "lm_head", Module: md.LMHead},
	}
}

// Option configures New: where the initial parameters come from.
type Option func(*options)

type options struct {
	params map[string][]float32
	seed   uint64
}

// WithParams starts the model from given values: params maps every
// parameter name of Config.Params to its row-major float32 value (for
// parity, the fixture's init.* tensors). Missing, surplus or wrongly sized
// entries are errors. The data is copied.
func WithParams(params map[string][]float32) Option {
	return func(o *options) { o.params = params }
}

// WithSeed draws the initial parameters from seed (default 0) by the §3.1
// init column: N(0, InitStd²) for the embeddings and projection weights,
// drawn in param_order from one PCG generator (parallel.Normal), ones for
// LayerNorm weights and zeros for biases. It is the values RandomInit
// returns. WithParams takes precedence.
func WithSeed(seed uint64) Option { return func(o *options) { o.seed = seed } }

// New builds the model for cfg on tape and mesh m, every parameter a leaf
// laid out Replicate on every mesh axis, initialised as the options say
// (default: WithSeed(0)), its block on the tape's device
// (autograd.WithDevice; the host by default). Every rank calls it alike.
func New(tape *autograd.Tape, m *mesh.Mesh, cfg Config, opts ...Option) (*Model, error) {
	if tape == nil || m == nil {
		return nil, fmt.Errorf("%w: New: nil tape or mesh", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	weights, biases := parallel.Normal(cfg.InitStd, o.seed), parallel.Zeros()
	norms := parallel.Ones()
	if o.params != nil {
		if err := checkParams(cfg, o.params); err != nil {
			return nil, err
		}
		weights = parallel.ByName(o.params)
		biases, norms = weights, weights
	}
	named := func(name string, extra ...parallel.LayerOption) []parallel.LayerOption {
		return append([]parallel.LayerOption{parallel.WithName(name), parallel.WithInit(weights), parallel.WithBiasInit(biases)}, extra...)
	}
	norm := func(name string) (*parallel.LayerNorm, error) {
		return parallel.NewLayerNorm(tape, m, cfg.Width, parallel.WithName(name), parallel.WithInit(norms),
			parallel.WithBiasInit(biases), parallel.WithEps(cfg.LNEps))
	}
	// Construction order is param_order, so that one Normal generator
	// draws the weights in that order.
	md := &Model{cfg: cfg, tape: tape, mesh: m}
	var err error
	if md.WTE, err = parallel.NewEmbedding(tape, m, cfg.Vocab, cfg.Width, parallel.WithName(tinygpt.ParamWTE), parallel.WithInit(weights)); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	if md.WPE, err = parallel.NewEmbedding(tape, m, cfg.SeqLen, cfg.Width, parallel.WithName(tinygpt.ParamWPE), parallel.WithInit(weights)); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	for l := range cfg.Layers {
		p := "h." + strconv.Itoa(l) + "."
		b := &Block{}
		if b.LN1, err = norm(p + "ln1"); err != nil {
			return nil, fmt.Errorf("gpt: New: %w", err)
		}
		if b.Attn, err = parallel.NewAttention(tape, m, cfg.Width, cfg.Heads, named(p+"attn")...); err != nil {
			return nil, fmt.Errorf("gpt: New: %w", err)
		}
		if b.LN2, err = norm(p + "ln2"); err != nil {
			return nil, fmt.Errorf("gpt: New: %w", err)
		}
		if b.MLP, err = parallel.NewMLP(tape, m, cfg.Width, cfg.MLPWidth, named(p+"mlp")...); err != nil {
			return nil, fmt.Errorf("gpt: New: %w", err)
		}
		md.Blocks = append(md.Blocks, b)
	}
	if md.LNF, err = norm("ln_f"); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	if md.LMHead, err = parallel.NewLinear(tape, m, cfg.Width, cfg.Vocab, named("lm_head", parallel.WithBias(false))...); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	if err := placeOn(tape.Device(), md.Params()); err != nil {
		return nil, fmt.Errorf("gpt: New: %w", err)
	}
	return md, nil
}

// placeOn moves the parameters whose blocks are not on d there (each its
// own copy, installed by Relayout), so that the model computes on the
// tape's device whichever device the layers' constructors chose.
func placeOn(d device.Device, ps []*autograd.Value) error {
	for _, p := range ps {
		if device.Same("", p.Data().Device(), d) == nil {
			continue
		}
		dt, err := p.Data().To(d)
		if err != nil {
			return fmt.Errorf("%q to %s: %w", p.Name(), d.Name(), err)
		}
		if err := p.Relayout(dt); err != nil {
			return err
		}
	}
	return nil
}

// checkParams reports every missing, wrongly sized or unknown entry of
// params for cfg at once.
func checkParams(cfg Config, params map[string][]float32) error {
	var errs []error
	known := map[string]bool{}
	for _, p := range cfg.Params() {
		known[p.Name] = true
		data, ok := params[p.Name]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("%w: New: no initial value for %q", ErrConfig, p.Name))
		case len(data) != p.Numel():
			errs = append(errs, fmt.Errorf("%w: New: %q has %d values, shape %v needs %d", ErrConfig, p.Name, len(data), p.Shape, p.Numel()))
		}
	}
	for name := range params {
		if !known[name] {
			errs = append(errs, fmt.Errorf("%w: New: initial value for unknown parameter %q", ErrConfig, name))
		}
	}
	return errors.Join(errs...)
}

// Plan is the tensor-parallel plan of the model (Megatron's layout):
// vocab-parallel token embedding, colwise q|k|v (by heads) and MLP fc,
// rowwise attention and MLP projections, and a colwise lm_head whose
// vocab-sharded logits go to a cross-entropy that never gathers them.
// With sp, activations outside the tensor-parallel regions are sharded on
// the sequence dim (LayerNorms run on sequence shards; the regions are
// entered by an all-gather and left by a reduce-scatter), and ReduceGrads
// must sum the LayerNorm gradients over the axis after backward.
func Plan(sp bool) tp.Plan {
	if !sp {
		return tp.Plan{
			{Pattern: "wte", Style: tp.RowwiseParallel{}},
			{Pattern: "h.*.attn.qkv", Style: tp.ColwiseParallel{}},
			{Pattern: "h.*.attn.proj", Style: tp.RowwiseParallel{}},
			{Pattern: "h.*.mlp.fc", Style: tp.ColwiseParallel{}},
			{Pattern: "h.*.mlp.proj", Style: tp.RowwiseParallel{}},
			{Pattern: "lm_head", Style: tp.ColwiseParallel{}},
		}
	}
	seq := placement.Shard(1)
	return tp.Plan{
		{Pattern: "wte", Style: tp.RowwiseParallel{Output: seq}},
		{Pattern: "wpe", Style: tp.PrepareModuleOutput{Layout: seq}},
		{Pattern: "h.*.ln1", Style: tp.SequenceParallel{}},
		{Pattern: "h.*.attn.qkv", Style: tp.ColwiseParallel{}},
		{Pattern: "h.*.attn.proj", Style: tp.RowwiseParallel{Output: seq}},
		{Pattern: "h.*.ln2", Style: tp.SequenceParallel{}},
		{Pattern: "h.*.mlp.fc", Style: tp.ColwiseParallel{}},
		{Pattern: "h.*.mlp.proj", Style: tp.RowwiseParallel{Output: seq}},
		{Pattern: "ln_f", Style: tp.SequenceParallel{}},
		{Pattern: "lm_head", Style: tp.ColwiseParallel{}},
	}
}

// Config returns the model's shape.
func (md *Model) Config() Config { return md.cfg }

// Params returns the parameter leaves in param_order, which is the module
// tree's Walk order (the current leaves: Parallelize replaces the ones it
// reshards).
func (md *Model) Params() []*autograd.Value {
	ps, err := parallel.Params(md)
	if err != nil {
		return nil // unreachable: New builds no nil module
	}
	return ps
}

// Names returns the parameter names in param_order.
func (md *Model) Names() []string {
	ps := md.Params()
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name()
	}
	return names
}

// Param returns the leaf of the parameter called name, or nil.
func (md *Model) Param(name string) *autograd.Value {
	for _, p := range md.Params() {
		if p.Name() == name {
			return p
		}
	}
	return nil
}

// ZeroGrad drops every parameter's accumulated gradient.
func (md *Model) ZeroGrad() {
	for _, p := range md.Params() {
		p.ZeroGrad()
	}
}

// Inputs lays out a batch's token ids and targets ([B, T] each) on the
// model's mesh with the given placements (nil: Replicate on every axis),
// ready for Forward. Each rank keeps its block; nothing is communicated.
func (md *Model) Inputs(b tinygpt.Batch, places []placement.Placement) (x, y *autograd.Indices, err error) {
	if places == nil {
		places = make([]placement.Placement, md.mesh.NDim())
		for i := range places {
			places[i] = placement.Replicate()
		}
	}
	shape := []int{b.B, b.T}
	if x, err = autograd.IndicesFromFull(md.mesh, shape, places, b.X); err != nil {
		return nil, nil, fmt.Errorf("gpt: inputs: %w", err)
	}
	if y, err = autograd.IndicesFromFull(md.mesh, shape, places, b.Y); err != nil {
		return nil, nil, fmt.Errorf("gpt: targets: %w", err)
	}
	return x, y, nil
}

// Forward records the model on tape (which must be the tape given to New)
// for token ids x [B, T] (T ≤ SeqLen) and returns the mean cross-entropy
// over all B·T positions against the targets y, laid out like x (shape
// [B, T] or [B·T]). It implements reference/TINY_GPT.md §3.2:
//
//	h = wte[x] + wpe[t]
//	per block: h += proj(attn(LN1(h))); h += mlp.proj(GELU(fc(LN2(h))))
//	loss = CE(LN_f(h) · lm_headᵀ, y)
//
// The fused qkv output splits into q, k and v blocks of D channels, each
// split into H heads of Dh = D/H contiguous channels; attention is causal
// with scale 1/sqrt(Dh); GELU is the erf form; LayerNorm uses the biased
// variance and LNEps. Logits sharded on the vocab dim (a colwise
// lm_head) go to tp.VocabParallelCrossEntropy on that axis; the
// only communication is what the modules' styles asked for.
func (md *Model) Forward(ctx context.Context, tape *autograd.Tape, x, y *autograd.Indices) (*autograd.Value, error) {
	loss, err := md.forward(ctx, tape, x, y)
	if err == nil {
		// The root's output hooks see the loss: the end of its forward.
		loss, err = md.Output(ctx, loss)
	}
	if err != nil {
		return nil, fmt.Errorf("gpt: Forward: %w", err)
	}
	return loss, nil
}

func (md *Model) forward(ctx context.Context, tape *autograd.Tape, x, y *autograd.Indices) (*autograd.Value, error) {
	if tape != md.tape {
		return nil, errors.New("the tape is not the one the model's parameters live on")
	}
	if x == nil || y == nil {
		return nil, errors.New("nil ids or targets")
	}
	xs := x.Shape()
	if len(xs) != 2 {
		return nil, fmt.Errorf("ids have shape %v; want [B, T]", xs)
	}
	B, T := xs[0], xs[1]
	if T < 1 || T > md.cfg.SeqLen {
		return nil, fmt.Errorf("sequence length %d outside [1, %d]", T, md.cfg.SeqLen)
	}
	switch ys := y.Shape(); {
	case len(ys) == 2 && ys[0] == B && ys[1] == T, len(ys) == 1 && ys[0] == B*T:
	default:
		return nil, fmt.Errorf("targets have shape %v for ids %v", ys, xs)
	}

	if err := md.Enter(ctx); err != nil {
		return nil, err
	}
	h, err := md.embed(ctx, x)
	if err != nil {
		return nil, err
	}
	if h, err = md.h.Input(ctx, h); err != nil {
		return nil, fmt.Errorf("blocks' input: %w", err)
	}
	for l, b := range md.Blocks {
		if h, err = b.Forward(ctx, h); err != nil {
			return nil, fmt.Errorf("block %d: %w", l, err)
		}
	}
	if h, err = md.h.Output(ctx, h); err != nil {
		return nil, fmt.Errorf("blocks' output: %w", err)
	}
	return md.head(ctx, h, y)
}

// embed is the embeddings: wte[x] + wpe[t] for ids x [B, T].
func (md *Model) embed(ctx context.Context, x *autograd.Indices) (*autograd.Value, error) {
	xs := x.Shape()
	if len(xs) != 2 {
		return nil, fmt.Errorf("ids have shape %v; want [B, T]", xs)
	}
	B, T := xs[0], xs[1]
	// Position ids t, laid out like x.
	pos := make([]int64, B*T)
	for i := range pos {
		pos[i] = int64(i % T)
	}
	posIdx, err := autograd.IndicesFromFull(md.mesh, xs, x.Placements(), pos, orderOpts(x)...)
	if err != nil {
		return nil, fmt.Errorf("position ids: %w", err)
	}
	tok, err := md.WTE.Forward(ctx, x)
	if err != nil {
		return nil, err
	}
	pe, err := md.WPE.Forward(ctx, posIdx)
	if err != nil {
		return nil, err
	}
	return autograd.Add(tok, pe)
}

// head is the final LayerNorm, lm_head and the mean cross-entropy of h
// [B, T, D] against y ([B, T] or [B·T]).
func (md *Model) head(ctx context.Context, h *autograd.Value, y *autograd.Indices) (*autograd.Value, error) {
	hs := h.Spec().Shape()
	if len(hs) != 3 || y == nil {
		return nil, fmt.Errorf("head: activation of shape %v (want [B, T, D]) or nil targets", hs)
	}
	B, T := hs[0], hs[1]
	h, err := md.LNF.Forward(ctx, h)
	if err != nil {
		return nil, err
	}
	logits, err := md.LMHead.Forward(ctx, h)
	if err != nil {
		return nil, err
	}
	tgt, vocab := y, 2
	if seq := logits.Spec().Order(1); len(seq) > 0 {
		// A sharded sequence (context parallelism): [B·T] is no layout of
		// the rows when B > 1, so the loss takes [B, T, V] as it is.
		if len(y.Shape()) != 2 {
			return nil, fmt.Errorf("targets have shape %v; with the sequence sharded over %v they must be [B, T] like the ids", y.Shape(), seq)
		}
	} else {
		if logits, err = autograd.Reshape(logits, B*T, md.cfg.Vocab); err != nil {
			return nil, err
		}
		vocab = 1
		if len(y.Shape()) == 2 {
			if tgt, err = autograd.NewIndices(md.mesh, []int{B * T}, y.Placements(), y.Local(), orderOpts(y)...); err != nil {
				return nil, fmt.Errorf("targets: %w", err)
			}
		}
	}
	// Logits sharded on the vocab dim need the cross-entropy that reduces
	// over that axis.
	names := md.mesh.Names()
	for a, p := range logits.Spec().Placements() {
		if p.IsShard() && p.Dim() == vocab {
			return tp.VocabParallelCrossEntropy(ctx, logits, tgt, names[a])
		}
	}
	return autograd.CrossEntropy(logits, tgt)
}

// orderOpts keeps the shard order of dim 0 (a batch dim sharded by several
// axes) when ids are re-laid out.
func orderOpts(ix *autograd.Indices) []placement.SpecOption {
	var opts []placement.SpecOption
	for d := range ix.Shape() {
		if o := ix.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	return opts
}

// Loss is a convenience for a scalar loss value: its local block as a
// float64 (on a 1-rank mesh, or where the loss is Replicate, the global
// loss; where it is Partial(sum), this rank's share).
func Loss(v *autograd.Value) (float64, error) {
	if v == nil || v.Data() == nil {
		return math.NaN(), errors.New("gpt: Loss: nil value")
	}
	switch d := v.Data().LocalData().(type) {
	case []float32:
		if len(d) == 1 {
			return float64(d[0]), nil
		}
	case []float64:
		if len(d) == 1 {
			return d[0], nil
		}
	}
	return math.NaN(), fmt.Errorf("gpt: Loss: %v is not a scalar block", v.Data())
}

// RandomInit returns the initial values WithSeed(seed) gives, by parameter
// name: N(0, InitStd²) from a PCG seeded with seed for the normal ones
// (in param_order), ones for LayerNorm weights and zeros for biases. Two
// runs given the same map start from the same model whatever their
// layouts. The reference's PyTorch stream is not part of the spec: parity
// runs load the fixture's init.* tensors instead.
func RandomInit(cfg Config, seed uint64) map[string][]float32 {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15)) // parallel.Normal's stream
	out := make(map[string][]float32)
	for _, p := range cfg.Params() {
		d := make([]float32, p.Numel())
		switch p.Init {
		case tinygpt.InitNormal:
			for i := range d {
				d[i] = float32(rng.NormFloat64() * cfg.InitStd)
			}
		case tinygpt.InitOnes:
			for i := range d {
				d[i] = 1
			}
		}
		out[p.Name] = d
	}
	return out
}
