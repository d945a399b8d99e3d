//go:build linux && (amd64 || arm64)

package cuda

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/ebitengine/purego"
)

// symbol is one entry point to bind: its C name, the address of the Go
// function variable, and whether it may be missing.
type symbol struct {
	name     string
	fn       any
	optional bool
}

// bind dlsyms every symbol of syms from h into its function variable. It
// returns an error naming the missing required symbols; purego's
// registration panics (which only a wrong Go signature could cause) are
// returned as errors too.
func bind(h uintptr, syms []symbol) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("binding: %v", r)
		}
	}()
	var missing []string
	for _, s := range syms {
		addr, e := purego.Dlsym(h, s.name)
		if e != nil || addr == 0 {
			if !s.optional {
				missing = append(missing, s.name)
			}
			continue
		}
		purego.RegisterFunc(s.fn, addr)
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing symbols %s", strings.Join(missing, ", "))
	}
	return nil
}

// openDriver dlopens name as the CUDA driver and binds its entry points. It
// returns the bound functions and the library's file.
func openDriver(name string) (*driverFns, string, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, "", err
	}
	f := &driverFns{}
	err = bind(h, []symbol{
		{name: "cuInit", fn: &f.cuInit},
		{name: "cuDriverGetVersion", fn: &f.cuDriverGetVersion},
		{name: "cuDeviceGetCount", fn: &f.cuDeviceGetCount},
		{name: "cuDeviceGet", fn: &f.cuDeviceGet},
		{name: "cuDeviceGetName", fn: &f.cuDeviceGetName},
		{name: "cuDeviceGetAttribute", fn: &f.cuDeviceGetAttribute},
		{name: "cuDevicePrimaryCtxRetain", fn: &f.cuDevicePrimaryCtxRetain},
		{name: "cuDevicePrimaryCtxRelease_v2", fn: &f.cuDevicePrimaryCtxRelease_v2},
		{name: "cuCtxSetCurrent", fn: &f.cuCtxSetCurrent},
		{name: "cuCtxSynchronize", fn: &f.cuCtxSynchronize},
		{name: "cuMemAlloc_v2", fn: &f.cuMemAlloc_v2},
		{name: "cuMemFree_v2", fn: &f.cuMemFree_v2},
		{name: "cuMemcpyHtoD_v2", fn: &f.cuMemcpyHtoD_v2},
		{name: "cuMemcpyDtoH_v2", fn: &f.cuMemcpyDtoH_v2},
		{name: "cuMemcpyDtoD_v2", fn: &f.cuMemcpyDtoD_v2},
		{name: "cuMemsetD8_v2", fn: &f.cuMemsetD8_v2},
		{name: "cuModuleLoadData", fn: &f.cuModuleLoadData},
		{name: "cuModuleGetFunction", fn: &f.cuModuleGetFunction},
		{name: "cuModuleUnload", fn: &f.cuModuleUnload},
		{name: "cuLaunchKernel", fn: &f.cuLaunchKernel},
		{name: "cuEventCreate", fn: &f.cuEventCreate},
		{name: "cuEventRecord", fn: &f.cuEventRecord},
		{name: "cuEventSynchronize", fn: &f.cuEventSynchronize},
		{name: "cuEventElapsedTime", fn: &f.cuEventElapsedTime},
		{name: "cuEventDestroy_v2", fn: &f.cuEventDestroy_v2},
		{name: "cuGetErrorName", fn: &f.cuGetErrorName},
		{name: "cuGetErrorString", fn: &f.cuGetErrorString},
	})
	if err != nil {
		_ = purego.Dlclose(h)
		return nil, "", fmt.Errorf("not a usable CUDA driver: %w", err)
	}
	return f, libFile(h, "cuInit", name), nil
}

// openNVRTC dlopens name as NVRTC and binds its entry points. It returns
// the bound functions, the handle (for dlclose) and the library's file.
func openNVRTC(name string) (*nvrtcFns, uintptr, string, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, 0, "", err
	}
	f := &nvrtcFns{}
	err = bind(h, []symbol{
		{name: "nvrtcVersion", fn: &f.nvrtcVersion},
		{name: "nvrtcCreateProgram", fn: &f.nvrtcCreateProgram},
		{name: "nvrtcCompileProgram", fn: &f.nvrtcCompileProgram},
		{name: "nvrtcGetProgramLogSize", fn: &f.nvrtcGetProgramLogSize},
		{name: "nvrtcGetProgramLog", fn: &f.nvrtcGetProgramLog},
		{name: "nvrtcGetPTXSize", fn: &f.nvrtcGetPTXSize},
		{name: "nvrtcGetPTX", fn: &f.nvrtcGetPTX},
		{name: "nvrtcDestroyProgram", fn: &f.nvrtcDestroyProgram},
		{name: "nvrtcGetErrorString", fn: &f.nvrtcGetErrorString},
		{name: "nvrtcGetCUBINSize", fn: &f.nvrtcGetCUBINSize, optional: true},
		{name: "nvrtcGetCUBIN", fn: &f.nvrtcGetCUBIN, optional: true},
		{name: "nvrtcGetNumSupportedArchs", fn: &f.nvrtcGetNumSupportedArchs, optional: true},
		{name: "nvrtcGetSupportedArchs", fn: &f.nvrtcGetSupportedArchs, optional: true},
	})
	if err != nil {
		_ = purego.Dlclose(h)
		return nil, 0, "", fmt.Errorf("not a usable NVRTC: %w", err)
	}
	if f.nvrtcGetCUBIN == nil || f.nvrtcGetCUBINSize == nil {
		f.nvrtcGetCUBIN, f.nvrtcGetCUBINSize = nil, nil
	}
	if f.nvrtcGetSupportedArchs == nil || f.nvrtcGetNumSupportedArchs == nil {
		f.nvrtcGetSupportedArchs, f.nvrtcGetNumSupportedArchs = nil, nil
	}
	return f, h, libFile(h, "nvrtcVersion", name), nil
}

// closeLib dlcloses h.
func closeLib(h uintptr) error {
	if err := purego.Dlclose(h); err != nil {
		return err
	}
	return nil
}

// libFile returns the file mapped at symbol sym of h, found in
// /proc/self/maps, or name when it cannot be found.
func libFile(h uintptr, sym, name string) string {
	addr, err := purego.Dlsym(h, sym)
	if err != nil {
		return name
	}
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return name
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 6 {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if errors.Join(err1, err2) != nil || uint64(addr) < start || uint64(addr) >= end {
			continue
		}
		if p := strings.Join(fields[5:], " "); filepath.IsAbs(p) {
			return p
		}
		return name
	}
	return name
}
