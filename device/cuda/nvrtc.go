package cuda

import (
	"fmt"
	"runtime"
	"slices"
	"unsafe"
)

// NVRTCVersion returns NVRTC's CUDA version (nvrtcVersion), e.g. 12, 4.
func (l *Lib) NVRTCVersion() (major, minor int, err error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	r, err := l.nvrtc("NVRTCVersion")
	if err != nil {
		return 0, 0, err
	}
	var a, b int32
	if e := l.rtcCheck("nvrtcVersion", r.nvrtcVersion(&a, &b), ""); e != nil {
		return 0, 0, e
	}
	return int(a), int(b), nil
}

// SupportedArchs returns the real architectures NVRTC can compile for, as
// compute capabilities ×10 ascending (75, 80, ..., 90), from
// nvrtcGetSupportedArchs. It returns nil and no error for an NVRTC older
// than CUDA 11.2, which cannot say.
func (l *Lib) SupportedArchs() ([]int, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	r, err := l.nvrtc("SupportedArchs")
	if err != nil {
		return nil, err
	}
	if r.nvrtcGetSupportedArchs == nil {
		return nil, nil
	}
	var n int32
	if e := l.rtcCheck("nvrtcGetNumSupportedArchs", r.nvrtcGetNumSupportedArchs(&n), ""); e != nil {
		return nil, e
	}
	if n <= 0 {
		return nil, nil
	}
	a := make([]int32, n)
	if e := l.rtcCheck("nvrtcGetSupportedArchs", r.nvrtcGetSupportedArchs(&a[0]), ""); e != nil {
		return nil, e
	}
	out := make([]int, n)
	for i, v := range a {
		out[i] = int(v)
	}
	slices.Sort(out)
	return out, nil
}

// CompileOptions configures [Lib.Compile].
type CompileOptions struct {
	// Arch is the target compute capability ×10 (90 for sm_90); it must
	// be set.
	Arch int
	// PTX asks for PTX for the virtual architecture compute_<Arch>, which
	// the driver compiles when loading, instead of a cubin for sm_<Arch>.
	// Compile also falls back to PTX when NVRTC cannot emit cubins.
	PTX bool
	// Extra are further NVRTC options, e.g. "-lineinfo" or "-DNAME=1".
	Extra []string
}

// Program is the result of [Lib.Compile].
type Program struct {
	// Image is the cubin, or the NUL-terminated PTX when PTX is true;
	// [Context.LoadModule] takes either.
	Image []byte
	// PTX is true when Image is PTX.
	PTX bool
	// Log is NVRTC's compilation log (warnings), often empty; empty when
	// Cached.
	Log string
	// Options are the options the program was compiled with.
	Options []string
	// Cached is true when Image came from the on-disk kernel cache
	// ([KernelCacheEnv]) instead of NVRTC.
	Cached bool
	// CacheErr says why a freshly compiled program could not be stored
	// in the kernel cache (a read-only folder, a full disk); nil when it
	// was stored, came from the cache, or the cache is off. It does not
	// fail the compilation.
	CacheErr error
}

// CompileFlags returns the NVRTC options Compile passes for o: the
// architecture (--gpu-architecture=sm_XX, or compute_XX for PTX) and -std=c++17,
// then o.Extra.
func CompileFlags(o CompileOptions) []string {
	arch := fmt.Sprintf("--gpu-architecture=sm_%d", o.Arch)
	if o.PTX {
		arch = fmt.Sprintf("--gpu-architecture=compute_%d", o.Arch)
	}
	return append([]string{arch, "-std=c++17"}, o.Extra...)
}

