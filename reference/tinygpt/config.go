package tinygpt

import (
	"errors"
	"fmt"
	"math"
)

// Config holds every symbol of reference/TINY_GPT.md §1, plus the two constants of §3
// (InitStd and LNEps). All of them are configurable: other configurations are
// tested with the same rules.
type Config struct {
	// V is the vocabulary size: token ids are byte values in [0, V).
	V int
	// D is the model width.
	D int
	// H is the number of attention heads; the head width is D/H.
	H int
	// L is the number of transformer blocks.
	L int
	// F is the MLP hidden width.
	F int
	// T is the sequence length (context).
	T int
	// B is the number of sequences per step (the global batch).
	B int

	// CorpusLen is the corpus length in bytes (CORPUS_LEN).
	CorpusLen int
	// CorpusSeed seeds the corpus LCG (CORPUS_SEED).
	CorpusSeed uint32
	// BatchSeed seeds the batch-sampler LCG (BATCH_SEED).
	BatchSeed uint32

	// LR is the constant AdamW learning rate (lr).
	LR float64
	// WD is the decoupled AdamW weight decay (wd), applied to every parameter.
	WD float64
	// Beta1 is AdamW's β1.
	Beta1 float64
	// Beta2 is AdamW's β2.
	Beta2 float64
	// Eps is AdamW's ε, added after sqrt(v)/sqrt(bc2).
	Eps float64
	// Steps is the number of training steps.
	Steps int

	// InitStd is the standard deviation of the normal initialisation (§3.1).
	InitStd float64
	// LNEps is the LayerNorm epsilon, inside the square root (§3.2).
	LNEps float64
}

// Default returns the configuration of the reference fixture (the "value
// here" column of reference/TINY_GPT.md §1).
func Default() Config {
	return Config{
		V: 256, D: 128, H: 4, L: 2, F: 512, T: 64, B: 16,
		CorpusLen:  131072,
		CorpusSeed: 20240601,
		BatchSeed:  12345,
		LR:         3e-3,
		WD:         0.01,
		Beta1:      0.9,
		Beta2:      0.999,
		Eps:        1e-8,
		Steps:      200,
		InitStd:    0.02,
		LNEps:      1e-5,
	}
}

// MinVocab is the smallest vocabulary Validate accepts: the corpus is pure
// ASCII, so every byte it contains is below 128.
const MinVocab = 128

// HeadDim returns the head width Dh = D/H. It is meaningful only for a
// configuration that passes Validate.
func (c Config) HeadDim() int {
	if c.H == 0 {
		return 0
	}
	return c.D / c.H
}

// OffsetRange returns CORPUS_LEN − T − 1, the modulus of the batch-offset
// draw (§2.3): offsets lie in [0, OffsetRange()).
func (c Config) OffsetRange() int { return c.CorpusLen - c.T - 1 }

// Validate reports every problem of c at once, joined with errors.Join, or
// nil. Each message starts with "tinygpt: config:" and names the symbol.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("tinygpt: config: "+format, args...))
	}
	if c.V < MinVocab {
		bad("V=%d is below %d; the corpus uses ASCII bytes up to 127 as token ids", c.V, MinVocab)
	}
	if c.D < 1 {
		bad("D=%d must be positive", c.D)
	}
	if c.H < 1 {
		bad("H=%d must be positive", c.H)
	} else if c.D >= 1 && c.D%c.H != 0 {
		bad("D=%d is not divisible by H=%d (the head width is D/H)", c.D, c.H)
	}
	if c.L < 0 {
		bad("L=%d must not be negative", c.L)
	}
	if c.F < 1 {
		bad("F=%d must be positive", c.F)
	}
	if c.T < 1 {
		bad("T=%d must be positive", c.T)
	}
	if c.B < 1 {
		bad("B=%d must be positive", c.B)
	}
	if c.T >= 1 && c.CorpusLen < c.T+2 {
		bad("CORPUS_LEN=%d must be at least T+2=%d so that CORPUS_LEN−T−1 ≥ 1", c.CorpusLen, c.T+2)
	} else if c.T >= 1 && int64(c.OffsetRange()) > math.MaxUint32 {
		bad("CORPUS_LEN−T−1=%d does not fit the 32-bit LCG", c.OffsetRange())
	}
	if c.Steps < 1 {
		bad("steps=%d must be positive", c.Steps)
	}
	finite := func(name string, v float64) bool {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			bad("%s=%v must be finite", name, v)
			return false
		}
		return true
	}
	if finite("lr", c.LR) && c.LR <= 0 {
		bad("lr=%v must be positive", c.LR)
	}
	if finite("wd", c.WD) && c.WD < 0 {
		bad("wd=%v must not be negative", c.WD)
	}
	if finite("lr", c.LR) && finite("wd", c.WD) && c.LR*c.WD >= 1 {
		bad("lr·wd=%v must be below 1 (the decay factor is 1 − lr·wd)", c.LR*c.WD)
	}
	if finite("beta1", c.Beta1) && (c.Beta1 < 0 || c.Beta1 >= 1) {
		bad("beta1=%v must be in [0, 1)", c.Beta1)
	}
	if finite("beta2", c.Beta2) && (c.Beta2 < 0 || c.Beta2 >= 1) {
		bad("beta2=%v must be in [0, 1)", c.Beta2)
	}
	if finite("eps", c.Eps) && c.Eps <= 0 {
		bad("eps=%v must be positive", c.Eps)
	}
	if finite("init_std", c.InitStd) && c.InitStd < 0 {
		bad("init_std=%v must not be negative", c.InitStd)
	}
	if finite("ln_eps", c.LNEps) && c.LNEps <= 0 {
		bad("ln_eps=%v must be positive", c.LNEps)
	}
	return errors.Join(errs...)
}

// TrainFLOPs returns the floating-point operations of the matrix products
// in one training step of the model for c (forward and backward, B·T
// tokens): 6 per token per weight of every projection (qkv, attention
// output, MLP and lm_head; the embeddings are lookups), plus causal
// attention's two T×T products per head, counting the lower triangle
// only (T(T+1)/2 scores per sequence). The elementwise work is not
// counted, so FLOPs over step time is a lower bound on the GEMM rate.
func (c Config) TrainFLOPs() float64 {
	tokens := float64(c.B * c.T)
	weights := float64(c.L*(3*c.D*c.D+c.D*c.D+2*c.D*c.F) + c.V*c.D)
	// Per sequence and layer: q·kᵀ and p·v, each 2·D·T(T+1)/2 in forward,
	// twice that in backward.
	attn := float64(c.B*c.L) * 3 * 2 * 2 * float64(c.D) * float64(c.T*(c.T+1)/2)
	return 6*weights*tokens + attn
}
