package gpt

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/models/internal/layout"
	"github.com/b7ea7098/loom/models/internal/preset"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// Config is the shape of a GPT: a description of the model, not of its
// training (the data and the optimizer are the Trainer's, WithRun).
type Config struct {
	// Vocab is the vocabulary size: token ids lie in [0, Vocab).
	Vocab int
	// Width is the model width (the residual stream's channels).
	Width int
	// Heads is the number of attention heads; Width must be divisible by
	// it (the head width is Width/Heads).
	Heads int
	// Layers is the number of transformer blocks (0 is allowed: embeddings,
	// final LayerNorm and lm_head only).
	Layers int
	// MLPWidth is the hidden width of each block's MLP.
	MLPWidth int
	// SeqLen is the longest sequence (the position embedding's rows).
	SeqLen int
	// InitStd is the standard deviation of the normal initialisation of
	// the embeddings and projection weights.
	InitStd float64
	// LNEps is the LayerNorm epsilon, inside the square root.
	LNEps float64
}

// Tiny returns the tiny GPT of reference/TINY_GPT.md §1 and §3: Vocab 256,
// Width 128, 4 heads, 2 layers, MLP width 512, sequences of 64, init std
// 0.02, LayerNorm epsilon 1e-5 (470,528 parameters).
func Tiny() Config { return FromReference(tinygpt.Default()) }

// FromReference returns the model shape of a tinygpt configuration (V, D,
// H, L, F, T, InitStd and LNEps); its data and optimizer fields are the
// Trainer's (WithRun).
func FromReference(c tinygpt.Config) Config {
	return Config{Vocab: c.V, Width: c.D, Heads: c.H, Layers: c.L, MLPWidth: c.F, SeqLen: c.T, InitStd: c.InitStd, LNEps: c.LNEps}
}

// ErrConfig is wrapped by the errors of Validate, CheckLayout and the
// constructors' argument checks; it matches loom.ErrInvalid.
var ErrConfig = loom.NewSentinel("gpt: invalid configuration", loom.ErrInvalid)

// Validate reports every problem of c at once, each wrapping ErrConfig, or
// nil.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrConfig}, args...)...))
	}
	// One numcheck rule per kind: sizes are counts, Layers may be 0 (see
	// Config), an init std of 0 starts every weight at 0, and the
	// LayerNorm epsilon must be positive (it keeps the square root of a
	// constant row's variance away from 0).
	errs = append(errs,
		numcheck.Count(ErrConfig, "Vocab", c.Vocab),
		numcheck.Count(ErrConfig, "Width", c.Width),
		numcheck.Count(ErrConfig, "Heads", c.Heads),
		numcheck.Count(ErrConfig, "MLPWidth", c.MLPWidth),
		numcheck.Count(ErrConfig, "SeqLen", c.SeqLen),
		numcheck.NonNegativeCount(ErrConfig, "Layers", c.Layers),
		numcheck.NonNegative(ErrConfig, "InitStd", c.InitStd),
		numcheck.Positive(ErrConfig, "LNEps", c.LNEps))
	if c.Width >= 1 && c.Heads >= 1 && c.Width%c.Heads != 0 {
		bad("Width=%d is not divisible by Heads=%d (the head width is Width/Heads)", c.Width, c.Heads)
	}
	return errors.Join(errs...)
}

// reference is c as a tinygpt configuration with run's data and optimizer
// fields, for the parameter list and the sampler.
func (c Config) reference(run tinygpt.Config) tinygpt.Config {
	run.V, run.D, run.H, run.L, run.F, run.T = c.Vocab, c.Width, c.Heads, c.Layers, c.MLPWidth, c.SeqLen
	run.InitStd, run.LNEps = c.InitStd, c.LNEps
	return run
}

// Params describes every parameter in param_order (reference/TINY_GPT.md
// §3.1): names, shapes and inits.
func (c Config) Params() []tinygpt.Param { return c.reference(tinygpt.Default()).Params() }

// NumParams returns the number of scalar parameters.
func (c Config) NumParams() int { return c.reference(tinygpt.Default()).NumParams() }

// Layout is how many ranks each parallelism of a training run uses: the
// batch rows are sharded over DP × FSDP ranks, the model over TP. DP is
// the replicate degree (DDP, or HSDP's replicas when FSDP > 1); FSDP the
// degree that shards parameters, gradients and optimizer state (0 or 1:
// none); SP adds sequence parallelism on the TP ranks.
type Layout struct {
	DP, FSDP, TP int
	SP           bool
	// CP is the context-parallel ranks the sequence is sharded over (0
	// or 1: none), Hybrid's inner ranks included.
	CP int
	// CPMethod is the attention method over them (cp.Auto by default):
	// Ulysses needs the heads per tensor-parallel rank divisible by CP,
	// Hybrid divisible by CPInner, its inner (Ulysses) ranks.
	CPMethod cp.Method
	CPInner  int
	// CPPlain shards the sequence in plain blocks; by default it is load
	// balanced, split into 2·CP chunks, which needs SeqLen ≥ 2·CP.
	CPPlain bool
}

