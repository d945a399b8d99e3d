package cuda

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// DriverEnv names the environment variable that forces the CUDA driver
// library: a soname or path, or "off" to load none. [WithDriver] takes
// precedence.
const DriverEnv = "LOOM_CUDA_DRIVER"

// NVRTCEnv names the environment variable that forces the NVRTC library: a
// soname or path, or "off" to load none. [WithNVRTC] takes precedence.
const NVRTCEnv = "LOOM_NVRTC"

// Off is the library spec that skips a library.
const Off = "off"

// Option configures [Load].
type Option func(*loadConfig)

type loadConfig struct {
	driver, nvrtc, cache          string
	driverSet, nvrtcSet, cacheSet bool
}

// WithDriver forces the CUDA driver library, overriding [DriverEnv]: a
// soname or path, [Off] to load none, or "" for the automatic search.
func WithDriver(spec string) Option {
	return func(c *loadConfig) { c.driver, c.driverSet = spec, true }
}

// WithNVRTC forces the NVRTC library, overriding [NVRTCEnv]: a soname or
// path, [Off] to load none, or "" for the automatic search.
func WithNVRTC(spec string) Option {
	return func(c *loadConfig) { c.nvrtc, c.nvrtcSet = spec, true }
}

// Attempt is one library [Load] tried.
type Attempt struct {
	// Library is "driver" or "nvrtc".
	Library string
	// Name is the soname or path passed to dlopen.
	Name string
	// Err says why it was rejected; nil for the one that was kept.
	Err error
}

// String formats the attempt as "driver libcuda.so.1: <reason>" or
// "driver libcuda.so.1: ok".
func (a Attempt) String() string { return dynlib.Attempt(a).String() }

// LoadError is returned by [Load] when a library that is needed cannot be
// loaded. Tried lists every candidate of every library and why it failed.
type LoadError struct {
	// Library is "driver" or "nvrtc", the one that did not load.
	Library string
	// Forced is true when the library was forced by an option or an
	// environment variable.
	Forced bool
	// Tried lists the attempts of both libraries, in order.
	Tried []Attempt
}

// Error lists the failed attempts of the library that did not load and
// names the variable that points to another copy.
func (e *LoadError) Error() string {
	var b strings.Builder
	what, env := "no CUDA driver library", DriverEnv
	if e.Library == "nvrtc" {
		what, env = "no NVRTC library", NVRTCEnv
	}
	fmt.Fprintf(&b, "cuda: %s could be loaded", what)
	if e.Forced {
		b.WriteString(" (forced)")
	}
	b.WriteString("; tried")
	n := 0
	for _, a := range e.Tried {
		if a.Library != e.Library {
			continue
		}
		if n > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(&b, " %s (%v)", a.Name, a.Err)
		n++
	}
	if n == 0 {
		b.WriteString(" nothing")
	}
	fmt.Fprintf(&b, "; set %s to the path of another copy", env)
	return b.String()
}

// Error is a failed CUDA driver or NVRTC call.
type Error struct {
	// Call is the C function that failed, e.g. "cuMemAlloc_v2".
	Call string
	// Code is its CUresult or nvrtcResult.
	Code int
	// Name is the symbolic name of Code when the library gives one, e.g.
	// "CUDA_ERROR_OUT_OF_MEMORY" or "NVRTC_ERROR_COMPILATION".
	Name string
	// Msg is the library's description of Code.
	Msg string
	// Context says what loom was doing, e.g. "allocating 4096 bytes".
	Context string
}

// Error formats the call, the code and its description.
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString("cuda: ")
	if e.Context != "" {
		b.WriteString(e.Context)
		b.WriteString(": ")
	}
	fmt.Fprintf(&b, "%s failed with %d", e.Call, e.Code)
	if e.Name != "" {
		b.WriteString(" " + e.Name)
	}
	if e.Msg != "" {
		b.WriteString(" (" + e.Msg + ")")
	}
	return b.String()
}

// CompileError is returned when NVRTC rejects a program; Log is NVRTC's
// compilation log.
type CompileError struct {
	// Err is the failed nvrtcCompileProgram call.
	Err *Error
	// Log is NVRTC's compilation log: the errors, with line numbers.
	Log string
	// Options are the options the program was compiled with.
	Options []string
}

// Error gives the failed call and the log.
func (e *CompileError) Error() string {
	return fmt.Sprintf("%v with options %q:\n%s", e.Err, e.Options, strings.TrimSpace(e.Log))
}

// Unwrap returns the failed call's *Error.
func (e *CompileError) Unwrap() error { return e.Err }

// DriverCandidates returns the driver sonames and paths [Load] tries when
// none is forced: libcuda.so.1 (installed with the driver), libcuda.so,
// and WSL's /usr/lib/wsl/lib/libcuda.so.1.
func DriverCandidates() []string {
	return []string{"libcuda.so.1", "libcuda.so", "/usr/lib/wsl/lib/libcuda.so.1"}
}

