// Package cuda runs loom's MoE permute kernels on NVIDIA GPUs without cgo
// and without CUDA headers at build time.
//
// The CUDA driver (libcuda.so.1) and NVRTC (libnvrtc.so.<major>) are opened
// at run time with dlopen through github.com/ebitengine/purego, as package
// kernels opens BLAS. The kernels are CUDA C source held in this package
// ([Source]) and compiled at run time by NVRTC for the device's
// architecture (a cubin for sm_XX when NVRTC supports the device, PTX for
// the newest architecture it knows otherwise), then loaded with
// cuModuleLoadData and launched with cuLaunchKernel.
//
// # Libraries
//
// [Load] tries, in order, the sonames and paths of [DriverCandidates] and
// [NVRTCCandidates] and keeps the first that loads and exports every entry
// point it needs; [Lib.Tried] (or the [*LoadError] when nothing loads) says
// what was tried and why each candidate was rejected. The environment
// variables LOOM_CUDA_DRIVER and LOOM_NVRTC ([DriverEnv], [NVRTCEnv]), or
// [WithDriver] and [WithNVRTC], force one soname or path; a forced library
// that does not load is an error, not a fallback. The value "off" skips a
// library: a Lib without NVRTC can still load prebuilt modules, and one
// without the driver can still compile.
//
// A [Lib] is a value the caller owns: there is no package-level state. Its
// methods and those of the [Context], [Module] and [MoE] values made from
// it check every CUresult and nvrtcResult and return an [*Error] naming the
// call; none panics. Driver symbols are bound by their versioned names
// (cuMemAlloc_v2, cuMemFree_v2, cuMemcpyHtoD_v2, ...), which are the ones
// cuda.h maps the plain names to.
//
// # Threads and contexts
//
// A [Context] holds the device's primary context (cuDevicePrimaryCtxRetain),
// the one the CUDA runtime and NCCL use. The driver keeps the current
// context per OS thread, so every Context method locks its goroutine to its
// thread and makes the context current for the duration of the call;
// callers need not do either. Work is issued on the legacy default stream
// and is ordered; [Context.Synchronize] waits for it.
//
// cuLaunchKernel takes an array of pointers to the argument values. [Context.Launch]
// packs each argument into an 8-byte slot of one Go array and pins that
// array and the pointer array with runtime.Pinner for the call, which keeps
// within the cgo pointer rules; it accepts only fixed-size scalar types
// (int32, uint32, int64, uint64, float32, float64, [DevicePtr], [Buffer]),
// never int, whose C width is ambiguous.
//
// # Testing
//
// Tests that need a GPU skip, naming the reason, where the driver or a
// device is missing; with LOOM_CUDA_REQUIRE=1 they fail instead.
// scripts/gpu_check.sh builds the test binary and runs the GPU checks:
// agreement with package kernels' CPU kernels on random data, and bandwidth
// against cuMemcpyDtoD of the same bytes.
package cuda

import "github.com/b7ea7098/loom"

// Error kinds of the package's own checks (the driver's and NVRTC's
// failures are *Error, *CompileError and *LoadError).
var (
	// ErrInvalid marks arguments rejected before any driver call: a nil
	// or closed Lib, Context, Module or MoE, sizes that do not fit their
	// buffers, kernel arguments of the wrong type, a routing that is not
	// planned. errors.Is(err, loom.ErrInvalid) matches it too.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrUnsupported marks a well-formed request this setup cannot serve:
	// a library turned off by its environment variable, a device newer
	// than every architecture NVRTC can target.
	ErrUnsupported = loom.NewSentinel("unsupported", loom.ErrUnsupported)
)
