// Package moegpt is a small GPT-like transformer whose MLPs are
// mixture-of-experts layers (moe.Layer), written once in global terms and
// trained with expert parallelism (EP) over an ("dp", "ep") mesh.
//
// The model is a byte-level pre-LayerNorm transformer: token and position
// embeddings, L blocks of h += attn(LN1(h)); h += moe(LN2(h)), a final
// LayerNorm and an untied lm_head. Its data are the synthetic corpus and
// batch sampler of reference/tinygpt (reference/TINY_GPT.md §2), so every layout trains
// on exactly the batches one rank would.
//
// # Layout
//
// The batch rows (and so the tokens) are sharded over the data-parallel and
// expert-parallel axes together, Shard(0) on both in mesh-axis order. The
// embeddings, norms, attention and router weights are Replicate on every
// axis; their gradients come out of backward Partial(sum) on both axes.
// The experts' parameters are Shard(0) on the expert-parallel axis (rank r
// of P holds experts [r·E/P, (r+1)·E/P)) and Replicate on the
// data-parallel axis, so their gradients are Partial(sum) on dp only.
//
// Trainer reduces them as Megatron-Core does with its data-parallel and
// expert-data-parallel groups: one DDP over the expert-parallel axis for
// the replicated parameters (bucketed all-reduces overlapping backward;
// that axis holds most of their ranks in the default ep-heavy layout), one
// DDP over the data-parallel axis for the expert parameters, and
// tp.ReduceGrads for what is left (the replicated parameters' sum
// over dp, when dp > 1). AdamW then updates every rank's blocks.
//
// The loss is the mean cross-entropy over all B·T positions plus every
// layer's load-balancing loss (RouterConfig.AuxCoef) and router z-loss
// (ZCoef), each Partial(sum) on the token-sharding axes.
package moegpt

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/models/internal/layout"
	"github.com/b7ea7098/loom/models/internal/preset"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// ErrConfig is wrapped by the errors of Validate, CheckLayout and the
// constructors' argument checks; it matches loom.ErrInvalid.
var ErrConfig = loom.NewSentinel("moegpt: invalid configuration", loom.ErrInvalid)

// Config is the model: its shape, routing and initialisation. The data
// (batch, corpus and sampler) and AdamW's hyper-parameters are the
// Trainer's (WithRun), as in package gpt.
type Config struct {
	// V is the vocabulary (byte values in [0, V), at least
	// tinygpt.MinVocab); D the model width; H the attention heads (D/H
	// channels each); L the blocks; T the longest sequence (the position
	// embedding's rows).
	V, D, H, L, T int
	// E is the number of experts per layer, K the experts per token and
	// Hd the hidden width of each expert MLP.
	E, K, Hd int

	// CapacityFactor limits every expert to ⌈CapacityFactor·n·K/E⌉ of a
	// rank's n tokens (RouterConfig.CapacityFactor); 0 is dropless.
	CapacityFactor float64
	// Pad pads every expert's rows to the capacity, the static layout
	// (RouterConfig.PadToCapacity); it needs a CapacityFactor.
	Pad bool
	// AuxCoef and ZCoef are the coefficients of the load-balancing loss
	// and the router z-loss (0 turns a loss off).
	AuxCoef, ZCoef float64

	// InitStd is the standard deviation of the normal initialisation;
	// LNEps the LayerNorm epsilon.
	InitStd, LNEps float64
}

// Default is a small model that trains in seconds per hundred steps on a
// laptop: D=64, H=4, L=2, E=8 experts of width 128, top-2 routing with
// reference/MOE_LAYER.md's losses (α = 0.01, β = 0.001), sequences of 64
// bytes, and the tiny GPT's vocabulary and initialisation. The Trainer's
// default run (tinygpt.Default()) trains it on 16 sequences a step of the
// tiny GPT's corpus, with its optimizer.
func Default() Config {
	d := tinygpt.Default()
	return Config{
		V: d.V, D: 64, H: 4, L: 2, T: d.T,
		E: 8, K: 2, Hd: 128,
		AuxCoef: 0.01, ZCoef: 0.001,
		InitStd: d.InitStd, LNEps: d.LNEps,
	}
}

// reference is c's shape as a tinygpt configuration with run's data and
// optimizer fields (F is the expert width), for tinygpt.Corpus and
// tinygpt.NewSampler.
func (c Config) reference(run tinygpt.Config) tinygpt.Config {
	run.V, run.D, run.H, run.L, run.F, run.T = c.V, c.D, c.H, c.L, c.Hd, c.T
	run.InitStd, run.LNEps = c.InitStd, c.LNEps
	run.Steps = max(run.Steps, 1) // the caller counts the steps
	return run
}

