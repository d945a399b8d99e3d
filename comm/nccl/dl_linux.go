//go:build linux && (amd64 || arm64)

package nccl

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

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
// returns an error naming the missing required symbols. purego's
// registration panics only for a Go signature it cannot call; that is
// returned as an error too.
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
		if p, ok := s.fn.(*uintptr); ok {
			*p = addr
			continue
		}
		purego.RegisterFunc(s.fn, addr)
	}
	if len(missing) > 0 {
		return fmt.Errorf("missing symbols %s", strings.Join(missing, ", "))
	}
	return nil
}

func (f *cudaFns) symbols() []symbol {
	return []symbol{
		{name: "cuInit", fn: &f.init},
		{name: "cuDriverGetVersion", fn: &f.driverGetVersion},
		{name: "cuDeviceGetCount", fn: &f.deviceGetCount},
		{name: "cuDeviceGet", fn: &f.deviceGet},
		{name: "cuDevicePrimaryCtxRetain", fn: &f.devicePrimaryCtxRetain},
		{name: "cuDevicePrimaryCtxRelease_v2", fn: &f.devicePrimaryCtxRelease},
		{name: "cuCtxSetCurrent", fn: &f.ctxSetCurrent},
		{name: "cuCtxSynchronize", fn: &f.ctxSynchronize},
		{name: "cuStreamCreate", fn: &f.streamCreate},
		{name: "cuStreamDestroy_v2", fn: &f.streamDestroy},
		{name: "cuStreamSynchronize", fn: &f.streamSynchronize},
		{name: "cuStreamQuery", fn: &f.streamQuery},
		{name: "cuStreamWaitEvent", fn: &f.streamWaitEvent},
		{name: "cuEventCreate", fn: &f.eventCreate},
		{name: "cuEventRecord", fn: &f.eventRecord},
		{name: "cuEventQuery", fn: &f.eventQuery},
		{name: "cuEventSynchronize", fn: &f.eventSynchronize},
		{name: "cuEventDestroy_v2", fn: &f.eventDestroy},
		{name: "cuMemAlloc_v2", fn: &f.memAlloc},
		{name: "cuMemFree_v2", fn: &f.memFree},
		{name: "cuMemcpyHtoD_v2", fn: &f.memcpyHtoD},
		{name: "cuMemcpyDtoH_v2", fn: &f.memcpyDtoH},
		{name: "cuDeviceGetPCIBusId", fn: &f.deviceGetPCIBusID, optional: true},
		{name: "cuGetErrorName", fn: &f.getErrorName},
		{name: "cuGetErrorString", fn: &f.getErrorString},
	}
}

func (f *ncclFns) symbols() []symbol {
	return []symbol{
		{name: "ncclGetVersion", fn: &f.getVersion},
		{name: "ncclGetUniqueId", fn: &f.getUniqueID},
		{name: "ncclCommInitRankConfig", fn: &f.commInitRankConfigAddr},
		{name: "ncclCommInitRankScalable", fn: &f.commInitRankScalable, optional: true},
		{name: "ncclCommSplit", fn: &f.commSplit, optional: true},
		{name: "ncclCommFinalize", fn: &f.commFinalize},
		{name: "ncclCommDestroy", fn: &f.commDestroy},
		{name: "ncclCommAbort", fn: &f.commAbort},
		{name: "ncclCommGetAsyncError", fn: &f.commGetAsyncError},
		{name: "ncclCommCount", fn: &f.commCount},
		{name: "ncclCommUserRank", fn: &f.commUserRank},
		{name: "ncclGetErrorString", fn: &f.getErrorString},
		{name: "ncclGetLastError", fn: &f.getLastError, optional: true},
		{name: "ncclAllReduce", fn: &f.allReduce},
		{name: "ncclBroadcast", fn: &f.broadcast},
		{name: "ncclReduce", fn: &f.reduce},
		{name: "ncclAllGather", fn: &f.allGather},
		{name: "ncclReduceScatter", fn: &f.reduceScatter},
		{name: "ncclAlltoAll", fn: &f.allToAll, optional: true},
		{name: "ncclGather", fn: &f.gather, optional: true},
		{name: "ncclScatter", fn: &f.scatter, optional: true},
		{name: "ncclSend", fn: &f.send},
		{name: "ncclRecv", fn: &f.recv},
		{name: "ncclGroupStart", fn: &f.groupStart},
		{name: "ncclGroupEnd", fn: &f.groupEnd},
	}
}