// NVRTCCandidates returns the NVRTC sonames and paths [Load] tries when none
// is forced: the sonames libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so.11.2
// (CUDA 11.3-11.8) and libnvrtc.so, then every libnvrtc.so.* found in
// $CUDA_HOME/lib64, $CUDA_PATH/lib64, /usr/local/cuda/lib64,
// /usr/local/cuda-*/lib64 and /usr/local/cuda/targets/*/lib, newest version
// first.
func NVRTCCandidates() []string {
	return nvrtcCandidates(os.Getenv, filepath.Glob)
}

// nvrtcCandidates is NVRTCCandidates with its environment and file system
// passed in.
func nvrtcCandidates(getenv func(string) string, glob func(string) ([]string, error)) []string {
	out := []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"}
	var dirs []string
	for _, v := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := getenv(v); d != "" {
			dirs = append(dirs, filepath.Join(d, "lib64"))
		}
	}
	dirs = append(dirs, "/usr/local/cuda/lib64", "/usr/local/cuda-*/lib64", "/usr/local/cuda/targets/*/lib")
	var found []string
	for _, d := range dirs {
		m, err := glob(filepath.Join(d, "libnvrtc.so.*"))
		if err != nil {
			continue
		}
		found = append(found, m...)
	}
	// Newest version first: compare the dotted numbers after ".so.".
	slices.SortStableFunc(found, func(a, b string) int { return -compareSoVersion(a, b) })
	for _, f := range found {
		if !slices.Contains(out, f) {
			out = append(out, f)
		}
	}
	return out
}

// compareSoVersion orders two library paths by the numeric version after
// ".so." (12.4.127 > 12.4.99 > 11.8); equal versions compare equal, so a
// stable sort keeps the search order among them.
func compareSoVersion(a, b string) int {
	va, vb := soVersion(a), soVersion(b)
	for i := range max(len(va), len(vb)) {
		x, y := -1, -1
		if i < len(va) {
			x = va[i]
		}
		if i < len(vb) {
			y = vb[i]
		}
		if x != y {
			if x < y {
				return -1
			}
			return 1
		}
	}
	return 0
}

func soVersion(p string) []int {
	_, v, ok := strings.Cut(filepath.Base(p), ".so.")
	if !ok {
		return nil
	}
	var out []int
	for f := range strings.SplitSeq(v, ".") {
		n, err := strconv.Atoi(f)
		if err != nil {
			break
		}
		out = append(out, n)
	}
	return out
}

// Lib is an opened CUDA driver and NVRTC. It is safe for concurrent use;
// Close it when done (after closing every [Context] made from it).
type Lib struct {
	driverPath, nvrtcPath string
	tried                 []Attempt
	cacheDir              string // on-disk kernel cache; "" when off

	drv    *driverFns // nil when the driver is off
	rtc    *nvrtcFns  // nil when NVRTC is off or was not found
	rtcErr *LoadError // why rtc is nil when NVRTC was searched for and not found

	mu     sync.RWMutex
	closed bool
	rtcLib *dynlib.Library // NVRTC, closed by Close; nil when off
}

// Load opens the CUDA driver and NVRTC as configured by opts, [DriverEnv]
// and [NVRTCEnv], and initialises the driver (cuInit). An NVRTC that the
// automatic search does not find is no error here: the Lib works without
// it, and what compiles returns the [*LoadError] then. The kernel cache
// folder is chosen here too ([KernelCacheEnv]) but made only when a
// program is first stored. It returns a
// [*LoadError] listing every attempt when a needed library cannot be
// loaded, and an [*Error] when cuInit fails (for example
// CUDA_ERROR_NO_DEVICE on a machine with a driver but no GPU).
func Load(opts ...Option) (*Lib, error) {
	var c loadConfig
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	l := &Lib{cacheDir: kernelCacheDir(c, os.Getenv, os.UserCacheDir)}
	if driver := dynlib.SpecFrom(c.driver, c.driverSet, DriverEnv); !driver.Off() {
		f, lib, tried, err := dynlib.First(driver.Search("driver", DriverCandidates()...), openDriver)
		l.tried = append(l.tried, dynlib.AttemptsAs[Attempt](tried)...)
		if err != nil {
			return nil, &LoadError{Library: "driver", Forced: driver.Forced(), Tried: l.tried}
		}
		l.drv, l.driverPath = f, lib.Path("cuInit")
	}
	if nvrtc := dynlib.SpecFrom(c.nvrtc, c.nvrtcSet, NVRTCEnv); !nvrtc.Off() {
		f, lib, tried, err := dynlib.First(nvrtc.Search("nvrtc", NVRTCCandidates()...), openNVRTC)
		l.tried = append(l.tried, dynlib.AttemptsAs[Attempt](tried)...)
		switch {
		case err == nil:
			l.rtc, l.rtcLib, l.nvrtcPath = f, lib, lib.Path("nvrtcVersion")
		case nvrtc.Forced():
			return nil, &LoadError{Library: "nvrtc", Forced: true, Tried: l.tried}
		default:
			// Not found by the search: the driver (streams, copies, NCCL,
			// prebuilt modules) still works; compiling fails naming NVRTC.
			l.rtcErr = &LoadError{Library: "nvrtc", Tried: slices.Clone(l.tried)}
		}
	}
	if l.drv != nil {
		if err := l.cuCheck("cuInit", l.drv.cuInit(0), "initialising the driver"); err != nil {
			_ = l.Close() // the cuInit error is the one to report
			return nil, err
		}
	}
	return l, nil
}

