package gpt

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/internal/randtok"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Stage is the part of a GPT one pipeline stage holds: blocks [First,
// Last), with the embeddings when First is 0 and the final LayerNorm and
// lm_head when Last is Layers. It builds only those parameters, named as
// in Model, so a pipeline's stages together hold exactly the Model's.
type Stage struct {
	parallel.Hooks
	cfg         Config
	tape        *autograd.Tape
	mesh        *mesh.Mesh
	First, Last int
	WTE, WPE    *parallel.Embedding // nil unless First == 0
	Blocks      []*Block
	LNF         *parallel.LayerNorm // nil unless Last == Layers
	LMHead      *parallel.Linear
}

// StageOption configures NewStage.
type StageOption func(*stageConfig)

type stageConfig struct {
	cp     string
	cpSet  bool // WithStageContextParallel was given: an empty axis is refused, not ignored
	cpOpts []cp.Option
}

// WithStageContextParallel makes every block's attention of the stage
// cp.Attention over the named axis of the stage's mesh, with opts (the
// method, cp.WithMethod; Hybrid's inner axis, cp.WithUlyssesAxis), as
// WithContextParallel does for a Trainer. The caller lays the token ids
// and targets out with their sequence dim sharded over the axis
// (placement.ShardBalanced(1) for the causal load balancing, or
// placement.Shard(1)); the activations crossing stages keep that layout
// (pp.Transport sends it with them), the last stage's loss is the mean
// cross-entropy over [B, T, V] and is Partial(sum) over the axis, and the
// parameters' gradients are Partial(sum) over it after backward, summed
// with the data-parallel ones by tp.ReduceGrads (at the schedule's
// ReduceGrad actions). An axis of size 1 is no context parallelism.
func WithStageContextParallel(axis string, opts ...cp.Option) StageOption {
	return func(c *stageConfig) { c.cp, c.cpSet, c.cpOpts = axis, true, append(c.cpOpts, opts...) }
}

