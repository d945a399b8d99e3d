package tinygpt

import (
	"fmt"
	"strconv"
)

// Init is how a parameter is initialised (reference/TINY_GPT.md §3.1).
type Init int

const (
	// InitNormal draws each element from N(0, InitStd²). The reference's
	// stream (PyTorch's generator, seed 0) is not part of the spec: for
	// parity, load the init.* tensors from the fixture.
	InitNormal Init = iota
	// InitOnes sets every element to 1 (LayerNorm weights).
	InitOnes
	// InitZeros sets every element to 0 (biases).
	InitZeros
)

// String returns the notation of the §3.1 table: "N(0, σ²)", "1" or "0".
func (i Init) String() string {
	switch i {
	case InitNormal:
		return "N(0, σ²)"
	case InitOnes:
		return "1"
	case InitZeros:
		return "0"
	}
	return "Init(" + strconv.Itoa(int(i)) + ")"
}

// Param describes one parameter tensor: its name in the fixture and the
// JSON, its shape and its initialisation.
type Param struct {
	// Name is the parameter's name, e.g. "wte" or "h.1.attn.qkv.weight".
	Name string
	// Shape is the row-major shape; linear weights are [out, in].
	Shape []int
	// Init is the initialisation kind.
	Init Init
}

// Numel returns the number of elements, the product of Shape.
func (p Param) Numel() int {
	n := 1
	for _, d := range p.Shape {
		n *= d
	}
	return n
}

// Parameter names (reference/TINY_GPT.md §3.1). Block parameters are named
// BlockPrefix(l) + one of the Block* suffixes.
const (
	ParamWTE    = "wte"            // token embedding, [V, D]
	ParamWPE    = "wpe"            // position embedding, [T, D]
	ParamLNFW   = "ln_f.weight"    // final LayerNorm weight, [D]
	ParamLNFB   = "ln_f.bias"      // final LayerNorm bias, [D]
	ParamLMHead = "lm_head.weight" // output projection, [V, D], no bias, untied

	BlockLN1W      = "ln1.weight"       // [D]
	BlockLN1B      = "ln1.bias"         // [D]
	BlockQKVW      = "attn.qkv.weight"  // [3D, D]: q, k, v blocks of D rows each
	BlockQKVB      = "attn.qkv.bias"    // [3D]
	BlockAttnProjW = "attn.proj.weight" // [D, D]
	BlockAttnProjB = "attn.proj.bias"   // [D]
	BlockLN2W      = "ln2.weight"       // [D]
	BlockLN2B      = "ln2.bias"         // [D]
	BlockFCW       = "mlp.fc.weight"    // [F, D]
	BlockFCB       = "mlp.fc.bias"      // [F]
	BlockMLPProjW  = "mlp.proj.weight"  // [D, F]
	BlockMLPProjB  = "mlp.proj.bias"    // [D]
)

// ParamsPerBlock is the number of parameter tensors in one block.
const ParamsPerBlock = 12

// BlockPrefix returns the name prefix of block l, "h.{l}.".
func BlockPrefix(l int) string { return "h." + strconv.Itoa(l) + "." }

// BlockParam returns the full name of block l's parameter suffix, e.g.
// BlockParam(1, BlockQKVW) = "h.1.attn.qkv.weight".
func BlockParam(l int, suffix string) string { return BlockPrefix(l) + suffix }