// open dlopens the CUDA driver and NCCL (RTLD_NOW | RTLD_LOCAL; never
// closed) and binds their entry points.
func open(cfg loadConfig) (*Library, error) {
	l := &Library{}
	if cfg.cuda == Off || cfg.nccl == Off {
		lib := "cuda"
		if cfg.nccl == Off {
			lib = "nccl"
		}
		return nil, &LoadError{Library: lib, Reason: "disabled (" + Off + ")"}
	}
	cudaNames := candidates(cfg.cuda, "libcuda.so.1", "libcuda.so")
	for _, name := range cudaNames {
		path, err := dlopenBind(name, l.cu.symbols(), "cuInit")
		l.tried = append(l.tried, Attempt{Library: "cuda", Name: name, Err: err})
		if err == nil {
			l.cudaPath = path
			break
		}
	}
	if l.cudaPath == "" {
		return nil, &LoadError{Library: "cuda", Reason: "no usable CUDA driver library", Tried: l.tried}
	}
	ncclNames := candidates(cfg.nccl, "libnccl.so.2", "libnccl.so")
	for _, name := range ncclNames {
		path, err := dlopenBind(name, l.nc.symbols(), "ncclGetVersion")
		l.tried = append(l.tried, Attempt{Library: "nccl", Name: name, Err: err})
		if err == nil {
			l.ncclPath = path
			break
		}
	}
	if l.ncclPath == "" {
		return nil, &LoadError{Library: "nccl", Reason: "no usable NCCL library", Tried: l.tried}
	}
	init, via, err := initRankFor(&l.nc, cfg.initVia)
	if err != nil {
		return nil, &LoadError{Library: "nccl", Reason: "cannot call ncclCommInitRankConfig", Tried: l.tried, Err: err}
	}
	l.initRank, l.initVia = init, via
	return l, nil
}

// dlopenBind opens name and binds syms; it returns the library's file.
func dlopenBind(name string, syms []symbol, probe string) (string, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return "", err
	}
	if err := bind(h, syms); err != nil {
		_ = purego.Dlclose(h)
		return "", err
	}
	path := name
	if addr, err := purego.Dlsym(h, probe); err == nil {
		if p := mappedFile(addr); p != "" {
			path = p
		}
	}
	return path, nil
}

// mappedFile finds the file mapped at addr in /proc/self/maps; "" when it
// cannot.
func mappedFile(addr uintptr) string {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return ""
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
		if err1 != nil || err2 != nil || uint64(addr) < start || uint64(addr) >= end {
			continue
		}
		if p := strings.Join(fields[5:], " "); filepath.IsAbs(p) {
			return p
		}
		return ""
	}
	return ""
}

// errNoScalable: the scalable path was asked for but the library lacks it.
var errNoScalable = errors.New("ncclCommInitRankScalable is not exported (NCCL < 2.23)")

// scalableInit passes the id by pointer through ncclCommInitRankScalable
// with one id, which NCCL 2.23 and later treat like ncclCommInitRankConfig.
func scalableInit(f *ncclFns) (initRankFunc, error) {
	if f.commInitRankScalable == nil {
		return nil, errNoScalable
	}
	fn := f.commInitRankScalable
	return func(comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32 {
		return fn(comm, nranks, rank, 1, id, cfg)
	}, nil
}