// Tried returns every library Load tried, in order, with the reason each
// failed candidate was rejected.
func (l *Lib) Tried() []Attempt { return slices.Clone(l.tried) }

// DriverPath returns the file of the loaded driver library (the soname when
// the file cannot be found), or "" when the driver is off.
func (l *Lib) DriverPath() string { return l.driverPath }

// NVRTCPath returns the file of the loaded NVRTC library (the soname when
// the file cannot be found), or "" when NVRTC is off.
func (l *Lib) NVRTCPath() string { return l.nvrtcPath }

// Close releases NVRTC (dlclose) and makes every later call on l fail. The
// driver library stays mapped, as the driver's own threads may outlive the
// last call; it is shared with NCCL and the CUDA runtime anyway. Close
// every [Context] first. Closing twice is a no-op.
func (l *Lib) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	if l.rtcLib != nil {
		if err := l.rtcLib.Close(); err != nil {
			return fmt.Errorf("cuda: closing NVRTC %s: %w", l.nvrtcPath, err)
		}
	}
	return nil
}

// driver returns the driver functions, or an error when the driver is off
// or l is closed. The caller holds l.mu.RLock.
func (l *Lib) driver(what string) (*driverFns, error) {
	switch {
	case l == nil:
		return nil, fmt.Errorf("cuda: %s: %w: nil Lib", what, ErrInvalid)
	case l.closed:
		return nil, fmt.Errorf("cuda: %s: %w: Lib is closed", what, ErrInvalid)
	case l.drv == nil:
		return nil, fmt.Errorf("cuda: %s: %w: the CUDA driver was not loaded (%s=off)", what, ErrUnsupported, DriverEnv)
	}
	return l.drv, nil
}

// nvrtc returns the NVRTC functions, or an error when NVRTC is off or l is
// closed. The caller holds l.mu.RLock.
func (l *Lib) nvrtc(what string) (*nvrtcFns, error) {
	switch {
	case l == nil:
		return nil, fmt.Errorf("cuda: %s: %w: nil Lib", what, ErrInvalid)
	case l.closed:
		return nil, fmt.Errorf("cuda: %s: %w: Lib is closed", what, ErrInvalid)
	case l.rtc == nil && l.rtcErr != nil:
		return nil, fmt.Errorf("cuda: %s: %w", what, l.rtcErr)
	case l.rtc == nil:
		return nil, fmt.Errorf("cuda: %s: %w: NVRTC was not loaded (%s=off)", what, ErrUnsupported, NVRTCEnv)
	}
	return l.rtc, nil
}

// cuCheck turns a CUresult into nil or an *Error naming call, with the
// driver's name and description of the code.
func (l *Lib) cuCheck(call string, res int32, context string) error {
	if res == 0 {
		return nil
	}
	e := &Error{Call: call, Code: int(res), Context: context}
	if l.drv != nil {
		var p *byte
		if l.drv.cuGetErrorName(res, &p) == 0 {
			e.Name = goString(p)
		}
		p = nil
		if l.drv.cuGetErrorString(res, &p) == 0 {
			e.Msg = goString(p)
		}
	}
	return e
}

// rtcCheck turns an nvrtcResult into nil or an *Error naming call.
func (l *Lib) rtcCheck(call string, res int32, context string) *Error {
	if res == 0 {
		return nil
	}
	e := &Error{Call: call, Code: int(res), Context: context, Name: nvrtcResultName(int(res))}
	if l.rtc != nil && l.rtc.nvrtcGetErrorString != nil {
		e.Msg = l.rtc.nvrtcGetErrorString(res)
	}
	return e
}

// nvrtcResultName returns the nvrtc.h name of an nvrtcResult.
func nvrtcResultName(r int) string {
	names := []string{
		"NVRTC_SUCCESS", "NVRTC_ERROR_OUT_OF_MEMORY", "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
		"NVRTC_ERROR_INVALID_INPUT", "NVRTC_ERROR_INVALID_PROGRAM", "NVRTC_ERROR_INVALID_OPTION",
		"NVRTC_ERROR_COMPILATION", "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
		"NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION", "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
		"NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID", "NVRTC_ERROR_INTERNAL_ERROR",
	}
	if r >= 0 && r < len(names) {
		return names[r]
	}
	return ""
}
