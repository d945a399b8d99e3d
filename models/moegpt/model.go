package moegpt

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Option configures New (and NewTrainer, through WithModel).
type Option func(*options)

type options struct {
	dp          string
	blas        *kernels.BLAS
	diagnostics bool
	collectives bool
}

// WithDataParallel names the data-parallel mesh axis: the tokens are
// sharded over it and the expert-parallel axis. Default: none (an axis the
// mesh lacks is an error).
func WithDataParallel(axis string) Option { return func(o *options) { o.dp = axis } }

// WithBLAS runs the experts' GEMMs on b (default kernels.Default()); give
// the tape the same one (autograd.WithBLAS).
func WithBLAS(b *kernels.BLAS) Option { return func(o *options) { o.blas = b } }

// WithDiagnostics asks static-capacity dispatches to exchange their counts
// anyway, so that moe.Stats hold the send matrix (ragged dispatches always
// have it), and every dispatch to time the wait for the slowest rank
// before its later passes, moe.Timings.Wait (moe.DispatchConfig.Diagnostics).
func WithDiagnostics() Option { return func(o *options) { o.diagnostics = true } }

// WithCollectives moves the token rows by all-to-all-v even where the
// ranks share memory (moe.DispatchConfig.Collectives): the path MPI and
// NCCL take, run in process.
func WithCollectives() Option { return func(o *options) { o.collectives = true } }

// Model is the MoE transformer. Its parameters are leaves of one tape
// (the tape given to New), laid out as the package documentation says.
type Model struct {
	cfg    Config
	tape   *autograd.Tape
	mesh   *mesh.Mesh
	tokens []placement.Placement // layout of the token ids and rows
	params []*autograd.Value     // in Config.Params order
	expert []bool                // params[i] is an expert parameter
	group  []string              // the token axes, in mesh order

	// WTE and WPE are the token and position embeddings.
	WTE, WPE *parallel.Embedding
	// Blocks are the transformer blocks.
	Blocks []*Block
	// LNF is the final LayerNorm.
	LNF *parallel.LayerNorm
	// LMHead is the output projection (no bias, untied).
	LMHead *parallel.Linear
}

// Block is one pre-LN block with an MoE MLP: h += attn(LN1(h)); h +=
// moe(LN2(h)).
type Block struct {
	// LN1 and LN2 are the block's LayerNorms.
	LN1, LN2 *parallel.LayerNorm
	// Attn is causal multi-head self-attention.
	Attn *parallel.Attention
	// MoE is the mixture-of-experts MLP.
	MoE *moe.Layer
}

// Forward runs the block on h [B, T, D] and returns the new h and the MoE
// layer's output (its routing, losses and dispatch handle).
func (b *Block) Forward(ctx context.Context, h *autograd.Value) (*autograd.Value, *moe.LayerOutput, error) {
	a, err := b.LN1.Forward(ctx, h)
	if err != nil {
		return nil, nil, fmt.Errorf("ln1: %w", err)
	}
	o, err := b.Attn.Forward(ctx, a)
	if err != nil {
		return nil, nil, fmt.Errorf("attention: %w", err)
	}
	if h, err = autograd.Add(h, o); err != nil {
		return nil, nil, fmt.Errorf("attention residual: %w", err)
	}
	if a, err = b.LN2.Forward(ctx, h); err != nil {
		return nil, nil, fmt.Errorf("ln2: %w", err)
	}
	shape := a.Spec().Shape()
	rows, err := autograd.Reshape(a, shape[0]*shape[1], shape[2])
	if err != nil {
		return nil, nil, fmt.Errorf("tokens for the MoE layer: %w", err)
	}
	out, err := b.MoE.Forward(ctx, rows)
	if err != nil {
		return nil, nil, err
	}
	y, err := autograd.Reshape(out.Y, shape...)
	if err != nil {
		return nil, nil, fmt.Errorf("MoE output: %w", err)
	}
	if h, err = autograd.Add(h, y); err != nil {
		return nil, nil, fmt.Errorf("MoE residual: %w", err)
	}
	return h, out, nil
}

