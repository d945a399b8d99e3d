// Package cuda is loom's binding of the CUDA driver and NVRTC, without cgo
// and without CUDA headers at build time: device contexts, memory and
// copies, streams and events (implementing package device's [device.Stream]
// and [device.Event]), kernels compiled at run time and kept in an on-disk
// cache, and the MoE permute kernels.
//
// The CUDA driver (libcuda.so.1) and NVRTC (libnvrtc.so.<major>) are opened
// at run time with dlopen through github.com/ebitengine/purego, as package
// kernels opens BLAS. Kernels are CUDA C source compiled at run time by
// NVRTC for the device's architecture (a cubin for sm_XX when NVRTC
// supports the device, PTX for the newest architecture it knows
// otherwise), then loaded with cuModuleLoadData and launched with
// cuLaunchKernel on a [Stream]. The MoE permute kernels' source is held in
// this package ([Source]).
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
// methods and those of the [Context], [Stream], [Event], [Module] and [MoE]
// values made from it check every CUresult and nvrtcResult and return an
// [*Error] naming the call; none panics. Driver symbols are bound by their versioned names
// (cuMemAlloc_v2, cuMemFree_v2, cuMemcpyHtoD_v2, ...), which are the ones
// cuda.h maps the plain names to.
//
// # Threads, contexts and streams
//
// A [Context] holds the device's primary context (cuDevicePrimaryCtxRetain),
// the one the CUDA runtime and NCCL use. The driver keeps the current
// context per OS thread, so every Context, [Stream] and [Event] method
// locks its goroutine to its thread and makes the context current for the
// duration of the call; callers need not do either. [Context.NewStream]
// makes non-blocking streams (they neither wait for nor are waited for by
// the legacy default stream); [Context.Legacy] is the legacy default
// stream, on which the synchronous copies run. Work on different streams
// is ordered only through events ([Event.Record], [Stream.WaitEvent]) or by
// synchronising.
//
// cuLaunchKernel takes an array of pointers to the argument values. [Stream.Launch]
// packs each argument into an 8-byte slot of one Go array and pins that
// array and the pointer array with runtime.Pinner for the call, which keeps
// within the cgo pointer rules; it accepts only fixed-size scalar types
// (int32, uint32, int64, uint64, float32, float64, [DevicePtr], [Buffer]),
// never int, whose C width is ambiguous.
//
// # Kernel cache
//
// [Lib.Compile] keeps what NVRTC produces in a folder, as CuPy does: by
// default os.UserCacheDir()/loom/kernels, set by [KernelCacheEnv]
// (LOOM_KERNEL_CACHE) or [WithKernelCache], "off" to compile every time. A
// program's file is named by the SHA-256 of its source, NVRTC options,
// target architecture and NVRTC version, so any change compiles anew; it
// holds the SHA-256 of the image and the image, written to a temporary
// file and renamed, so that ranks compiling at once do no harm and a file
// whose digest does not match is deleted and compiled again.
// [Context.CompileModule] also keeps each loaded module per context.
//
// # Testing
//
// Tests that need a GPU skip, naming the reason, where the driver or a
// device is missing; with LOOM_CUDA_REQUIRE=1 they fail instead.
// scripts/gpu_check.sh builds the test binary and runs the GPU checks:
// agreement with package kernels' CPU kernels on random data, bandwidth
// against cuMemcpyDtoD of the same bytes, and streams, events and the
// kernel cache on the device. Without a GPU, the tests load
// testdata/fakecuda.cpp (built with g++) as the driver and NVRTC; its
// streams run their work only when something waits for it, so an
// ordering the binding gets wrong reads stale memory.
package cuda

import "github.com/b7ea7098/loom"

// Error kinds of the package's own checks (the driver's and NVRTC's
// failures are *Error, *CompileError and *LoadError).
var (
	// ErrInvalid marks arguments rejected before any driver call: a nil
	// or closed Lib, Context, Stream, Event, Module or MoE, a stream or
	// event of another type or context, sizes that do not fit their
	// buffers, kernel arguments of the wrong type, a routing that is not
	// planned. errors.Is(err, loom.ErrInvalid) matches it too.
	ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
	// ErrUnsupported marks a well-formed request this setup cannot serve:
	// a library turned off by its environment variable, a device newer
	// than every architecture NVRTC can target.
	ErrUnsupported = loom.NewSentinel("unsupported", loom.ErrUnsupported)
)
