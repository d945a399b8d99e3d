package parallel

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// LayerOption configures a module constructor (NewLinear, NewEmbedding,
// NewLayerNorm, NewAttention, NewMLP).
type LayerOption func(*layerConfig)

type layerConfig struct {
	name         string
	bias, biasOK bool // biasOK: WithBias was given
	init, binit  Init
	dtype        comm.DType
	eps          float64
	epsSet       bool
}

// WithName names the module: its parameters are called name + "." +
// their suffix ("h.0.mlp.fc" gives "h.0.mlp.fc.weight" and
// "h.0.mlp.fc.bias"; an Embedding's table is called name itself), and the
// children of an Attention or MLP name + ".qkv", ".proj", ".fc". Give the
// module's path in the model (its Walk path), so that parameter names,
// tp.Plan patterns, DDP's bucket names and checkpoints agree. Without it the
// names are the bare suffixes.
func WithName(name string) LayerOption { return func(c *layerConfig) { c.name = name } }

// WithBias turns the bias of a Linear (and of the Linears of an Attention
// or MLP) on or off (default on). A LayerNorm always has one; an
// Embedding never has: WithBias is an error there.
func WithBias(on bool) LayerOption {
	return func(c *layerConfig) { c.bias, c.biasOK = on, true }
}

// WithInit sets the init of the weights: a Linear's weight, an
// Embedding's table, a LayerNorm's weight (default: N(0, 0.02²) from a
// generator seeded with the parameter's name; ones for a LayerNorm).
func WithInit(in Init) LayerOption { return func(c *layerConfig) { c.init = in } }

// WithBiasInit sets the init of the biases (default: zeros).
func WithBiasInit(in Init) LayerOption { return func(c *layerConfig) { c.binit = in } }

// WithDType sets the parameters' dtype: comm.Float32 (the default) or
// comm.Float64.
func WithDType(dt comm.DType) LayerOption { return func(c *layerConfig) { c.dtype = dt } }

// WithEps sets a LayerNorm's epsilon, added to the variance inside the
// square root (default 1e-5, PyTorch's). It is an error on other modules.
func WithEps(eps float64) LayerOption {
	return func(c *layerConfig) { c.eps, c.epsSet = eps, true }
}

func layerOptions(opts []LayerOption) layerConfig {
	c := layerConfig{bias: true, dtype: comm.Float32, eps: 1e-5}
	for _, o := range opts {
		o(&c)
	}
	return c
}

// subName joins a module name and a suffix with a dot, or returns the suffix
// for an unnamed module.
func subName(name, suffix string) string {
	if name == "" {
		return suffix
	}
	return name + "." + suffix
}

// newParam makes a parameter leaf called name of global shape shape,
// Replicate on every axis of m, filled by in (def when in is the zero
// Init).
func newParam(tape *autograd.Tape, m *mesh.Mesh, name string, shape []int, dt comm.DType, in, def Init) (*autograd.Value, error) {
	if in.kind == initDefault {
		in = def
	}
	n := 1
	for _, s := range shape {
		n *= s
	}
	data, err := in.fill(name, n, dt)
	if err != nil {
		return nil, err
	}
	rep := make([]placement.Placement, m.NDim())
	for i := range rep {
		rep[i] = placement.Replicate()
	}
	spec, err := placement.NewSpec(m, shape, dt, rep)
	if err != nil {
		return nil, fmt.Errorf("parallel: parameter %q: %w", name, err)
	}
	dtn, err := placement.NewLocal(spec, data)
	if err != nil {
		return nil, fmt.Errorf("parallel: parameter %q: %w", name, err)
	}
	// The value is computed on the host, where the init's generator runs,
	// and copied once to the tape's device (a no-op on the host).
	if dtn, err = dtn.To(tape.Device()); err != nil {
		return nil, fmt.Errorf("parallel: parameter %q: %w", name, err)
	}
	p, err := tape.Param(name, dtn)
	if err != nil {
		return nil, errors.Join(err, blocks.FreeLocal(dtn))
	}
	return p, nil
}

// checkNew validates a constructor's tape, mesh and dims.
func checkNew(op string, tape *autograd.Tape, m *mesh.Mesh, dims ...int) error {
	if tape == nil || m == nil {
		return fmt.Errorf("%w: %s: nil tape or mesh", ErrInvalid, op)
	}
	for _, d := range dims {
		if d < 1 {
			return fmt.Errorf("%w: %s: dims %v must be positive", ErrInvalid, op, dims)
		}
	}
	return nil
}

// NewLinear makes a Linear from in to out features on tape: weight [out,
// in] and, unless WithBias(false), bias [out], Replicate on every axis of
// m (tp.Parallelize reshards them). Options: WithName, WithBias, WithInit,
// WithBiasInit, WithDType. Non-positive dims, a nil tape or mesh, an init
// that does not fit and WithEps are errors wrapping ErrInvalid.
func NewLinear(tape *autograd.Tape, m *mesh.Mesh, in, out int, opts ...LayerOption) (*Linear, error) {
	c := layerOptions(opts)
	if err := checkNew("NewLinear", tape, m, in, out); err != nil {
		return nil, err
	}
	if c.epsSet {
		return nil, fmt.Errorf("%w: NewLinear: WithEps is for LayerNorm", ErrInvalid)
	}
	return newLinear(tape, m, c, c.name, in, out)
}