// New builds the model for cfg on tape and mesh m from init, which maps
// every parameter name of cfg.Params() to its full row-major float32
// value (RandomInit), with the experts sharded over the mesh axis ep (of
// size 1 for a one-rank run). Every rank keeps its block of each
// parameter (the expert parameters' local experts, the whole of the
// others); nothing is communicated. Missing, surplus or wrongly sized
// entries, an unknown axis and a layout CheckLayout rejects are errors
// wrapping ErrConfig. The blocks live on the tape's device
// (autograd.WithDevice; the host by default).
func New(tape *autograd.Tape, m *mesh.Mesh, cfg Config, init map[string][]float32, ep string, opts ...Option) (*Model, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	md, err := build(tape, m, cfg, init, ep, o)
	if err != nil {
		return nil, fmt.Errorf("moegpt: New: %w", err)
	}
	return md, nil
}

func build(tape *autograd.Tape, m *mesh.Mesh, cfg Config, init map[string][]float32, epAxis string, opts options) (*Model, error) {
	if tape == nil || m == nil {
		return nil, fmt.Errorf("%w: nil tape or mesh", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	names := m.Names()
	ep := slices.Index(names, epAxis)
	if ep < 0 {
		return nil, fmt.Errorf("%w: expert-parallel axis %q is not an axis of the mesh %v", ErrConfig, epAxis, m)
	}
	dp := 1
	if opts.dp != "" {
		i := slices.Index(names, opts.dp)
		if i < 0 || i == ep {
			return nil, fmt.Errorf("%w: data-parallel axis %q is not an axis of the mesh %v other than %q", ErrConfig, opts.dp, m, epAxis)
		}
		dp = m.Shape()[i]
	}
	if err := cfg.CheckLayout(0, dp, m.Shape()[ep]); err != nil { // the batch is the Trainer's
		return nil, err
	}
	md := &Model{cfg: cfg, tape: tape, mesh: m, tokens: make([]placement.Placement, len(names))}
	rep := make([]placement.Placement, len(names))
	expert := make([]placement.Placement, len(names))
	for a, name := range names {
		rep[a], expert[a], md.tokens[a] = placement.Replicate(), placement.Replicate(), placement.Replicate()
		if a == ep {
			expert[a] = placement.Shard(0)
		}
		if a == ep || (opts.dp != "" && name == opts.dp) {
			md.tokens[a] = placement.Shard(0)
			md.group = append(md.group, name)
		}
	}

	ps := cfg.Params()
	byName := make(map[string]*autograd.Value, len(ps))
	var errs []error
	for _, p := range ps {
		data, ok := init[p.Name]
		if !ok {
			errs = append(errs, fmt.Errorf("no initial value for %q", p.Name))
			continue
		}
		if len(data) != p.Numel() {
			errs = append(errs, fmt.Errorf("%q has %d values, shape %v needs %d", p.Name, len(data), p.Shape, p.Numel()))
			continue
		}
		places := rep
		if p.Expert {
			places = expert
		}
		spec, err := placement.NewSpec(m, p.Shape, comm.Float32, places)
		if err != nil {
			return nil, fmt.Errorf("%q: %w", p.Name, err)
		}
		dt, err := placement.FromFull(spec, data, placement.WithDevice(tape.Device())) // copies
		if err != nil {
			return nil, fmt.Errorf("%q: %w", p.Name, err)
		}
		v, err := tape.Param(p.Name, dt)
		if err != nil {
			return nil, err
		}
		byName[p.Name] = v
		md.params = append(md.params, v)
		md.expert = append(md.expert, p.Expert)
	}
	known := make(map[string]bool, len(ps))
	for _, p := range ps {
		known[p.Name] = true
	}
	for name := range init {
		if !known[name] {
			errs = append(errs, fmt.Errorf("initial value for unknown parameter %q", name))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}

	ln := func(w, b string) *parallel.LayerNorm {
		return &parallel.LayerNorm{Weight: byName[w], Bias: byName[b], Eps: cfg.LNEps}
	}
	md.WTE = &parallel.Embedding{Table: byName[ParamWTE]}
	md.WPE = &parallel.Embedding{Table: byName[ParamWPE]}
	rcfg := moe.RouterConfig{
		K: cfg.K, Renormalize: true, AuxCoef: cfg.AuxCoef, ZCoef: cfg.ZCoef,
		CapacityFactor: cfg.CapacityFactor, PadToCapacity: cfg.Pad,
	}
	// The layers run one after another, so they share one workspace.
	ws := new(moe.Workspace)
	for l := range cfg.L {
		p := func(suffix string) *autograd.Value { return byName[BlockParam(l, suffix)] }
		router, err := moe.NewRouter(p(BlockRouterW), rcfg)
		if err != nil {
			return nil, fmt.Errorf("block %d: %w", l, err)
		}
		experts, err := moe.NewExperts(epAxis, p(BlockExpertW1), p(BlockExpertB1), p(BlockExpertW2), p(BlockExpertB2))
		if err != nil {
			return nil, fmt.Errorf("block %d: %w", l, err)
		}
		experts.BLAS = opts.blas
		qkv := &parallel.Linear{Weight: p(BlockQKVW), Bias: p(BlockQKVB), Chunks: 3}
		md.Blocks = append(md.Blocks, &Block{
			LN1:  ln(BlockParam(l, BlockLN1W), BlockParam(l, BlockLN1B)),
			Attn: &parallel.Attention{QKV: qkv, Proj: &parallel.Linear{Weight: p(BlockProjW), Bias: p(BlockProjB)}, Heads: cfg.H},
			LN2:  ln(BlockParam(l, BlockLN2W), BlockParam(l, BlockLN2B)),
			MoE: &moe.Layer{Router: router, Experts: experts, Dispatch: moe.DispatchConfig{
				Axis: epAxis, Diagnostics: opts.diagnostics, Workspace: ws, Collectives: opts.collectives,
			}},
		})
	}
	md.LNF = ln(ParamLNFW, ParamLNFB)
	md.LMHead = &parallel.Linear{Weight: byName[ParamLMHead]}
	return md, nil
}

// Params returns the parameter leaves in Config.Params order.
func (md *Model) Params() []*autograd.Value { return slices.Clone(md.params) }

// ExpertParams returns the expert parameters (Shard(0) on the
// expert-parallel axis), in order.
func (md *Model) ExpertParams() []*autograd.Value { return md.pick(true) }

// ReplicatedParams returns the other parameters (Replicate on every
// axis), in order.
func (md *Model) ReplicatedParams() []*autograd.Value { return md.pick(false) }

func (md *Model) pick(expert bool) []*autograd.Value {
	var out []*autograd.Value
	for i, p := range md.params {
		if md.expert[i] == expert {
			out = append(out, p)
		}
	}
	return out
}

// ZeroGrad drops every parameter's accumulated gradient.
func (md *Model) ZeroGrad() {
	for _, p := range md.params {
		p.ZeroGrad()
	}
}

// Inputs lays out a batch's token ids and targets ([B, T] each) on the
// model's mesh, sharded over the token axes; each rank keeps its rows
// and nothing is communicated.
func (md *Model) Inputs(b tinygpt.Batch) (x, y *autograd.Indices, err error) {
	shape := []int{b.B, b.T}
	if x, err = autograd.IndicesFromFull(md.mesh, shape, md.tokens, b.X); err != nil {
		return nil, nil, fmt.Errorf("moegpt: inputs: %w", err)
	}
	if y, err = autograd.IndicesFromFull(md.mesh, []int{b.B * b.T}, md.tokens, b.Y); err != nil {
		return nil, nil, fmt.Errorf("moegpt: targets: %w", err)
	}
	return x, y, nil
}

// Output is what one Forward records.
type Output struct {
	// Loss is CE plus every layer's auxiliary losses: the value to
	// differentiate. Like CE it is Partial(sum) on the token axes.
	Loss *autograd.Value
	// CE is the mean cross-entropy over all B·T positions.
	CE *autograd.Value
	// Layers are the MoE layers' outputs, one per block: routing, losses
	// (Routing.Aux, Routing.Z) and dispatch handle (Handle.Stats).
	Layers []*moe.LayerOutput
}

// Forward records the model on its tape for token ids x [B, T] and
// targets y [B·T] (from Inputs) and returns the losses. It is collective
// over the mesh: every rank calls it in the same order.
func (md *Model) Forward(ctx context.Context, x, y *autograd.Indices) (*Output, error) {
	out, err := md.forward(ctx, x, y)
	if err != nil {
		return nil, fmt.Errorf("moegpt: Forward: %w", err)
	}
	return out, nil
}

func (md *Model) forward(ctx context.Context, x, y *autograd.Indices) (*Output, error) {
	if x == nil || y == nil {
		return nil, errors.New("nil ids or targets")
	}
	xs := x.Shape()
	if len(xs) != 2 || xs[1] < 1 || xs[1] > md.cfg.T {
		return nil, fmt.Errorf("ids have shape %v; want [B, T] with 1 ≤ T ≤ %d", xs, md.cfg.T)
	}
	B, T := xs[0], xs[1]
	if ys := y.Shape(); len(ys) != 1 || ys[0] != B*T {
		return nil, fmt.Errorf("targets have shape %v; want [%d]", ys, B*T)
	}
	pos := make([]int64, B*T)
	for i := range pos {
		pos[i] = int64(i % T)
	}
	posIdx, err := autograd.IndicesFromFull(md.mesh, xs, x.Placements(), pos)
	if err != nil {
		return nil, fmt.Errorf("position ids: %w", err)
	}
	tok, err := md.WTE.Forward(ctx, x)
	if err != nil {
		return nil, fmt.Errorf("token embedding: %w", err)
	}
	pe, err := md.WPE.Forward(ctx, posIdx)
	if err != nil {
		return nil, fmt.Errorf("position embedding: %w", err)
	}
	h, err := autograd.Add(tok, pe)
	if err != nil {
		return nil, fmt.Errorf("embeddings: %w", err)
	}
	out := &Output{}
	for l, b := range md.Blocks {
		var lo *moe.LayerOutput
		if h, lo, err = b.Forward(ctx, h); err != nil {
			return nil, fmt.Errorf("block %d: %w", l, err)
		}
		out.Layers = append(out.Layers, lo)
	}
	if h, err = md.LNF.Forward(ctx, h); err != nil {
		return nil, fmt.Errorf("ln_f: %w", err)
	}
	logits, err := md.LMHead.Forward(ctx, h)
	if err != nil {
		return nil, fmt.Errorf("lm_head: %w", err)
	}
	if logits, err = autograd.Reshape(logits, B*T, md.cfg.V); err != nil {
		return nil, fmt.Errorf("logits: %w", err)
	}
	if out.CE, err = autograd.CrossEntropy(logits, y); err != nil {
		return nil, fmt.Errorf("cross-entropy: %w", err)
	}
	out.Loss = out.CE
	for l, lo := range out.Layers {
		if out.Loss, err = lo.AddLosses(out.Loss); err != nil {
			return nil, fmt.Errorf("block %d losses: %w", l, err)
		}
	}
	return out, nil
}

// localScalar returns the local block of a scalar value (this rank's
// share where it is Partial(sum)); 0 for a nil value.
func localScalar(v *autograd.Value) (float64, error) {
	if v == nil {
		return 0, nil
	}
	// On a device the block comes to the host first (one element).
	dt, err := v.Data().To(device.Host())
	if err != nil {
		return 0, err
	}
	switch d := dt.LocalData().(type) {
	case []float32:
		if len(d) == 1 {
			return float64(d[0]), nil
		}
	case []float64:
		if len(d) == 1 {
			return d[0], nil
		}
	}
	return 0, fmt.Errorf("%v is not a scalar block", v.Spec())
}
