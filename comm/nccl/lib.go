package nccl

import (
	"fmt"
	"strings"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// NCCLEnv names the environment variable that forces the NCCL library: a
// soname or path, or "off" to load none. WithNCCL takes precedence.
const NCCLEnv = "LOOM_NCCL"

// CUDAEnv names the environment variable that forces the CUDA driver
// library (the same variable device/cuda reads): a soname or path, or
// "off". WithCUDA takes precedence.
const CUDAEnv = "LOOM_CUDA_DRIVER"

// Off is the library spec that loads nothing (Load then fails with
// ErrUnavailable).
const Off = "off"

// UniqueIDBytes is NCCL_UNIQUE_ID_BYTES.
const UniqueIDBytes = 128

// UniqueID is an ncclUniqueId: the bootstrap address that rank 0 creates
// with Library.UniqueID and every rank passes to NewCommFromID. NCCL takes
// it by value (128 bytes); see the package documentation for how.
type UniqueID [UniqueIDBytes]byte

// LoadOption configures Load.
type LoadOption func(*loadConfig)

type loadConfig struct {
	nccl, cuda       string
	ncclSet, cudaSet bool
	initVia          string // tests: force "scalable" or "thunk"/"pointer"
}

// WithNCCL forces the NCCL library, overriding NCCLEnv: a soname or path,
// Off, or "" for the default search (libnccl.so.2, libnccl.so).
func WithNCCL(spec string) LoadOption {
	return func(c *loadConfig) { c.nccl, c.ncclSet = spec, true }
}

// WithCUDA forces the CUDA driver library, overriding CUDAEnv: a soname
// or path, Off, or "" for the default search (libcuda.so.1, libcuda.so).
func WithCUDA(spec string) LoadOption {
	return func(c *loadConfig) { c.cuda, c.cudaSet = spec, true }
}

// specs returns the NCCL and CUDA driver specs: the options', else the
// environment's.
func (c *loadConfig) specs() (nccl, cuda dynlib.Spec) {
	return dynlib.SpecFrom(c.nccl, c.ncclSet, NCCLEnv), dynlib.SpecFrom(c.cuda, c.cudaSet, CUDAEnv)
}

// cudaFns are the CUDA driver entry points (the _v2 names where cuda.h
// maps the plain name to one). Every one returns a CUresult.
type cudaFns struct {
	init                    func(flags uint32) int32
	driverGetVersion        func(v *int32) int32
	deviceGetCount          func(n *int32) int32
	deviceGet               func(dev *int32, ordinal int32) int32
	devicePrimaryCtxRetain  func(ctx *uintptr, dev int32) int32
	devicePrimaryCtxRelease func(dev int32) int32
	ctxSetCurrent           func(ctx uintptr) int32
	ctxSynchronize          func() int32
	streamCreate            func(s *uintptr, flags uint32) int32
	streamDestroy           func(s uintptr) int32
	streamSynchronize       func(s uintptr) int32
	streamQuery             func(s uintptr) int32
	streamWaitEvent         func(s, e uintptr, flags uint32) int32
	eventCreate             func(e *uintptr, flags uint32) int32
	eventRecord             func(e, s uintptr) int32
	eventQuery              func(e uintptr) int32
	eventSynchronize        func(e uintptr) int32
	eventDestroy            func(e uintptr) int32
	memAlloc                func(p *uintptr, bytes uintptr) int32
	memFree                 func(p uintptr) int32
	memcpyHtoD              func(dst uintptr, src unsafe.Pointer, bytes uintptr) int32
	memcpyDtoH              func(dst unsafe.Pointer, src uintptr, bytes uintptr) int32
	deviceGetPCIBusID       func(buf *byte, n int32, dev int32) int32 // optional
	getErrorName            func(rc int32, s **byte) int32
	getErrorString          func(rc int32, s **byte) int32
}

// ncclFns are the NCCL entry points. Every one returns an ncclResult_t
// except the string functions.
type ncclFns struct {
	getVersion             func(v *int32) int32
	getUniqueID            func(id *UniqueID) int32
	commInitRankConfigAddr uintptr // called through initRank (the id is by value)
	commInitRankScalable   func(comm *uintptr, nranks, rank, nID int32, ids *UniqueID, cfg unsafe.Pointer) int32
	commSplit              func(comm uintptr, color, key int32, newcomm *uintptr, cfg unsafe.Pointer) int32
	commFinalize           func(comm uintptr) int32
	commDestroy            func(comm uintptr) int32
	commAbort              func(comm uintptr) int32
	commGetAsyncError      func(comm uintptr, res *int32) int32
	commCount              func(comm uintptr, n *int32) int32
	commUserRank           func(comm uintptr, r *int32) int32
	getErrorString         func(rc int32) string
	getLastError           func(comm uintptr) string
	allReduce              func(send, recv, count uintptr, dt, op int32, comm, stream uintptr) int32
	broadcast              func(send, recv, count uintptr, dt, root int32, comm, stream uintptr) int32
	reduce                 func(send, recv, count uintptr, dt, op, root int32, comm, stream uintptr) int32
	allGather              func(send, recv, count uintptr, dt int32, comm, stream uintptr) int32
	reduceScatter          func(send, recv, count uintptr, dt, op int32, comm, stream uintptr) int32
	allToAll               func(send, recv, count uintptr, dt int32, comm, stream uintptr) int32
	gather                 func(send, recv, count uintptr, dt, root int32, comm, stream uintptr) int32
	scatter                func(send, recv, count uintptr, dt, root int32, comm, stream uintptr) int32
	send                   func(buf, count uintptr, dt, peer int32, comm, stream uintptr) int32
	recv                   func(buf, count uintptr, dt, peer int32, comm, stream uintptr) int32
	groupStart             func() int32
	groupEnd               func() int32
}

// Library is NCCL and the CUDA driver, loaded at run time. Load one per
// process and share it; it is safe for concurrent use and is never
// unloaded (NCCL and the driver keep threads of their own).
type Library struct {
	cu        cudaFns
	nc        ncclFns
	cudaPath  string
	ncclPath  string
	tried     []Attempt
	version   int
	layout    ConfigLayout
	initRank  initRankFunc
	initVia   string
	nativeA2A bool
	split     bool
}

// initRankFunc calls ncclCommInitRankConfig, passing id by value.
type initRankFunc func(comm *uintptr, nranks int32, id *UniqueID, rank int32, cfg unsafe.Pointer) int32

// Load opens the CUDA driver and NCCL, binds their entry points, reads
// NCCL's version and initialises the driver (cuInit). It fails, with an
// error matching ErrUnavailable, when a library is missing, lacks entry
// points, is older than MinVersion, or the driver finds no device.
func Load(opts ...LoadOption) (*Library, error) {
	var cfg loadConfig
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	l, err := open(cfg)
	if err != nil {
		return nil, err
	}
	var v int32
	if rc := l.nc.getVersion(&v); rc != 0 {
		return nil, &LoadError{Library: "nccl", Reason: "ncclGetVersion failed", Tried: l.tried, Err: l.ncclError("ncclGetVersion", rc, 0)}
	}
	l.version = int(v)
	layout, err := LayoutFor(l.version)
	if err != nil {
		return nil, &LoadError{Library: "nccl", Reason: "unsupported version", Tried: l.tried, Err: err}
	}
	l.layout = layout
	l.nativeA2A = l.nc.allToAll != nil && l.nc.gather != nil && l.nc.scatter != nil && l.version >= 22800
	l.split = l.nc.commSplit != nil && l.version >= 21800
	if rc := l.cu.init(0); rc != 0 {
		return nil, &LoadError{Library: "cuda", Reason: "cuInit failed", Tried: l.tried, Err: l.cudaError("cuInit", rc)}
	}
	return l, nil
}

// Version returns NCCL's version as an NCCL_VERSION code (22803 for
// 2.28.3).
func (l *Library) Version() int { return l.version }

// NCCLPath and CUDAPath return the files the libraries were loaded from
// (the soname when the file cannot be found).
func (l *Library) NCCLPath() string { return l.ncclPath }

// CUDAPath returns the CUDA driver's file; see NCCLPath.
func (l *Library) CUDAPath() string { return l.cudaPath }

// Tried lists the libraries Load tried, in order, and why each was
// rejected or kept.
func (l *Library) Tried() []Attempt { return append([]Attempt(nil), l.tried...) }

// ConfigLayout returns the ncclConfig_t layout used with this NCCL.
func (l *Library) ConfigLayout() ConfigLayout { return l.layout }

// HasSplit reports whether ncclCommSplit is available (NCCL 2.18).
func (l *Library) HasSplit() bool { return l.split }

// HasNativeAllToAll reports whether AllToAll, Gather and Scatter use
// ncclAlltoAll, ncclGather and ncclScatter (NCCL 2.28); otherwise they
// are grouped ncclSend/ncclRecv.
func (l *Library) HasNativeAllToAll() bool { return l.nativeA2A }

// InitPath names how ncclCommInitRankConfig receives the 128-byte unique
// id by value on this platform: "thunk" (an x86-64 call stub that copies
// it onto the stack), "pointer" (arm64, where the ABI passes a pointer to
// a copy) or "scalable" (ncclCommInitRankScalable, which takes a pointer).
func (l *Library) InitPath() string { return l.initVia }

// DriverVersion returns the CUDA driver's version (12040 for 12.4).
func (l *Library) DriverVersion() (int, error) {
	var v int32
	if rc := l.cu.driverGetVersion(&v); rc != 0 {
		return 0, l.cudaError("cuDriverGetVersion", rc)
	}
	return int(v), nil
}

// DeviceCount returns the number of CUDA devices.
func (l *Library) DeviceCount() (int, error) {
	var n int32
	if rc := l.cu.deviceGetCount(&n); rc != 0 {
		return 0, l.cudaError("cuDeviceGetCount", rc)
	}
	return int(n), nil
}

// UniqueID creates a new NCCL unique id (ncclGetUniqueId): rank 0 makes
// one per communicator and shares it with the others.
func (l *Library) UniqueID() (UniqueID, error) {
	var id UniqueID
	if rc := l.nc.getUniqueID(&id); rc != 0 {
		return id, l.ncclError("ncclGetUniqueId", rc, 0)
	}
	return id, nil
}

// ncclError describes a failed NCCL call; comm, if not 0, is asked for
// its last error.
func (l *Library) ncclError(call string, rc int32, comm uintptr) *NCCLError {
	e := &NCCLError{Call: call, Code: Result(rc)}
	if l.nc.getErrorString != nil {
		e.Msg = l.nc.getErrorString(rc)
	}
	if l.nc.getLastError != nil {
		e.Detail = strings.TrimSpace(l.nc.getLastError(comm))
	}
	return e
}

// cudaError describes a failed CUDA driver call.
func (l *Library) cudaError(call string, rc int32) *CUDAError {
	e := &CUDAError{Call: call, Code: CUDAResult(rc)}
	var s *byte
	if l.cu.getErrorName != nil && l.cu.getErrorName(rc, &s) == 0 {
		e.Name = goString(s)
	}
	s = nil
	if l.cu.getErrorString != nil && l.cu.getErrorString(rc, &s) == 0 {
		e.Msg = goString(s)
	}
	return e
}

// goString copies a NUL-terminated C string (at most 4 KiB of it).
func goString(p *byte) string {
	if p == nil {
		return ""
	}
	var b []byte
	for i := 0; i < 4096; i++ {
		c := *(*byte)(unsafe.Add(unsafe.Pointer(p), i))
		if c == 0 {
			break
		}
		b = append(b, c)
	}
	return string(b)
}

// String describes the library: "NCCL 2.28.3 (/usr/lib/.../libnccl.so.2.28.3)".
func (l *Library) String() string {
	return fmt.Sprintf("NCCL %s (%s), CUDA driver %s", VersionString(l.version), l.ncclPath, l.cudaPath)
}