func newLinear(tape *autograd.Tape, m *mesh.Mesh, c layerConfig, name string, in, out int) (*Linear, error) {
	w, err := newParam(tape, m, subName(name, "weight"), []int{out, in}, c.dtype, c.init, defaultWeight(subName(name, "weight")))
	if err != nil {
		return nil, err
	}
	l := &Linear{Weight: w}
	if c.bias {
		if l.Bias, err = newParam(tape, m, subName(name, "bias"), []int{out}, c.dtype, c.binit, Zeros()); err != nil {
			return nil, err
		}
	}
	return l, nil
}

// NewEmbedding makes an Embedding of vocab rows of width dim on tape: table
// [vocab, dim], Replicate on every axis of m, called by WithName's name
// itself ("wte"), or "weight" without one. Options: WithName, WithInit,
// WithDType; WithBias, WithBiasInit and WithEps are errors.
func NewEmbedding(tape *autograd.Tape, m *mesh.Mesh, vocab, dim int, opts ...LayerOption) (*Embedding, error) {
	c := layerOptions(opts)
	if err := checkNew("NewEmbedding", tape, m, vocab, dim); err != nil {
		return nil, err
	}
	if c.biasOK || c.binit.kind != initDefault || c.epsSet {
		return nil, fmt.Errorf("%w: NewEmbedding: an Embedding has no bias or epsilon", ErrInvalid)
	}
	name := c.name
	if name == "" {
		name = "weight"
	}
	t, err := newParam(tape, m, name, []int{vocab, dim}, c.dtype, c.init, defaultWeight(name))
	if err != nil {
		return nil, err
	}
	return &Embedding{Table: t}, nil
}

// NewLayerNorm makes a LayerNorm over a last dim of size dim on tape:
// weight [dim] (ones) and bias [dim] (zeros), Replicate on every axis of
// m, with epsilon 1e-5. Options: WithName, WithInit (the weight),
// WithBiasInit, WithEps, WithDType; WithBias is an error (the bias is
// part of the module).
func NewLayerNorm(tape *autograd.Tape, m *mesh.Mesh, dim int, opts ...LayerOption) (*LayerNorm, error) {
	c := layerOptions(opts)
	if err := checkNew("NewLayerNorm", tape, m, dim); err != nil {
		return nil, err
	}
	if c.biasOK {
		return nil, fmt.Errorf("%w: NewLayerNorm: a LayerNorm always has a bias", ErrInvalid)
	}
	if !(c.eps > 0) {
		return nil, fmt.Errorf("%w: NewLayerNorm: epsilon %v must be positive", ErrInvalid, c.eps)
	}
	w, err := newParam(tape, m, subName(c.name, "weight"), []int{dim}, c.dtype, c.init, Ones())
	if err != nil {
		return nil, err
	}
	b, err := newParam(tape, m, subName(c.name, "bias"), []int{dim}, c.dtype, c.binit, Zeros())
	if err != nil {
		return nil, err
	}
	return &LayerNorm{Weight: w, Bias: b, Eps: c.eps}, nil
}

// NewAttention makes causal self-attention of width dim with heads heads
// (dim divisible by heads) on tape: children qkv, a fused Linear from dim
// to 3·dim (Chunks 3: q, k and v blocks of dim rows), and proj, a Linear
// from dim to dim. The options apply to both (names: WithName's name +
// ".qkv" and ".proj"; one Normal init draws qkv's weight, then proj's).
func NewAttention(tape *autograd.Tape, m *mesh.Mesh, dim, heads int, opts ...LayerOption) (*Attention, error) {
	c := layerOptions(opts)
	if err := checkNew("NewAttention", tape, m, dim, heads); err != nil {
		return nil, err
	}
	if dim%heads != 0 {
		return nil, fmt.Errorf("%w: NewAttention: width %d is not divisible by %d heads", ErrInvalid, dim, heads)
	}
	if c.epsSet {
		return nil, fmt.Errorf("%w: NewAttention: WithEps is for LayerNorm", ErrInvalid)
	}
	qkv, err := newLinear(tape, m, c, subName(c.name, "qkv"), dim, 3*dim)
	if err != nil {
		return nil, err
	}
	qkv.Chunks = 3
	proj, err := newLinear(tape, m, c, subName(c.name, "proj"), dim, dim)
	if err != nil {
		return nil, err
	}
	return &Attention{QKV: qkv, Proj: proj, Heads: heads}, nil
}

// NewMLP makes proj(GELU(fc(x))) of width dim and hidden width hidden on
// tape: children fc, a Linear from dim to hidden, and proj, a Linear from
// hidden to dim. The options apply to both (names: WithName's name +
// ".fc" and ".proj"; one Normal init draws fc's weight, then proj's).
func NewMLP(tape *autograd.Tape, m *mesh.Mesh, dim, hidden int, opts ...LayerOption) (*MLP, error) {
	c := layerOptions(opts)
	if err := checkNew("NewMLP", tape, m, dim, hidden); err != nil {
		return nil, err
	}
	if c.epsSet {
		return nil, fmt.Errorf("%w: NewMLP: WithEps is for LayerNorm", ErrInvalid)
	}
	fc, err := newLinear(tape, m, c, subName(c.name, "fc"), dim, hidden)
	if err != nil {
		return nil, err
	}
	proj, err := newLinear(tape, m, c, subName(c.name, "proj"), hidden, dim)
	if err != nil {
		return nil, err
	}
	return &MLP{FC: fc, Proj: proj}, nil
}
