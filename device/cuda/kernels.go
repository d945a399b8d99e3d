package cuda

import (
	"embed"
	"strings"
)

// The kernel sources, compiled at run time by NVRTC: kernels/loom.cuh is
// the prelude of each kernels/*.cu.
//
//go:embed kernels/loom.cuh kernels/*.cu
var kernelSources embed.FS

// KernelFile is one CUDA C++ source file of loom's NVRTC kernels.
type KernelFile struct {
	// Name is the file's name under kernels/, e.g. "elementwise.cu".
	Name string
	// Kernels are the extern "C" kernels the file defines, each marked
	// LOOM_KERNEL(name) after its definition; a module compiled from the
	// file has a function of each name.
	Kernels []string
	text    string
}

// Source returns the text to compile for f: the prelude kernels/loom.cuh,
// then f's source after a #line directive, so that NVRTC's messages give
// the file's own line numbers. It includes no header. For a KernelFile not
// returned by [KernelFiles] it is the prelude alone.
func (f KernelFile) Source() string {
	var b strings.Builder
	b.WriteString(mustRead("kernels/loom.cuh"))
	if f.text != "" {
		b.WriteString("#line 1 \"" + f.Name + "\"\n")
		b.WriteString(f.text)
	}
	return b.String()
}

// KernelFiles returns loom's kernel sources, one family of kernels per
// file, each with the names of its kernels. The list is new on every call.
func KernelFiles() []KernelFile {
	files := []KernelFile{
		{Name: "elementwise.cu", Kernels: []string{
			"loom_axpby_f32", "loom_mul_f32", "loom_fill_f32", "loom_cast_f32_bf16", "loom_cast_bf16_f32",
			"loom_sum_mid_f32", "loom_sumsq_f32", "loom_sum_f64",
		}},
		{Name: "layernorm.cu", Kernels: []string{"loom_layernorm_fwd_f32", "loom_layernorm_bwd_f32"}},
		{Name: "gelu.cu", Kernels: []string{"loom_bias_gelu_fwd_f32"}},
		{Name: "softmax.cu", Kernels: []string{
			"loom_softmax_rows_f32", "loom_softmax_rows_bwd_f32", "loom_logsoftmax_rows_bwd_f32",
			"loom_causal_softmax_f32", "loom_causal_softmax_bwd_f32", "loom_softmax_dim_f32", "loom_softmax_dim_bwd_f32",
		}},
		{Name: "xent.cu", Kernels: []string{"loom_xent_fwd_f32", "loom_xent_bwd_f32", "loom_xent_mean_bwd_f32", "loom_xent_mean_f32", "loom_xent_targets"}},
		{Name: "optim.cu", Kernels: []string{"loom_adamw_f32", "loom_sgd_f32"}},
		{Name: "embedding.cu", Kernels: []string{"loom_embedding_fwd_f32", "loom_embedding_bwd_f32"}},
		{Name: "convert.cu", Kernels: []string{
			"loom_fill_u16", "loom_fill_u64", "loom_cast_f32_f64", "loom_cast_f64_f32", "loom_broadcast_mid_f32",
			"loom_sum_f32_partial",
		}},
		{Name: "shape.cu", Kernels: []string{"loom_copy_box_f32", "loom_permute_nd_f32", "loom_sum_dims_f32", "loom_fill_rows_f32"}},
		{Name: "pointwise.cu", Kernels: []string{"loom_act_f32", "loom_act_bwd_f32", "loom_dropout_mask_f32", "loom_argmax_rows_f32"}},
		{Name: "flatten.cu", Kernels: []string{"loom_flatten_f32", "loom_unflatten_f32"}},
		{Name: "vocab_ce.cu", Kernels: []string{"loom_vocab_max_f32", "loom_vocab_sumexp_pick_f32", "loom_vocab_ce_bwd_f32"}},
		{Name: "router.cu", Kernels: []string{"loom_router_topk_f32"}},
		{Name: "flash_attn.cu", Kernels: []string{
			"loom_flash_attn_fwd_f32", "loom_flash_attn_fwd_bf16", "loom_flash_attn_bwd_dq_f32", "loom_flash_attn_bwd_dq_bf16",
			"loom_flash_attn_bwd_dkv_f32", "loom_flash_attn_bwd_dkv_bf16",
		}},
		{Name: "block_attn.cu", Kernels: []string{
			"loom_block_attn_fwd_f32", "loom_block_attn_fwd_f64", "loom_block_attn_merge_f32", "loom_block_attn_merge_f64",
			"loom_block_attn_rowdots_f32", "loom_block_attn_rowdots_f64", "loom_block_attn_bwd_dq_f32",
			"loom_block_attn_bwd_dq_f64", "loom_block_attn_bwd_dkv_f32", "loom_block_attn_bwd_dkv_f64",
		}},
		{Name: permuteFile, Kernels: KernelNames()},
	}
	for i := range files {
		files[i].text = mustRead("kernels/" + files[i].Name)
	}
	return files
}

// mustRead returns an embedded file. The names are constants of this file
// and every one is embedded, which the package's tests check, so a failure
// is a build defect.
func mustRead(name string) string {
	b, err := kernelSources.ReadFile(name)
	if err != nil {
		panic("cuda: embedded kernel source " + name + ": " + err.Error())
	}
	return string(b)
}
