// Package gpt is the tiny pre-LayerNorm GPT of
// ../shared/reference/TINY_GPT.md §3 on loom's autograd: a Model holds the
// parameters (tinygpt.Config.Params, in param_order) as autograd leaves and
// Forward records the loss of one batch on the model's tape.
//
// Everything runs in the parameters' dtype (float32 for the reference), and
// every parameter is Replicate on every mesh axis. The token ids may be
// Replicate (one rank, or every rank computing the whole batch) or sharded
// on the batch dim (data parallelism); the loss is then Partial(sum) on the
// sharding axes and the parameter gradients Partial(sum) there as well.
package gpt

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/tinygpt"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Model is the tiny GPT of TINY_GPT.md §3: token and position embeddings,
// L pre-LN transformer blocks, a final LayerNorm and an untied lm_head
// without bias. Its parameters are leaves of one tape (the tape given to
// New), Replicate on every mesh axis, in param_order.
type Model struct {
	cfg    tinygpt.Config
	tape   *autograd.Tape
	mesh   *mesh.Mesh
	names  []string
	params []*autograd.Value
	byName map[string]*autograd.Value
}

// New builds the model for cfg on tape and mesh m from init, which maps
// every parameter name of cfg.Params() to its row-major float32 data (for
// parity, the fixture's init.* tensors). Each parameter becomes a leaf
// (tape.Param) laid out Replicate on every mesh axis; its data is copied.
// Missing, surplus or wrongly sized entries are errors.
func New(tape *autograd.Tape, m *mesh.Mesh, cfg tinygpt.Config, init map[string][]float32) (*Model, error) {
	if tape == nil || m == nil {
		return nil, errors.New("gpt: New: nil tape or mesh")
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("gpt: %w", err)
	}
	ps := cfg.Params()
	md := &Model{cfg: cfg, tape: tape, mesh: m, byName: make(map[string]*autograd.Value, len(ps))}
	rep := make([]placement.Placement, m.NDim())
	for i := range rep {
		rep[i] = placement.Replicate()
	}
	var errs []error
	for _, p := range ps {
		data, ok := init[p.Name]
		if !ok {
			errs = append(errs, fmt.Errorf("gpt: New: no initial value for %q", p.Name))
			continue
		}
		if len(data) != p.Numel() {
			errs = append(errs, fmt.Errorf("gpt: New: %q has %d values, shape %v needs %d", p.Name, len(data), p.Shape, p.Numel()))
			continue
		}
		spec, err := placement.NewSpec(m, p.Shape, comm.Float32, rep)
		if err != nil {
			return nil, fmt.Errorf("gpt: New: %q: %w", p.Name, err)
		}
		dt, err := placement.NewLocal(spec, append([]float32(nil), data...))
		if err != nil {
			return nil, fmt.Errorf("gpt: New: %q: %w", p.Name, err)
		}
		v, err := tape.Param(p.Name, dt)
		if err != nil {
			return nil, fmt.Errorf("gpt: New: %w", err)
		}
		md.names = append(md.names, p.Name)
		md.params = append(md.params, v)
		md.byName[p.Name] = v
	}
	if len(init) != len(ps) {
		for name := range init {
			if _, ok := md.byName[name]; !ok {
				if _, err := cfg.Param(name); err != nil {
					errs = append(errs, fmt.Errorf("gpt: New: initial value for unknown parameter %q", name))
				}
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return md, nil
}

// Config returns the model's configuration.
func (md *Model) Config() tinygpt.Config { return md.cfg }

// Tape returns the tape the parameters live on; Forward records on it.
func (md *Model) Tape() *autograd.Tape { return md.tape }

// Mesh returns the mesh the parameters are laid out on.
func (md *Model) Mesh() *mesh.Mesh { return md.mesh }

// Params returns the parameter leaves in param_order. The slice is a copy;
// the leaves are the model's own.
func (md *Model) Params() []*autograd.Value { return append([]*autograd.Value(nil), md.params...) }

// Names returns the parameter names in param_order.
func (md *Model) Names() []string { return append([]string(nil), md.names...) }

// Param returns the leaf of the parameter called name, or nil.
func (md *Model) Param(name string) *autograd.Value { return md.byName[name] }

// ZeroGrad drops every parameter's accumulated gradient.
func (md *Model) ZeroGrad() {
	for _, p := range md.params {
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
// for token ids x [B, T] (T ≤ cfg.T) and returns the mean cross-entropy
// over all B·T positions against the targets y, laid out like x (shape
// [B, T] or [B·T]). It implements TINY_GPT.md §3.2:
//
//	h = wte[x] + wpe[t]
//	per block: h += proj(attn(LN1(h))); h += mlp.proj(GELU(fc(LN2(h))))
//	loss = CE(LN_f(h) · lm_headᵀ, y)
//
// The fused qkv output splits into q, k and v blocks of D channels, each
// split into H heads of Dh = D/H contiguous channels; attention is causal
// with scale 1/sqrt(Dh); GELU is the erf form; LayerNorm uses the biased
// variance and cfg.LNEps.
func (md *Model) Forward(tape *autograd.Tape, x, y *autograd.Indices) (*autograd.Value, error) {
	if tape != md.tape {
		return nil, errors.New("gpt: Forward: the tape is not the one the model's parameters live on")
	}
	if x == nil || y == nil {
		return nil, errors.New("gpt: Forward: nil ids or targets")
	}
	cfg := md.cfg
	xs := x.Shape()
	if len(xs) != 2 {
		return nil, fmt.Errorf("gpt: Forward: ids have shape %v; want [B, T]", xs)
	}
	B, T := xs[0], xs[1]
	if T < 1 || T > cfg.T {
		return nil, fmt.Errorf("gpt: Forward: sequence length %d outside [1, %d]", T, cfg.T)
	}
	switch ys := y.Shape(); {
	case len(ys) == 2 && ys[0] == B && ys[1] == T, len(ys) == 1 && ys[0] == B*T:
	default:
		return nil, fmt.Errorf("gpt: Forward: targets have shape %v for ids %v", ys, xs)
	}
	D, H, V := cfg.D, cfg.H, cfg.V
	Dh := cfg.HeadDim()

	// Position ids t, laid out like x.
	pos := make([]int64, B*T)
	for i := range pos {
		pos[i] = int64(i % T)
	}
	var opts []placement.SpecOption
	for d := range xs {
		if o := x.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	posIdx, err := autograd.IndicesFromFull(md.mesh, xs, x.Placements(), pos, opts...)
	if err != nil {
		return nil, fmt.Errorf("gpt: Forward: position ids: %w", err)
	}

	f := forward{md: md}
	tok := f.do(autograd.Embedding(md.byName[tinygpt.ParamWTE], x))
	pe := f.do(autograd.Embedding(md.byName[tinygpt.ParamWPE], posIdx))
	h := f.do2(tok, pe, autograd.Add)
	for l := range cfg.L {
		p := func(suffix string) *autograd.Value { return md.byName[tinygpt.BlockParam(l, suffix)] }
		a := f.ln(h, p(tinygpt.BlockLN1W), p(tinygpt.BlockLN1B))
		qkv := f.linear(a, p(tinygpt.BlockQKVW), p(tinygpt.BlockQKVB))
		var parts []*autograd.Value
		if f.err == nil {
			parts, f.err = autograd.SplitLast(qkv, 3)
		}
		if f.err != nil {
			return nil, f.wrap()
		}
		heads := func(v *autograd.Value) *autograd.Value { // [B,T,D] -> [B,H,T,Dh]
			r := f.do(f.reshape(v, B, T, H, Dh))
			return f.permute(r, 0, 2, 1, 3)
		}
		q, k, v := heads(parts[0]), heads(parts[1]), heads(parts[2])
		var o *autograd.Value
		if f.err == nil {
			o = f.do(autograd.CausalAttention(q, k, v)) // [B,H,T,Dh]
		}
		o = f.do(f.reshape(f.permute(o, 0, 2, 1, 3), B, T, D))
		h = f.do2(h, f.linear(o, p(tinygpt.BlockAttnProjW), p(tinygpt.BlockAttnProjB)), autograd.Add)
		m := f.ln(h, p(tinygpt.BlockLN2W), p(tinygpt.BlockLN2B))
		u := f.linear(m, p(tinygpt.BlockFCW), p(tinygpt.BlockFCB))
		var g *autograd.Value
		if f.err == nil {
			g = f.do(autograd.GELU(u))
		}
		h = f.do2(h, f.linear(g, p(tinygpt.BlockMLPProjW), p(tinygpt.BlockMLPProjB)), autograd.Add)
	}
	h = f.ln(h, md.byName[tinygpt.ParamLNFW], md.byName[tinygpt.ParamLNFB])
	logits := f.linear(h, md.byName[tinygpt.ParamLMHead], nil)
	logits = f.do(f.reshape(logits, B*T, V))
	if f.err != nil {
		return nil, f.wrap()
	}
	tgt := y
	if len(y.Shape()) == 2 {
		var opts []placement.SpecOption
		if ord := y.Order(0); len(ord) > 1 { // keep a nested batch order
			opts = append(opts, placement.WithOrder(0, ord...))
		}
		if tgt, err = autograd.NewIndices(md.mesh, []int{B * T}, y.Placements(), y.Local(), opts...); err != nil {
			return nil, fmt.Errorf("gpt: Forward: targets: %w", err)
		}
	}
	loss, err := autograd.CrossEntropy(logits, tgt)
	if err != nil {
		return nil, fmt.Errorf("gpt: Forward: %w", err)
	}
	return loss, nil
}

// forward threads the first error through a chain of ops.
type forward struct {
	md  *Model
	err error
}

func (f *forward) wrap() error { return fmt.Errorf("gpt: Forward: %w", f.err) }

func (f *forward) do(v *autograd.Value, err error) *autograd.Value {
	if f.err != nil {
		return nil
	}
	if err != nil {
		f.err = err
		return nil
	}
	return v
}

func (f *forward) do2(a, b *autograd.Value, op func(a, b *autograd.Value) (*autograd.Value, error)) *autograd.Value {
	if f.err != nil {
		return nil
	}
	return f.do(op(a, b))
}

func (f *forward) ln(x, w, b *autograd.Value) *autograd.Value {
	if f.err != nil {
		return nil
	}
	return f.do(autograd.LayerNorm(x, w, b, f.md.cfg.LNEps))
}

func (f *forward) linear(x, w, b *autograd.Value) *autograd.Value {
	if f.err != nil {
		return nil
	}
	return f.do(autograd.Linear(x, w, b))
}

func (f *forward) reshape(x *autograd.Value, shape ...int) (*autograd.Value, error) {
	if f.err != nil {
		return nil, f.err
	}
	return autograd.Reshape(x, shape...)
}

func (f *forward) permute(x *autograd.Value, perm ...int) *autograd.Value {
	if f.err != nil {
		return nil
	}
	return f.do(autograd.Permute(x, perm...))
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

// RandomInit returns initial values for every parameter of cfg following
// the §3.1 init column: N(0, InitStd²) from a PCG seeded with seed for the
// normal ones (in param_order), ones for LayerNorm weights and zeros for
// biases. It is for training runs and benchmarks of one's own; parity runs
// load the fixture's init.* tensors instead, since the reference's PyTorch
// stream is not part of the spec.
func RandomInit(cfg tinygpt.Config, seed uint64) map[string][]float32 {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
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