// Params returns every parameter of the model for c, in param_order: wte,
// wpe, the 12 parameters of each block l = 0 … L−1 in the §3.1 order, then
// ln_f.weight, ln_f.bias and lm_head.weight. There are 12·L + 5 of them.
func (c Config) Params() []Param {
	V, D, F, T := c.V, c.D, c.F, c.T
	ps := make([]Param, 0, ParamsPerBlock*max(c.L, 0)+5)
	ps = append(ps,
		Param{ParamWTE, []int{V, D}, InitNormal},
		Param{ParamWPE, []int{T, D}, InitNormal},
	)
	for l := 0; l < c.L; l++ {
		for _, bp := range []Param{
			{BlockLN1W, []int{D}, InitOnes},
			{BlockLN1B, []int{D}, InitZeros},
			{BlockQKVW, []int{3 * D, D}, InitNormal},
			{BlockQKVB, []int{3 * D}, InitZeros},
			{BlockAttnProjW, []int{D, D}, InitNormal},
			{BlockAttnProjB, []int{D}, InitZeros},
			{BlockLN2W, []int{D}, InitOnes},
			{BlockLN2B, []int{D}, InitZeros},
			{BlockFCW, []int{F, D}, InitNormal},
			{BlockFCB, []int{F}, InitZeros},
			{BlockMLPProjW, []int{D, F}, InitNormal},
			{BlockMLPProjB, []int{D}, InitZeros},
		} {
			bp.Name = BlockParam(l, bp.Name)
			ps = append(ps, bp)
		}
	}
	return append(ps,
		Param{ParamLNFW, []int{D}, InitOnes},
		Param{ParamLNFB, []int{D}, InitZeros},
		Param{ParamLMHead, []int{V, D}, InitNormal},
	)
}

// ParamNames returns the names of Params, in param_order.
func (c Config) ParamNames() []string {
	ps := c.Params()
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return names
}

// NumParams returns the total number of scalar parameters (470,528 for
// Default).
func (c Config) NumParams() int {
	n := 0
	for _, p := range c.Params() {
		n += p.Numel()
	}
	return n
}

// Tensor names and dtypes of tiny_gpt.safetensors (reference/TINY_GPT.md §5.1).
const (
	TensorX1 = "x1" // batch-1 inputs, I64 [B, T]
	TensorY1 = "y1" // batch-1 targets, I64 [B, T]

	PrefixInit   = "init."   // + parameter name: initial parameters, F32
	PrefixGrad1  = "grad1."  // + parameter name: step-1 gradients, F32
	PrefixAfter1 = "after1." // + parameter name: parameters after the first AdamW update, F32

	DTypeF32 = "F32" // safetensors dtype of the parameter tensors
	DTypeI64 = "I64" // safetensors dtype of x1 and y1
)

// Metadata keys of tiny_gpt.safetensors' __metadata__ (§5.1). config is JSON
// text, param_order a comma-separated list.
const (
	MetaFormat     = "format" // "pt"
	MetaFixture    = "fixture"
	MetaSpec       = "spec"
	MetaProducer   = "producer"
	MetaConfig     = "config"
	MetaParamOrder = "param_order"
	MetaLayout     = "layout"
	MetaLossStep1  = "loss_step1"
	MetaLossStep2  = "loss_step2"
)

// MetadataKeys returns the __metadata__ keys §5.1 lists, in its order.
func MetadataKeys() []string {
	return []string{MetaFormat, MetaFixture, MetaSpec, MetaProducer, MetaConfig,
		MetaParamOrder, MetaLayout, MetaLossStep1, MetaLossStep2}
}

// TensorSpec names one tensor of the safetensors fixture with its dtype and
// shape.
type TensorSpec struct {
	Name  string // e.g. "x1" or "grad1.h.0.attn.qkv.weight"
	DType string // DTypeF32 or DTypeI64
	Shape []int
}

// FixtureTensors returns the tensors of the safetensors fixture for c in
// their file order (§5.1): x1, y1, then init.<p>, then grad1.<p>, then
// after1.<p>, each for p in param_order; 3·(12·L+5) + 2 tensors (89 for
// Default). This package does not read the file.
func (c Config) FixtureTensors() []TensorSpec {
	ps := c.Params()
	out := make([]TensorSpec, 0, 2+3*len(ps))
	out = append(out,
		TensorSpec{TensorX1, DTypeI64, []int{c.B, c.T}},
		TensorSpec{TensorY1, DTypeI64, []int{c.B, c.T}},
	)
	for _, prefix := range []string{PrefixInit, PrefixGrad1, PrefixAfter1} {
		for _, p := range ps {
			out = append(out, TensorSpec{prefix + p.Name, DTypeF32, p.Shape})
		}
	}
	return out
}

// Param returns the parameter of c called name, or an error naming it.
func (c Config) Param(name string) (Param, error) {
	for _, p := range c.Params() {
		if p.Name == name {
			return p, nil
		}
	}
	return Param{}, fmt.Errorf("tinygpt: no parameter %q for L=%d", name, c.L)
}
