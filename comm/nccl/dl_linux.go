//go:build linux && (amd64 || arm64)

package nccl

import (
	"errors"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// symbols lists the NCCL entry points to bind into f.
func (f *ncclFns) symbols() []dynlib.Symbol {
	return []dynlib.Symbol{
		{Name: "ncclGetVersion", Fn: &f.getVersion},
		{Name: "ncclGetUniqueId", Fn: &f.getUniqueID},
		{Name: "ncclCommInitRankConfig", Fn: &f.commInitRankConfigAddr},
		{Name: "ncclCommInitRankScalable", Fn: &f.commInitRankScalable, Optional: true},
		{Name: "ncclCommSplit", Fn: &f.commSplit, Optional: true},
		{Name: "ncclCommFinalize", Fn: &f.commFinalize},
		{Name: "ncclCommDestroy", Fn: &f.commDestroy},
		{Name: "ncclCommAbort", Fn: &f.commAbort},
		{Name: "ncclCommGetAsyncError", Fn: &f.commGetAsyncError},
		{Name: "ncclCommCount", Fn: &f.commCount},
		{Name: "ncclCommUserRank", Fn: &f.commUserRank},
		{Name: "ncclGetErrorString", Fn: &f.getErrorString},
		{Name: "ncclGetLastError", Fn: &f.getLastError, Optional: true},
		{Name: "ncclAllReduce", Fn: &f.allReduce},
		{Name: "ncclBroadcast", Fn: &f.broadcast},
		{Name: "ncclReduce", Fn: &f.reduce},
		{Name: "ncclAllGather", Fn: &f.allGather},
		{Name: "ncclReduceScatter", Fn: &f.reduceScatter},
		{Name: "ncclAlltoAll", Fn: &f.allToAll, Optional: true},
		{Name: "ncclGather", Fn: &f.gather, Optional: true},
		{Name: "ncclScatter", Fn: &f.scatter, Optional: true},
		{Name: "ncclSend", Fn: &f.send},
		{Name: "ncclRecv", Fn: &f.recv},
		{Name: "ncclGroupStart", Fn: &f.groupStart},
		{Name: "ncclGroupEnd", Fn: &f.groupEnd},
	}
}

// open dlopens NCCL (RTLD_NOW | RTLD_LOCAL; never closed) and binds its
// entry points; tried are the driver's attempts, listed first.
func open(cfg loadConfig, tried []Attempt) (*Library, error) {
	spec := cfg.ncclSpec()
	if spec.Off() {
		return nil, &LoadError{Library: "nccl", Reason: "disabled (" + NCCLEnv + " or WithNCCL is " + Off + ")"}
	}
	l := &Library{tried: tried}
	nc, ncLib, ncTried, err := dynlib.First(spec.Search("nccl", "libnccl.so.2", "libnccl.so"), dynlib.BindNew((*ncclFns).symbols))
	l.tried = append(l.tried, dynlib.AttemptsAs[Attempt](ncTried)...)
	if err != nil {
		return nil, &LoadError{Library: "nccl", Reason: "no usable NCCL library", Env: NCCLEnv, Tried: l.tried}
	}
	l.nc, l.ncclPath = *nc, ncLib.Path("ncclGetVersion")
	init, via, err := initRankFor(&l.nc, cfg.initVia)
	if err != nil {
		return nil, &LoadError{Library: "nccl", Reason: "cannot call ncclCommInitRankConfig", Tried: l.tried, Err: err}
	}
	l.initRank, l.initVia = init, via
	return l, nil
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
