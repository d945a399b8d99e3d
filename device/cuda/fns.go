package cuda

import "unsafe"

// driverFns holds the bound CUDA driver entry points. The field names are
// the C symbols (the _v2 ones where cuda.h maps the plain name to them).
type driverFns struct {
	cuInit                       func(flags uint32) int32
	cuDriverGetVersion           func(v *int32) int32
	cuDeviceGetCount             func(n *int32) int32
	cuDeviceGet                  func(dev *int32, ordinal int32) int32
	cuDeviceGetName              func(name *byte, n int32, dev int32) int32
	cuDeviceGetAttribute         func(v *int32, attr int32, dev int32) int32
	cuDeviceGetPCIBusId          func(buf *byte, n int32, dev int32) int32 // optional
	cuDeviceTotalMem_v2          func(bytes *uintptr, dev int32) int32
	cuDevicePrimaryCtxRetain     func(ctx *uintptr, dev int32) int32
	cuDevicePrimaryCtxRelease_v2 func(dev int32) int32
	cuCtxSetCurrent              func(ctx uintptr) int32
	cuCtxSynchronize             func() int32
	cuMemAlloc_v2                func(p *uint64, n uintptr) int32
	cuMemFree_v2                 func(p uint64) int32
	cuMemGetInfo_v2              func(free, total *uintptr) int32
	cuMemcpyHtoD_v2              func(dst uint64, src unsafe.Pointer, n uintptr) int32
	cuMemcpyDtoH_v2              func(dst unsafe.Pointer, src uint64, n uintptr) int32
	cuMemcpyDtoD_v2              func(dst, src uint64, n uintptr) int32
	cuMemsetD8_v2                func(dst uint64, v uint8, n uintptr) int32
	cuMemcpyHtoDAsync_v2         func(dst uint64, src unsafe.Pointer, n uintptr, stream uintptr) int32
	cuMemcpyDtoHAsync_v2         func(dst unsafe.Pointer, src uint64, n uintptr, stream uintptr) int32
	cuMemcpyDtoDAsync_v2         func(dst, src uint64, n uintptr, stream uintptr) int32
	cuMemsetD8Async              func(dst uint64, v uint8, n uintptr, stream uintptr) int32
	cuMemsetD32Async             func(dst uint64, v uint32, n uintptr, stream uintptr) int32
	cuModuleLoadData             func(mod *uintptr, image unsafe.Pointer) int32
	cuModuleGetFunction          func(fn *uintptr, mod uintptr, name string) int32
	cuModuleUnload               func(mod uintptr) int32
	cuFuncSetAttribute           func(fn uintptr, attr int32, v int32) int32
	cuLaunchKernel               func(fn uintptr, gx, gy, gz, bx, by, bz, shared uint32, stream uintptr, params, extra unsafe.Pointer) int32
	cuStreamCreate               func(s *uintptr, flags uint32) int32
	cuStreamDestroy_v2           func(s uintptr) int32
	cuStreamSynchronize          func(s uintptr) int32
	cuStreamQuery                func(s uintptr) int32
	cuStreamWaitEvent            func(s, ev uintptr, flags uint32) int32
	cuEventCreate                func(ev *uintptr, flags uint32) int32
	cuEventRecord                func(ev, stream uintptr) int32
	cuEventQuery                 func(ev uintptr) int32
	cuEventSynchronize           func(ev uintptr) int32
	cuEventElapsedTime           func(ms *float32, start, end uintptr) int32
	cuEventDestroy_v2            func(ev uintptr) int32
	cuGetErrorName               func(res int32, s **byte) int32
	cuGetErrorString             func(res int32, s **byte) int32
}

// nvrtcFns holds the bound NVRTC entry points. The optional ones
// (supported-architecture queries, CUBIN output) are nil when the library
// lacks them.
type nvrtcFns struct {
	nvrtcVersion           func(major, minor *int32) int32
	nvrtcCreateProgram     func(prog *uintptr, src, name string, numHeaders int32, headers, includeNames unsafe.Pointer) int32
	nvrtcCompileProgram    func(prog uintptr, numOptions int32, options unsafe.Pointer) int32
	nvrtcGetProgramLogSize func(prog uintptr, n *uintptr) int32
	nvrtcGetProgramLog     func(prog uintptr, log *byte) int32
	nvrtcGetPTXSize        func(prog uintptr, n *uintptr) int32
	nvrtcGetPTX            func(prog uintptr, ptx *byte) int32
	nvrtcDestroyProgram    func(prog *uintptr) int32
	nvrtcGetErrorString    func(res int32) string

	nvrtcGetCUBINSize         func(prog uintptr, n *uintptr) int32 // CUDA 11.1+
	nvrtcGetCUBIN             func(prog uintptr, cubin *byte) int32
	nvrtcGetNumSupportedArchs func(n *int32) int32 // CUDA 11.2+
	nvrtcGetSupportedArchs    func(archs *int32) int32
}

// goString copies the NUL-terminated C string at p.
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	n := 0
	for *(*byte)(unsafe.Add(unsafe.Pointer(p), n)) != 0 {
		n++
	}
	return string(unsafe.Slice(p, n))
}
