package nccl

import (
	"errors"
	"fmt"
	"strings"
	"unsafe"

	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/internal/dynlib"
)

// NCCLEnv names the environment variable that forces the NCCL library: a
// soname or path, or "off" to load none. WithNCCL takes precedence.
const NCCLEnv = "LOOM_NCCL"

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
	driver           *cuda.Lib
	initVia          string // tests: force "scalable" or "thunk"/"pointer"
}

// WithNCCL forces the NCCL library, overriding NCCLEnv: a soname or path,
// Off, or "" for the default search (libnccl.so.2, libnccl.so).
func WithNCCL(spec string) LoadOption {
	return func(c *loadConfig) { c.nccl, c.ncclSet = spec, true }
}

// WithCUDA forces the CUDA driver library that Load opens through
// device/cuda, overriding cuda.DriverEnv (LOOM_CUDA_DRIVER): a soname or
// path, Off, or "" for the default search (cuda.DriverCandidates). It is
// ignored with WithDriverLib.
func WithCUDA(spec string) LoadOption {
	return func(c *loadConfig) { c.cuda, c.cudaSet = spec, true }
}

// WithDriverLib makes Load use the CUDA driver of l, a *cuda.Lib the
// caller loaded (and keeps open while the Library is used), instead of
// loading one: the process then has one binding of the driver, shared by
// NCCL and compute. l must have the driver loaded.
func WithDriverLib(l *cuda.Lib) LoadOption {
	return func(c *loadConfig) { c.driver = l }
}

// ncclSpec returns the NCCL spec: the option's, else the environment's.
func (c *loadConfig) ncclSpec() dynlib.Spec {
	return dynlib.SpecFrom(c.nccl, c.ncclSet, NCCLEnv)
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

// Library is NCCL, loaded at run time, with the CUDA driver of a
// *cuda.Lib (device/cuda's binding: contexts, streams, events and device
// memory come from there). Load one per process and share it; it is safe
// for concurrent use and is never unloaded (NCCL keeps threads of its
// own).
type Library struct {
	cu        *cuda.Lib
	nc        ncclFns
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

// Load opens NCCL, binds its entry points and reads its version, with the
// CUDA driver of WithDriverLib or, without it, one it loads through
// device/cuda (cuda.Load with the driver of WithCUDA or cuda.DriverEnv,
// which initialises it with cuInit, and without NVRTC, which NCCL does not
// need). It fails, with an error matching ErrUnavailable, when a library
// is missing, lacks entry points, is older than MinVersion, or the driver
// finds no device; a missing library's error names the variable that
// points to another copy (LOOM_NCCL, LOOM_CUDA_DRIVER).
func Load(opts ...LoadOption) (*Library, error) {
	var cfg loadConfig
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	cu := cfg.driver
	var tried []Attempt
	if cu == nil {
		if dynlib.SpecFrom(cfg.cuda, cfg.cudaSet, cuda.DriverEnv).Off() {
			return nil, &LoadError{Library: "cuda", Reason: "disabled (" + cuda.DriverEnv + " or WithCUDA is " + Off + ")"}
		}
		copts := []cuda.Option{cuda.WithNVRTC(cuda.Off)}
		if cfg.cudaSet {
			copts = append(copts, cuda.WithDriver(cfg.cuda))
		}
		var err error
		cu, err = cuda.Load(copts...)
		var le *cuda.LoadError
		switch {
		case errors.As(err, &le):
			return nil, &LoadError{Library: "cuda", Reason: "no usable CUDA driver library", Env: cuda.DriverEnv, Tried: attempts(le.Tried)}
		case err != nil:
			return nil, &LoadError{Library: "cuda", Reason: "cuInit failed", Err: err}
		}
		tried = attempts(cu.Tried())
	} else if _, err := cu.DriverVersion(); err != nil {
		return nil, &LoadError{Library: "cuda", Reason: "the *cuda.Lib of WithDriverLib has no usable driver", Err: err}
	}
	l, err := open(cfg, tried)
	if err != nil {
		return nil, err
	}
	l.cu = cu
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
	return l, nil
}

// attempts converts device/cuda's attempts; the driver's are named "cuda".
func attempts(as []cuda.Attempt) []Attempt {
	out := make([]Attempt, 0, len(as))
	for _, a := range as {
		lib := a.Library
		if lib == "driver" {
			lib = "cuda"
		}
		out = append(out, Attempt{Library: lib, Name: a.Name, Err: a.Err})
	}
	return out
}

// Driver returns the CUDA driver binding the library uses: open the
// devices for NewComm with its Open.
func (l *Library) Driver() *cuda.Lib { return l.cu }

// Version returns NCCL's version as an NCCL_VERSION code (22803 for
// 2.28.3).
func (l *Library) Version() int { return l.version }

// NCCLPath and CUDAPath return the files the libraries were loaded from
// (the soname when the file cannot be found).
func (l *Library) NCCLPath() string { return l.ncclPath }

// CUDAPath returns the CUDA driver's file; see NCCLPath.
func (l *Library) CUDAPath() string { return l.cu.DriverPath() }

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
func (l *Library) DriverVersion() (int, error) { return l.cu.DriverVersion() }

// DeviceCount returns the number of CUDA devices.
func (l *Library) DeviceCount() (int, error) { return l.cu.DeviceCount() }

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

// String describes the library: "NCCL 2.28.3 (/usr/lib/.../libnccl.so.2.28.3)".
func (l *Library) String() string {
	return fmt.Sprintf("NCCL %s (%s), CUDA driver %s", VersionString(l.version), l.ncclPath, l.cu.DriverPath())
}
