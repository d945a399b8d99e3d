package cuda

import "strconv"

// permuteFile is the kernel file of the MoE permute kernels.
const permuteFile = "permute.cu"

// Source returns the CUDA C++ source of the MoE permute kernels, the text
// [NewMoE] compiles: kernels/permute.cu after the prelude, as
// [KernelFile.Source] gives every kernel file. It includes no header, so
// NVRTC needs no CUDA toolkit headers; every kernel is extern "C", so its
// name needs no lowering.
func Source() string {
	for _, f := range KernelFiles() {
		if f.Name == permuteFile {
			return f.Source()
		}
	}
	panic("cuda: " + permuteFile + " is not among KernelFiles") // a build defect, which TestKernelFiles catches
}

// The row-gather kernels in [Source], by the size of the word they copy.
const (
	kGatherW16 = "loom_gather_w16"
	kGatherW8  = "loom_gather_w8"
	kGatherW4  = "loom_gather_w4"
	kGatherW1  = "loom_gather_w1"
)

// The typed kernels in [Source]: each is defined for float32 and float64,
// element by element and with 16-byte accesses (see [typedKernel]).
const (
	kUnpermute   = "unpermute"
	kScaleGather = "scale_gather"
	kGateGrad    = "gate_grad"
)

// typedKernel returns the name of kind's kernel for t: loom_<kind>_f32 or
// _f64, or with wide (16-byte loads and stores, for rows whose width and
// pointers allow them) loom_<kind>_f32x4 or _f64x2.
func typedKernel(kind string, t DType, wide bool) string {
	name := "loom_" + kind + "_f" + strconv.Itoa(8*t.Size())
	if wide {
		name += "x" + strconv.Itoa(16/t.Size())
	}
	return name
}

// KernelNames returns the extern "C" kernels of [Source] that [NewMoE]
// looks up.
func KernelNames() []string {
	names := []string{kGatherW16, kGatherW8, kGatherW4, kGatherW1}
	for _, kind := range []string{kUnpermute, kScaleGather, kGateGrad} {
		for _, t := range []DType{Float32, Float64} {
			names = append(names, typedKernel(kind, t, false), typedKernel(kind, t, true))
		}
	}
	return names
}