// CheckLayout reports whether the model can be trained with a global batch
// of batch sequences on layout l: every tensor-parallel rank needs whole
// heads (Heads divisible by TP), every data-parallel rank whole sequences
// (batch divisible by DP × FSDP), and sequence parallelism TP ≥ 2 and
// sequences of a length divisible by TP; context parallelism needs a
// sequence of at least CP positions (2·CP when load balanced), no
// sequence parallelism (both would shard the sequence dim), and for
// Ulysses (Hybrid) heads per tensor-parallel rank divisible by CP (its
// inner ranks, which must divide CP). Each error wraps ErrConfig and says
// which values would work.
func (c Config) CheckLayout(batch int, l Layout) error {
	dp, tp, fsdp, sp := l.DP, l.TP, max(l.FSDP, 1), l.SP
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: "+format, append([]any{ErrConfig}, args...)...))
	}
	if dp < 1 || tp < 1 || l.FSDP < 0 {
		bad("dp (%d) and tp (%d) must be at least 1, fsdp (%d) at least 0", dp, tp, l.FSDP)
		return errors.Join(errs...)
	}
	if c.Heads >= 1 && c.Heads%tp != 0 {
		bad("heads (%d) must be divisible by tp (%d); tp can be %s", c.Heads, tp, layout.Divisors(c.Heads))
	}
	switch {
	case batch >= 1 && fsdp == 1 && batch%dp != 0:
		bad("dp (%d) must divide the batch (%d sequences); dp can be %s", dp, batch, layout.Divisors(batch))
	case batch >= 1 && fsdp > 1 && batch%(dp*fsdp) != 0:
		bad("dp × fsdp (%d × %d) must divide the batch (%d sequences); their product can be %s", dp, fsdp, batch, layout.Divisors(batch))
	}
	if sp && tp < 2 {
		bad("sequence parallelism needs tp of at least 2 (tp is %d)", tp)
	} else if sp && c.SeqLen%tp != 0 {
		bad("with sequence parallelism the sequence length (%d) must be divisible by tp (%d); tp can be %s", c.SeqLen, tp, layout.Divisors(c.SeqLen))
	}
	switch {
	case l.CP < 0:
		bad("cp (%d) must be at least 0", l.CP)
	case l.CP > 1 && sp:
		bad("context parallelism (cp %d) and sequence parallelism both shard the sequence; use one", l.CP)
	case l.CP > 1 && c.SeqLen >= 1 && c.SeqLen < l.CP:
		bad("the sequence length (%d) must be at least cp (%d)", c.SeqLen, l.CP)
	case l.CP > 1 && !l.CPPlain && c.SeqLen >= 1 && c.SeqLen < 2*l.CP:
		bad("the load-balanced sequence is split into 2·cp chunks: its length (%d) must be at least 2·cp (2 × %d); use plain shards or cp of at most %d", c.SeqLen, l.CP, c.SeqLen/2)
	}
	if local := c.Heads / max(tp, 1); l.CP > 1 && c.Heads >= 1 && c.Heads%tp == 0 {
		switch {
		case l.CPMethod == cp.Ulysses && local%l.CP != 0:
			bad("Ulysses splits the %d heads per tensor-parallel rank over cp (%d): they must be divisible; cp can be %s, or use ring or allgather", local, l.CP, layout.Divisors(local))
		case l.CPMethod == cp.Hybrid && l.CPInner > 1 && l.CP%l.CPInner != 0:
			bad("Hybrid's inner (Ulysses) ranks (%d) must divide cp (%d), which counts them; the inner size can be %s", l.CPInner, l.CP, layout.Divisors(l.CP))
		case l.CPMethod == cp.Hybrid && l.CPInner > 1 && local%l.CPInner != 0:
			bad("Hybrid's Ulysses splits the %d heads per tensor-parallel rank over its inner ranks (%d): they must be divisible; the inner size can be %s", local, l.CPInner, layout.Divisors(local))
		}
	}
	return errors.Join(errs...)
}

// presets are the named shapes of Preset, smallest first. GPT-2's
// vocabulary of 50257 is padded to 50304, a multiple of 64, as nanoGPT
// and llm.c pad it for faster matrix products; its MLP is 4× the width.
var presets = []preset.Entry[Config]{
	{Name: "tiny", Config: Tiny},
	{Name: "gpt2-small", Config: func() Config { return gpt2(768, 12, 12) }},
	{Name: "gpt2-medium", Config: func() Config { return gpt2(1024, 16, 24) }},
	{Name: "gpt2-large", Config: func() Config { return gpt2(1280, 20, 36) }},
	{Name: "gpt2-xl", Config: func() Config { return gpt2(1600, 25, 48) }},
}

// gpt2 is a GPT-2-sized model of width d, h heads and l layers.
func gpt2(d, h, l int) Config {
	return Config{Vocab: 50304, Width: d, Heads: h, Layers: l, MLPWidth: 4 * d, SeqLen: 1024, InitStd: 0.02, LNEps: 1e-5}
}

// Presets returns the names Preset knows, smallest model first.
func Presets() []string { return preset.Names(presets) }

// Preset returns the named model: "tiny" (Tiny, the reference's),
// "gpt2-small" (D=768, H=12, L=12: 124M parameters with an untied
// lm_head of V=50304), "gpt2-medium" (D=1024, H=16, L=24), "gpt2-large"
// (D=1280, H=20, L=36) or "gpt2-xl" (D=1600, H=25, L=48); the GPT-2
// shapes have V=50304, T=1024, MLPWidth 4·D, init std 0.02 and LayerNorm
// epsilon 1e-5. Another name is an error wrapping ErrConfig that lists
// these.
func Preset(name string) (Config, error) {
	if c, ok := preset.Find(presets, name); ok {
		return c, nil
	}
	return Config{}, fmt.Errorf("%w: no preset %q; the presets are %v", ErrConfig, name, Presets())
}

// MatmulParams returns the parameters that take part in matrix products:
// all but the token and position embedding tables (lookups). It is the N
// of train.FlopsPerToken; the untied lm_head counts.
func (c Config) MatmulParams() int { return c.NumParams() - (c.Vocab+c.SeqLen)*c.Width }