// Compile compiles CUDA C++ source src (name is used in messages) with
// NVRTC, or, when the kernel cache ([KernelCacheEnv]) is on, takes the
// image from the cache file of the same source, options, target and NVRTC
// version (Program.Cached), storing a fresh compilation there. It returns
// a [*CompileError] with NVRTC's log when the source does not compile, and
// an [*Error] for any other failed call. The program is destroyed before
// Compile returns.
func (l *Lib) Compile(src, name string, o CompileOptions) (*Program, error) {
	l.mu.RLock()
	defer l.mu.RUnlock()
	r, err := l.nvrtc("Compile")
	if err != nil {
		return nil, err
	}
	if o.Arch <= 0 {
		return nil, fmt.Errorf("cuda: Compile %s: %w: no target architecture", name, ErrInvalid)
	}
	if r.nvrtcGetCUBIN == nil {
		o.PTX = true
	}
	opts := CompileFlags(o)
	what := "compiling " + name
	if l.cacheDir == "" {
		return l.compile(r, src, name, o.PTX, opts)
	}
	var major, minor int32
	if e := l.rtcCheck("nvrtcVersion", r.nvrtcVersion(&major, &minor), what); e != nil {
		return nil, e
	}
	file := cachePath(l.cacheDir, cacheKey(src, opts, o.Arch, o.PTX, int(major), int(minor)), o.PTX)
	if image := readCache(file); image != nil {
		return &Program{Image: image, PTX: o.PTX, Options: opts, Cached: true}, nil
	}
	p, err := l.compile(r, src, name, o.PTX, opts)
	if err != nil {
		return nil, err
	}
	p.CacheErr = writeCache(l.cacheDir, file, p.Image)
	return p, nil
}

// compile runs NVRTC on src (called name in its messages) with opts and returns the cubin, or the PTX
// when ptx is set. The caller holds l.mu.RLock.
func (l *Lib) compile(r *nvrtcFns, src, name string, ptx bool, opts []string) (*Program, error) {
	what := "compiling " + name
	var prog uintptr
	if e := l.rtcCheck("nvrtcCreateProgram", r.nvrtcCreateProgram(&prog, src, name, 0, nil, nil), what); e != nil {
		return nil, e
	}
	defer r.nvrtcDestroyProgram(&prog)

	res := compileWithOptions(r, prog, opts)
	log, logErr := l.programLog(r, prog, what)
	if e := l.rtcCheck("nvrtcCompileProgram", res, what); e != nil {
		if logErr != nil {
			log = "(no log: " + logErr.Error() + ")"
		}
		return nil, &CompileError{Err: e, Log: log, Options: opts}
	}
	p := &Program{PTX: ptx, Log: log, Options: opts}
	sizeFn, getFn, sizeCall, getCall := r.nvrtcGetCUBINSize, r.nvrtcGetCUBIN, "nvrtcGetCUBINSize", "nvrtcGetCUBIN"
	if ptx {
		sizeFn, getFn, sizeCall, getCall = r.nvrtcGetPTXSize, r.nvrtcGetPTX, "nvrtcGetPTXSize", "nvrtcGetPTX"
	}
	var n uintptr
	if e := l.rtcCheck(sizeCall, sizeFn(prog, &n), what); e != nil {
		return nil, e
	}
	if n == 0 {
		return nil, fmt.Errorf("cuda: %s: %s returned an empty image", what, sizeCall)
	}
	p.Image = make([]byte, n)
	if e := l.rtcCheck(getCall, getFn(prog, &p.Image[0]), what); e != nil {
		return nil, e
	}
	return p, nil
}

// compileWithOptions calls nvrtcCompileProgram with opts as a pinned
// array of pinned NUL-terminated strings.
func compileWithOptions(r *nvrtcFns, prog uintptr, opts []string) int32 {
	var pin runtime.Pinner
	defer pin.Unpin()
	ptrs := make([]*byte, len(opts))
	for i, o := range opts {
		b := append([]byte(o), 0)
		pin.Pin(&b[0])
		ptrs[i] = &b[0]
	}
	var arr unsafe.Pointer
	if len(ptrs) > 0 {
		pin.Pin(&ptrs[0])
		arr = unsafe.Pointer(&ptrs[0])
	}
	return r.nvrtcCompileProgram(prog, int32(len(opts)), arr)
}

// programLog returns the program's compilation log.
func (l *Lib) programLog(r *nvrtcFns, prog uintptr, what string) (string, error) {
	var n uintptr
	if e := l.rtcCheck("nvrtcGetProgramLogSize", r.nvrtcGetProgramLogSize(prog, &n), what); e != nil {
		return "", e
	}
	if n <= 1 {
		return "", nil
	}
	buf := make([]byte, n)
	if e := l.rtcCheck("nvrtcGetProgramLog", r.nvrtcGetProgramLog(prog, &buf[0]), what); e != nil {
		return "", e
	}
	return goString(&buf[0]), nil
}
