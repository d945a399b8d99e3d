package cuda

import (
	"fmt"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// openDriver binds the CUDA driver's entry points from lib.
func openDriver(lib *dynlib.Library) (*driverFns, error) {
	f := &driverFns{}
	err := lib.Bind([]dynlib.Symbol{
		{Name: "cuInit", Fn: &f.cuInit},
		{Name: "cuDriverGetVersion", Fn: &f.cuDriverGetVersion},
		{Name: "cuDeviceGetCount", Fn: &f.cuDeviceGetCount},
		{Name: "cuDeviceGet", Fn: &f.cuDeviceGet},
		{Name: "cuDeviceGetName", Fn: &f.cuDeviceGetName},
		{Name: "cuDeviceGetAttribute", Fn: &f.cuDeviceGetAttribute},
		{Name: "cuDeviceGetPCIBusId", Fn: &f.cuDeviceGetPCIBusId, Optional: true},
		{Name: "cuDeviceTotalMem_v2", Fn: &f.cuDeviceTotalMem_v2},
		{Name: "cuDevicePrimaryCtxRetain", Fn: &f.cuDevicePrimaryCtxRetain},
		{Name: "cuDevicePrimaryCtxRelease_v2", Fn: &f.cuDevicePrimaryCtxRelease_v2},
		{Name: "cuCtxSetCurrent", Fn: &f.cuCtxSetCurrent},
		{Name: "cuCtxSynchronize", Fn: &f.cuCtxSynchronize},
		{Name: "cuMemAlloc_v2", Fn: &f.cuMemAlloc_v2},
		{Name: "cuMemFree_v2", Fn: &f.cuMemFree_v2},
		{Name: "cuMemGetInfo_v2", Fn: &f.cuMemGetInfo_v2},
		{Name: "cuMemcpyHtoD_v2", Fn: &f.cuMemcpyHtoD_v2},
		{Name: "cuMemcpyDtoH_v2", Fn: &f.cuMemcpyDtoH_v2},
		{Name: "cuMemcpyDtoD_v2", Fn: &f.cuMemcpyDtoD_v2},
		{Name: "cuMemsetD8_v2", Fn: &f.cuMemsetD8_v2},
		{Name: "cuMemcpyHtoDAsync_v2", Fn: &f.cuMemcpyHtoDAsync_v2},
		{Name: "cuMemcpyDtoHAsync_v2", Fn: &f.cuMemcpyDtoHAsync_v2},
		{Name: "cuMemcpyDtoDAsync_v2", Fn: &f.cuMemcpyDtoDAsync_v2},
		{Name: "cuMemsetD8Async", Fn: &f.cuMemsetD8Async},
		{Name: "cuMemsetD32Async", Fn: &f.cuMemsetD32Async},
		{Name: "cuModuleLoadData", Fn: &f.cuModuleLoadData},
		{Name: "cuModuleGetFunction", Fn: &f.cuModuleGetFunction},
		{Name: "cuModuleUnload", Fn: &f.cuModuleUnload},
		{Name: "cuFuncSetAttribute", Fn: &f.cuFuncSetAttribute},
		{Name: "cuLaunchKernel", Fn: &f.cuLaunchKernel},
		{Name: "cuStreamCreate", Fn: &f.cuStreamCreate},
		{Name: "cuStreamDestroy_v2", Fn: &f.cuStreamDestroy_v2},
		{Name: "cuStreamSynchronize", Fn: &f.cuStreamSynchronize},
		{Name: "cuStreamQuery", Fn: &f.cuStreamQuery},
		{Name: "cuStreamWaitEvent", Fn: &f.cuStreamWaitEvent},
		{Name: "cuEventCreate", Fn: &f.cuEventCreate},
		{Name: "cuEventRecord", Fn: &f.cuEventRecord},
		{Name: "cuEventQuery", Fn: &f.cuEventQuery},
		{Name: "cuEventSynchronize", Fn: &f.cuEventSynchronize},
		{Name: "cuEventElapsedTime", Fn: &f.cuEventElapsedTime},
		{Name: "cuEventDestroy_v2", Fn: &f.cuEventDestroy_v2},
		{Name: "cuGetErrorName", Fn: &f.cuGetErrorName},
		{Name: "cuGetErrorString", Fn: &f.cuGetErrorString},
	})
	if err != nil {
		return nil, fmt.Errorf("not a usable CUDA driver: %w", err)
	}
	return f, nil
}

// openNVRTC binds NVRTC's entry points from lib. The optional ones come in
// pairs, each kept only when both are there.
func openNVRTC(lib *dynlib.Library) (*nvrtcFns, error) {
	f := &nvrtcFns{}
	err := lib.Bind([]dynlib.Symbol{
		{Name: "nvrtcVersion", Fn: &f.nvrtcVersion},
		{Name: "nvrtcCreateProgram", Fn: &f.nvrtcCreateProgram},
		{Name: "nvrtcCompileProgram", Fn: &f.nvrtcCompileProgram},
		{Name: "nvrtcGetProgramLogSize", Fn: &f.nvrtcGetProgramLogSize},
		{Name: "nvrtcGetProgramLog", Fn: &f.nvrtcGetProgramLog},
		{Name: "nvrtcGetPTXSize", Fn: &f.nvrtcGetPTXSize},
		{Name: "nvrtcGetPTX", Fn: &f.nvrtcGetPTX},
		{Name: "nvrtcDestroyProgram", Fn: &f.nvrtcDestroyProgram},
		{Name: "nvrtcGetErrorString", Fn: &f.nvrtcGetErrorString},
		{Name: "nvrtcGetCUBINSize", Fn: &f.nvrtcGetCUBINSize, Optional: true},
		{Name: "nvrtcGetCUBIN", Fn: &f.nvrtcGetCUBIN, Optional: true},
		{Name: "nvrtcGetNumSupportedArchs", Fn: &f.nvrtcGetNumSupportedArchs, Optional: true},
		{Name: "nvrtcGetSupportedArchs", Fn: &f.nvrtcGetSupportedArchs, Optional: true},
	})
	if err != nil {
		return nil, fmt.Errorf("not a usable NVRTC: %w", err)
	}
	if f.nvrtcGetCUBIN == nil || f.nvrtcGetCUBINSize == nil {
		f.nvrtcGetCUBIN, f.nvrtcGetCUBINSize = nil, nil
	}
	if f.nvrtcGetSupportedArchs == nil || f.nvrtcGetNumSupportedArchs == nil {
		f.nvrtcGetSupportedArchs, f.nvrtcGetNumSupportedArchs = nil, nil
	}
	return f, nil
}
