package cuda

import (
	_ "embed"
	"slices"
)

//go:embed permute.cu
var permuteSource string

// Source returns the CUDA C++ source of the MoE permute kernels, the text
// [NewMoE] compiles. It includes no header, so NVRTC needs no CUDA toolkit
// headers; every kernel is extern "C", so its name needs no lowering.
func Source() string { return permuteSource }

// Kernel names in [Source].
const (
	kGatherW16      = "loom_gather_w16"
	kGatherW8       = "loom_gather_w8"
	kGatherW4       = "loom_gather_w4"
	kGatherW1       = "loom_gather_w1"
	kUnpermuteF32   = "loom_unpermute_f32"
	kUnpermuteF64   = "loom_unpermute_f64"
	kScaleGatherF32 = "loom_scale_gather_f32"
	kScaleGatherF64 = "loom_scale_gather_f64"
	kGateGradF32    = "loom_gate_grad_f32"
	kGateGradF64    = "loom_gate_grad_f64"
)

// KernelNames returns the extern "C" kernels of [Source] that [NewMoE]
// looks up.
func KernelNames() []string {
	return slices.Clone([]string{
		kGatherW16, kGatherW8, kGatherW4, kGatherW1,
		kUnpermuteF32, kUnpermuteF64, kScaleGatherF32, kScaleGatherF64, kGateGradF32, kGateGradF64,
	})
}