// Validate reports every problem of c at once, joined with errors.Join,
// or nil.
func (c Config) Validate() error {
	var errs []error
	if err := c.reference(tinygpt.Default()).Validate(); err != nil {
		errs = append(errs, fmt.Errorf("%w: %w", ErrConfig, err))
	}
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrConfig}, args...)...))
	}
	// One numcheck rule per kind: the model needs a block (unlike the
	// dense GPT, whose blocks are optional), an expert and a choice; 0
	// means dropless or a loss off for the router's numbers, and an init
	// std of 0 starts every weight at 0.
	errs = append(errs,
		numcheck.Count(ErrConfig, "L", c.L),
		numcheck.Count(ErrConfig, "E", c.E),
		numcheck.Count(ErrConfig, "K", c.K),
		numcheck.Count(ErrConfig, "Hd", c.Hd),
		numcheck.NonNegative(ErrConfig, "CapacityFactor", c.CapacityFactor),
		numcheck.NonNegative(ErrConfig, "AuxCoef", c.AuxCoef),
		numcheck.NonNegative(ErrConfig, "ZCoef", c.ZCoef),
		numcheck.NonNegative(ErrConfig, "InitStd", c.InitStd))
	if c.E >= 1 && c.K > c.E {
		bad("E=%d experts and K=%d per token: want 1 ≤ K ≤ E", c.E, c.K)
	}
	if c.Pad && c.CapacityFactor == 0 {
		bad("padding to capacity needs a capacity factor")
	}
	return errors.Join(errs...)
}

// CheckLayout reports whether c can be trained with a global batch of
// batch sequences on dp data-parallel and ep expert-parallel ranks: every
// expert-parallel rank needs whole experts (E divisible by ep) and every
// rank whole sequences (batch divisible by dp·ep, the tokens being
// sharded over both axes); a batch of 0 checks the experts only. Each
// error wraps ErrConfig and says which values would work.
func (c Config) CheckLayout(batch, dp, ep int) error {
	if dp < 1 || ep < 1 {
		return fmt.Errorf("%w: dp (%d) and ep (%d) must be at least 1", ErrConfig, dp, ep)
	}
	var errs []error
	if c.E >= 1 && c.E%ep != 0 {
		errs = append(errs, fmt.Errorf("%w: ep (%d) must divide the experts (%d); ep can be %s", ErrConfig, ep, c.E, layout.Divisors(c.E)))
	}
	if batch >= 1 && batch%(dp*ep) != 0 {
		errs = append(errs, fmt.Errorf("%w: dp × ep (%d × %d) must divide the batch (%d sequences); dp × ep can be %s", ErrConfig, dp, ep, batch, layout.Divisors(batch)))
	}
	return errors.Join(errs...)
}

// Init is how a parameter starts.
type Init int

const (
	// InitNormal draws from N(0, InitStd²).
	InitNormal Init = iota
	// InitZeros starts at zero (biases).
	InitZeros
	// InitOnes starts at one (LayerNorm weights).
	InitOnes
)

// Param describes one parameter tensor.
type Param struct {
	// Name is the parameter's name, e.g. "h.0.moe.W1".
	Name string
	// Shape is its global shape.
	Shape []int
	// Init is how RandomInit fills it.
	Init Init
	// Expert marks the expert parameters (Shard(0) on the
	// expert-parallel axis); the others are replicated.
	Expert bool
}

// Numel is the number of scalars of p.
func (p Param) Numel() int {
	n := 1
	for _, s := range p.Shape {
		n *= s
	}
	return n
}

// Parameter name suffixes of a block; BlockParam prefixes them with
// "h.{l}.".
const (
	BlockLN1W     = "ln1.weight"
	BlockLN1B     = "ln1.bias"
	BlockQKVW     = "attn.qkv.weight"
	BlockQKVB     = "attn.qkv.bias"
	BlockProjW    = "attn.proj.weight"
	BlockProjB    = "attn.proj.bias"
	BlockLN2W     = "ln2.weight"
	BlockLN2B     = "ln2.bias"
	BlockRouterW  = "moe.router.weight"
	BlockExpertW1 = "moe.W1"
	BlockExpertB1 = "moe.b1"
	BlockExpertW2 = "moe.W2"
	BlockExpertB2 = "moe.b2"
)

// Names of the parameters outside the blocks.
const (
	ParamWTE    = "wte"
	ParamWPE    = "wpe"
	ParamLNFW   = "ln_f.weight"
	ParamLNFB   = "ln_f.bias"
	ParamLMHead = "lm_head.weight"
)

// BlockParam returns the full name of block l's parameter suffix, e.g.
// BlockParam(1, BlockExpertW1) = "h.1.moe.W1".
func BlockParam(l int, suffix string) string { return "h." + strconv.Itoa(l) + "." + suffix }