// NewStage builds blocks [first, last) of the GPT cfg on tape and m (the
// stage's own mesh), with the embeddings on the first stage and the head
// on the last, on the tape's device, initialised from params by name (every name the stage
// holds must be there: RandomInit gives the whole model's), with
// context parallelism when opts say (WithStageContextParallel). Errors
// wrap ErrConfig (an unknown cp axis names the mesh's axes; a cp layout
// CheckLayout refuses, such as Ulysses over more ranks than divide the
// heads, is its error).
func NewStage(tape *autograd.Tape, m *mesh.Mesh, cfg Config, first, last int, params map[string][]float32, opts ...StageOption) (*Stage, error) {
	if tape == nil || m == nil {
		return nil, fmt.Errorf("%w: NewStage: nil tape or mesh", ErrConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("gpt: NewStage: %w", err)
	}
	if first < 0 || last < first || last > cfg.Layers {
		return nil, fmt.Errorf("%w: NewStage: blocks [%d, %d) of %d", ErrConfig, first, last, cfg.Layers)
	}
	var sc stageConfig
	for _, o := range opts {
		o(&sc)
	}
	ncp := 1
	if sc.cpSet {
		n, err := m.AxisSize(sc.cp)
		if err != nil {
			return nil, fmt.Errorf("%w: NewStage: WithStageContextParallel(%q): the stage mesh's axes are %v", ErrConfig, sc.cp, m.Names())
		}
		ncp = n
		method, err := cp.MethodOf(sc.cpOpts...)
		if err != nil {
			return nil, fmt.Errorf("%w: NewStage: WithStageContextParallel: %w", ErrConfig, err)
		}
		// The checks of a Trainer's layout that a stage can make before
		// tensor parallelism and the batch's layout are known.
		if err := cfg.CheckLayout(0, Layout{DP: 1, TP: 1, CP: ncp, CPMethod: method, CPPlain: true}); err != nil {
			return nil, fmt.Errorf("NewStage: WithStageContextParallel(%q): %w", sc.cp, err)
		}
	}
	init := parallel.ByName(params)
	named := func(name string, extra ...parallel.LayerOption) []parallel.LayerOption {
		return append([]parallel.LayerOption{parallel.WithName(name), parallel.WithInit(init), parallel.WithBiasInit(init)}, extra...)
	}
	norm := func(name string) (*parallel.LayerNorm, error) {
		return parallel.NewLayerNorm(tape, m, cfg.Width, parallel.WithName(name), parallel.WithInit(init), parallel.WithBiasInit(init), parallel.WithEps(cfg.LNEps))
	}
	s := &Stage{cfg: cfg, tape: tape, mesh: m, First: first, Last: last}
	var err error
	if first == 0 {
		if s.WTE, err = parallel.NewEmbedding(tape, m, cfg.Vocab, cfg.Width, parallel.WithName(tinygpt.ParamWTE), parallel.WithInit(init)); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		if s.WPE, err = parallel.NewEmbedding(tape, m, cfg.SeqLen, cfg.Width, parallel.WithName(tinygpt.ParamWPE), parallel.WithInit(init)); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
	}
	for l := first; l < last; l++ {
		p := "h." + strconv.Itoa(l) + "."
		b := &Block{}
		if b.LN1, err = norm(p + "ln1"); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		if b.Attn, err = parallel.NewAttention(tape, m, cfg.Width, cfg.Heads, named(p+"attn")...); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		if b.LN2, err = norm(p + "ln2"); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		if b.MLP, err = parallel.NewMLP(tape, m, cfg.Width, cfg.MLPWidth, named(p+"mlp")...); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		s.Blocks = append(s.Blocks, b)
	}
	if last == cfg.Layers {
		if s.LNF, err = norm("ln_f"); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
		if s.LMHead, err = parallel.NewLinear(tape, m, cfg.Width, cfg.Vocab, named("lm_head", parallel.WithBias(false))...); err != nil {
			return nil, fmt.Errorf("gpt: NewStage: %w", err)
		}
	}
	if ncp > 1 {
		axis, cpOpts := sc.cp, slices.Clone(sc.cpOpts)
		for _, b := range s.Blocks {
			b.Attn.Core = func(ctx context.Context, q, k, v *autograd.Value) (*autograd.Value, error) {
				return cp.Attention(ctx, q, k, v, axis, cpOpts...)
			}
		}
	}
	if err := placeOn(tape.Device(), s.Params()); err != nil {
		return nil, fmt.Errorf("gpt: NewStage: %w", err)
	}
	return s, nil
}

// Children returns the stage's modules under the Model's paths (wte,
// wpe, h.<l> with l the global block index, ln_f, lm_head), so that
// Plan, applied with parallel.Parallelize, lays a stage out as it lays
// out the Model.
func (s *Stage) Children() []parallel.Child {
	var out []parallel.Child
	if s.WTE != nil {
		out = append(out, parallel.Child{Name: "wte", Module: s.WTE}, parallel.Child{Name: "wpe", Module: s.WPE})
	}
	h := &stageBlocks{first: s.First, list: s.Blocks}
	out = append(out, parallel.Child{Name: "h", Module: h})
	if s.LNF != nil {
		out = append(out, parallel.Child{Name: "ln_f", Module: s.LNF}, parallel.Child{Name: "lm_head", Module: s.LMHead})
	}
	return out
}

// stageBlocks is a stage's "h" container: its blocks named by their
// global index.
type stageBlocks struct {
	parallel.Hooks
	first int
	list  []*Block
}

// Children returns the blocks, named first … first+len−1.
func (bs *stageBlocks) Children() []parallel.Child {
	out := make([]parallel.Child, len(bs.list))
	for i, b := range bs.list {
		out[i] = parallel.Child{Name: strconv.Itoa(bs.first + i), Module: b}
	}
	return out
}

// Params returns the stage's parameters in the Model's order.
func (s *Stage) Params() []*autograd.Value {
	var out []*autograd.Value
	add := func(m parallel.Module) {
		if ps, err := parallel.Params(m); err == nil {
			out = append(out, ps...)
		}
	}
	if s.WTE != nil {
		add(s.WTE)
		add(s.WPE)
	}
	for _, b := range s.Blocks {
		add(b)
	}
	if s.LNF != nil {
		add(s.LNF)
		add(s.LMHead)
	}
	return out
}

// Forward records the stage for one micro-batch: on the first stage from
// token ids x [B, T] (h is ignored), elsewhere from the previous stage's
// activation h [B, T, D]; through its blocks; and on the last stage the
// mean cross-entropy against y scaled by weight (a micro-batch's share of
// the batch: pp.MicroBatches), else the activation to send on. It is the
// same computation as Model.Forward split at block boundaries.
func (s *Stage) Forward(ctx context.Context, h *autograd.Value, x, y *autograd.Indices, weight float64) (*autograd.Value, error) {
	switch {
	case s.First == 0 && x == nil:
		return nil, fmt.Errorf("%w: Stage.Forward: the first stage needs token ids", ErrConfig)
	case s.First != 0 && h == nil:
		return nil, fmt.Errorf("%w: Stage.Forward: stage [%d, %d) needs the previous stage's activation", ErrConfig, s.First, s.Last)
	}
	out, err := s.forward(ctx, h, x, y, weight)
	if err == nil {
		// The stage's own hooks (FSDP's root unit: FullyShard) see its
		// output: the end of its forward.
		out, err = s.Output(ctx, out)
	}
	if err != nil {
		return nil, fmt.Errorf("gpt: Stage.Forward: %w", err)
	}
	return out, nil
}

// forward is Forward's computation, from the stage's enter hook on
// (FSDP's root unit gathers there); Forward runs the output hook.
func (s *Stage) forward(ctx context.Context, h *autograd.Value, x, y *autograd.Indices, weight float64) (*autograd.Value, error) {
	if err := s.Enter(ctx); err != nil {
		return nil, err
	}
	var err error
	if s.First == 0 {
		md := &Model{cfg: s.cfg, tape: s.tape, mesh: s.mesh, WTE: s.WTE, WPE: s.WPE}
		if h, err = md.embed(ctx, x); err != nil {
			return nil, err
		}
	}
	for i, b := range s.Blocks {
		if h, err = b.Forward(ctx, h); err != nil {
			return nil, fmt.Errorf("block %d: %w", s.First+i, err)
		}
	}
	if s.LNF == nil {
		return h, nil
	}
	md := &Model{cfg: s.cfg, tape: s.tape, mesh: s.mesh, LNF: s.LNF, LMHead: s.LMHead}
	loss, err := md.head(ctx, h, y)
	if err != nil {
		return nil, err
	}
	if weight == 1 {
		return loss, nil
	}
	return autograd.Scale(loss, weight)
}

// Batches returns the batches a Trainer for cfg with the run run draws,
// in order: the reference's sampler on its corpus, or random tokens from
// seed when random is set (WithRandomTokens). A pipeline's ranks each
// draw them to feed their stages, as every rank of a Trainer does.
// Errors wrap ErrConfig.
func Batches(cfg Config, run tinygpt.Config, random bool, seed uint64) (interface{ Next() tinygpt.Batch }, error) {
	data := cfg.reference(run)
	data.Steps = max(data.Steps, 1)
	if err := data.Validate(); err != nil {
		return nil, fmt.Errorf("%w: Batches: %w", ErrConfig, err)
	}
	if random {
		return randtok.New(seed, data.B, data.T, data.V), nil
	}
	s, err := tinygpt.NewSampler(data, tinygpt.Corpus(data))
	if err != nil {
		return nil, fmt.Errorf("gpt: Batches: %w", err)
	}
	return s, nil
}

// Plan is the Model's Plan (sp as there) restricted to the modules the
// stage holds, for parallel.Parallelize on the stage (which refuses a rule
// that matches nothing).
func (s *Stage) Plan(sp bool) tp.Plan {
	var out tp.Plan
	for _, r := range Plan(sp) {
		switch {
		case strings.HasPrefix(r.Pattern, "wte"), strings.HasPrefix(r.Pattern, "wpe"):
			if s.WTE == nil {
				continue
			}
		case strings.HasPrefix(r.Pattern, "h."):
			if len(s.Blocks) == 0 {
				continue
			}
		default: // ln_f, lm_head
			if s.LNF == nil {
				continue
			}
		}
		out = append(out, r)
	}
	return out
}