// Params returns every parameter of the model in its fixed order: wte,
// wpe, each block's LayerNorms, attention, router and experts, then ln_f
// and lm_head.
func (c Config) Params() []Param {
	ps := []Param{
		{Name: ParamWTE, Shape: []int{c.V, c.D}},
		{Name: ParamWPE, Shape: []int{c.T, c.D}},
	}
	for l := range c.L {
		p := func(suffix string, init Init, expert bool, shape ...int) Param {
			return Param{Name: BlockParam(l, suffix), Shape: shape, Init: init, Expert: expert}
		}
		ps = append(ps,
			p(BlockLN1W, InitOnes, false, c.D),
			p(BlockLN1B, InitZeros, false, c.D),
			p(BlockQKVW, InitNormal, false, 3*c.D, c.D),
			p(BlockQKVB, InitZeros, false, 3*c.D),
			p(BlockProjW, InitNormal, false, c.D, c.D),
			p(BlockProjB, InitZeros, false, c.D),
			p(BlockLN2W, InitOnes, false, c.D),
			p(BlockLN2B, InitZeros, false, c.D),
			p(BlockRouterW, InitNormal, false, c.E, c.D),
			p(BlockExpertW1, InitNormal, true, c.E, c.Hd, c.D),
			p(BlockExpertB1, InitZeros, true, c.E, c.Hd),
			p(BlockExpertW2, InitNormal, true, c.E, c.D, c.Hd),
			p(BlockExpertB2, InitZeros, true, c.E, c.D),
		)
	}
	return append(ps,
		Param{Name: ParamLNFW, Shape: []int{c.D}, Init: InitOnes},
		Param{Name: ParamLNFB, Shape: []int{c.D}, Init: InitZeros},
		Param{Name: ParamLMHead, Shape: []int{c.V, c.D}},
	)
}

// NumParams is the total number of scalar parameters.
func (c Config) NumParams() int {
	n := 0
	for _, p := range c.Params() {
		n += p.Numel()
	}
	return n
}

// RandomInit returns the full initial value of every parameter of c,
// row-major: N(0, InitStd²) from a PCG seeded with seed for the normal
// ones (drawn in parameter order), ones and zeros for the others. Every
// rank computes the same values, so any layout starts from the same model.
func RandomInit(c Config, seed uint64) map[string][]float32 {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	out := make(map[string][]float32)
	for _, p := range c.Params() {
		d := make([]float32, p.Numel())
		switch p.Init {
		case InitNormal:
			for i := range d {
				d[i] = float32(rng.NormFloat64() * c.InitStd)
			}
		case InitOnes:
			for i := range d {
				d[i] = 1
			}
		}
		out[p.Name] = d
	}
	return out
}

// presets are the named shapes of Preset, smallest first.
var presets = []preset.Entry[Config]{
	{Name: "tiny", Config: Default},
	{Name: "gpt2-small", Config: func() Config { return gpt2(768, 12, 12) }},
	{Name: "gpt2-medium", Config: func() Config { return gpt2(1024, 16, 24) }},
}

// gpt2 is a GPT-2-sized MoE model of width d, h heads and l layers: 8
// experts of width 4·d, top-2, Default's losses and initialisation,
// V=50304 (GPT-2's 50257 padded to a multiple of 64) and T=1024.
func gpt2(d, h, l int) Config {
	c := Default()
	c.V, c.D, c.H, c.L, c.T, c.Hd = 50304, d, h, l, 1024, 4*d
	return c
}

// Presets returns the names Preset knows, smallest model first.
func Presets() []string { return preset.Names(presets) }

// Preset returns the named model: "tiny" (Default), or "gpt2-small"
// (D=768, H=12, L=12) and "gpt2-medium" (D=1024, H=16, L=24) with GPT-2's
// attention and an MoE layer of 8 experts of width 4·D, top-2, in place of
// each MLP (V=50304, T=1024, Default's router losses and init). Another
// name is an error wrapping ErrConfig that lists these.
func Preset(name string) (Config, error) {
	if c, ok := preset.Find(presets, name); ok {
		return c, nil
	}
	return Config{}, fmt.Errorf("%w: no preset %q; the presets are %v", ErrConfig, name, Presets())
}

// ActiveParams returns the parameters one token's matrix products use:
// every parameter but the token and position embedding tables
// (lookups), the experts' counted K of E times (each token passes K
// experts). It is the N of train.FlopsPerToken for this model.
func (c Config) ActiveParams() int {
	n := 0
	for _, p := range c.Params() {
		switch {
		case p.Name == ParamWTE || p.Name == ParamWPE:
		case p.Expert && c.E > 0:
			n += p.Numel() / c.E * c.K
		default:
			n += p.Numel()
		}
	}
	return n
}
