package kernels

import (
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"

	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/dynlib"
)

// EnvVar names the environment variable that forces the GEMM backend:
// "openblas", "blis", "go" (pure Go; "pure-go", "purego", "none" and "off"
// too), or a CBLAS shared library: a path, or a file name with ".so",
// ".dylib" or ".dll" in it ("libmkl_rt.so"). Names are case-insensitive.
// Empty, blank, unset or "auto" means automatic selection. Anything else
// is an error ([ErrInvalid]) rather than a library search for a misspelt
// name. [WithLibrary] takes precedence.
const EnvVar = "LOOM_BLAS"

// Backend identifies the implementation behind a [BLAS].
type Backend int

const (
	// BackendGo is the pure-Go GEMM.
	BackendGo Backend = iota
	// BackendOpenBLAS is OpenBLAS loaded at run time.
	BackendOpenBLAS
	// BackendBLIS is BLIS loaded at run time.
	BackendBLIS
	// BackendCBLAS is another library exporting the CBLAS interface.
	BackendCBLAS
)

// String returns the backend's short name: "pure-go", "openblas", "blis" or "cblas".
func (k Backend) String() string {
	switch k {
	case BackendGo:
		return "pure-go"
	case BackendOpenBLAS:
		return "openblas"
	case BackendBLIS:
		return "blis"
	case BackendCBLAS:
		return "cblas"
	}
	return fmt.Sprintf("Backend(%d)", int(k))
}

// Option configures [Load].
type Option func(*config)

type config struct {
	lib     string
	libSet  bool
	threads int
	ranks   int // ranks of this process calling GEMM at once; 0: not said
}

// WithLibrary forces the backend, overriding the [EnvVar] environment
// variable. spec is "openblas", "blis", "go", a path to a shared library, or
// "" for automatic selection.
func WithLibrary(spec string) Option {
	return func(c *config) { c.lib, c.libSet = spec, true }
}

// WithThreads sets the number of threads GEMM may use. For OpenBLAS and BLIS
// this changes the library's process-wide setting; for the pure-Go GEMM it
// bounds the goroutines of each call. n <= 0 keeps the defaults.
func WithThreads(n int) Option {
	return func(c *config) { c.threads = n }
}

// WithRanksInProcess tells [Load] that n ranks of this process (goroutines
// such as comm/local's, each running its own training step) will call GEMM
// at the same time. In automatic selection with n > 1, Load then picks
// loom's GEMM over a C library when loom's has vector micro-kernels on this
// CPU: every call into C through purego hands the calling goroutine's
// scheduler slot (P) to another thread for its duration, so with one rank
// per core the ranks' Go work waits for slots while cores sit idle, and
// data parallelism scales worse than on a GEMM that stays in Go (see the
// package documentation). A forced choice ([WithLibrary], [EnvVar]) is
// kept whatever n is. n <= 1, the default, is one rank per process, which
// keeps the library.
func WithRanksInProcess(n int) Option {
	return func(c *config) { c.ranks = n }
}

// BLAS computes GEMM on the backend chosen by [Load]. A *BLAS is safe for
// concurrent use. Its methods never panic on bad arguments; they return an
// error instead.
type BLAS struct {
	backend Backend
	path    string
	conf    string
	tried   []string
	reason  string
	lib     *cblasLib // nil for BackendGo
	gog     *goGEMM
}

// Load selects and loads a GEMM backend as described in the package
// documentation. Each call opens the library anew (dlopen reference-counts
// it, so this is cheap); use [Default] to share one instance.
//
// In automatic mode Load does not fail: without a usable library it returns
// the pure-Go backend. When a library is forced (by [WithLibrary] or
// [EnvVar]) and cannot be loaded, Load returns an error.
func Load(opts ...Option) (*BLAS, error) {
	var cfg config
	for _, o := range opts {
		o(&cfg)
	}
	spec := strings.TrimSpace(string(dynlib.SpecFrom(cfg.lib, cfg.libSet, EnvVar)))
	source := fmt.Sprintf("%s=%q", EnvVar, spec)
	if cfg.libSet {
		source = fmt.Sprintf("WithLibrary(%q)", cfg.lib)
	}
	choice, err := parseLibrary(spec)
	if err != nil {
		return nil, fmt.Errorf("kernels: Load: %s: %w", source, err)
	}
	threads := cfg.threads
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	b := &BLAS{backend: BackendGo, gog: newGoGEMM(threads)}
	forced := choice.pureGo || choice.cands != nil
	if forced {
		b.reason = "forced by " + source
	}
	if !forced {
		var useGo bool
		useGo, b.reason = autoPolicy(cfg.ranks, blocking32().vec)
		if useGo {
			return b, nil
		}
	}
	if choice.pureGo {
		return b, nil
	}
	cands := choice.cands
	if !forced {
		cands = autoCandidates()
	}
	lib, _, tried, err := dynlib.First(dynlib.Search{Library: "cblas", Names: cands, Forced: forced}, openCBLAS)
	for _, a := range tried {
		if a.Err != nil {
			b.tried = append(b.tried, fmt.Sprintf("%s: %v", a.Name, a.Err))
		}
	}
	if err != nil {
		if forced {
			return nil, fmt.Errorf("kernels: Load: %s: no CBLAS library could be loaded: %s", source, strings.Join(b.tried, "; "))
		}
		b.reason = "no CBLAS library could be loaded"
		return b, nil
	}
	if !forced && lib.backend == BackendOpenBLAS {
		if core, narrow := narrowCore(lib.config()); narrow && blocking32().vec {
			b.reason = fmt.Sprintf("OpenBLAS runs its %s kernels, without the AVX2 and FMA this CPU has, so loom's GEMM is faster; %s=openblas to force", core, EnvVar)
			return b, nil
		}
	}
	b.lib = lib
	b.backend = lib.backend
	b.path = lib.path
	b.conf = lib.config()
	if cfg.threads > 0 {
		lib.setThreads(cfg.threads)
	}
	return b, nil
}

// autoPolicy is automatic selection's first decision, for ranks ranks of
// this process calling GEMM at once (0 or 1: one) on a CPU where loom's
// GEMM has vector micro-kernels (vec) or not: whether to use loom's GEMM
// without looking for a library, and the reason, for [BLAS.Reason]. With
// one rank a library's faster kernels win; with several, purego's calls
// leave cores idle (see [WithRanksInProcess]), which costs more than the
// kernel difference when loom's kernels are vectorised, but not against
// its portable loops.
func autoPolicy(ranks int, vec bool) (useGo bool, reason string) {
	switch {
	case ranks <= 1:
		return false, "one rank in this process: the first CBLAS library that loads"
	case vec:
		return true, fmt.Sprintf("%d in-process ranks scale better without cgo; %s=openblas to force", ranks, EnvVar)
	default:
		return false, fmt.Sprintf("%d in-process ranks, but loom's GEMM has no vector kernels on this CPU: a CBLAS library when one loads; %s=go to force", ranks, EnvVar)
	}
}

// narrowCore reports the core OpenBLAS's build string config names
// ("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott
// MAX_THREADS=64") when it is an x86 target whose kernels use neither AVX2
// nor FMA. OpenBLAS falls back to one of them, typically Prescott, on a
// CPU it does not recognise: a 2-core Intel Xeon with AVX-512 ran the tiny
// GPT at 8,257 tokens/s on OpenBLAS 0.3.21's Prescott kernels against
// 16,182 on loom's AVX2 GEMM. A string naming no such core is not narrow.
func narrowCore(config string) (core string, narrow bool) {
	for _, f := range strings.Fields(config) {
		switch strings.ToLower(f) {
		case "katmai", "coppermine", "northwood", "prescott", "banias", "atom",
			"core2", "penryn", "dunnington", "nehalem", "sandybridge",
			"opteron", "opteron_sse3", "barcelona", "bobcat", "bulldozer", "piledriver", "steamroller":
			return f, true
		}
	}
	return "", false
}

// libraryChoice is what a LOOM_BLAS value or WithLibrary spec asks for.
type libraryChoice struct {
	pureGo bool     // the pure-Go GEMM, no library
	cands  []string // the only sonames or path to try; nil: automatic
}

// parseLibrary parses the syntax of EnvVar (surrounding blanks already
// removed).
func parseLibrary(spec string) (libraryChoice, error) {
	switch strings.ToLower(spec) {
	case "", "auto":
		return libraryChoice{}, nil
	case "go", "pure-go", "purego", "none", dynlib.Off:
		return libraryChoice{pureGo: true}, nil
	case "openblas":
		return libraryChoice{cands: openblasCandidates()}, nil
	case "blis":
		return libraryChoice{cands: blisCandidates()}, nil
	}
	if looksLikeLibrary(spec) {
		return libraryChoice{cands: []string{spec}}, nil
	}
	return libraryChoice{}, fmt.Errorf("%w: unknown GEMM backend %q (want auto, go, openblas, blis, or a CBLAS shared library: a path or a name such as libmkl_rt.so)", ErrInvalid, spec)
}

// looksLikeLibrary reports whether spec names a shared library file: it
// has a path separator, or a dot-separated part of its name after the
// first is "so" (libx.so, libx.so.3), "dylib" or "dll".
func looksLikeLibrary(spec string) bool {
	if strings.ContainsAny(spec, "/\\") {
		return true
	}
	parts := strings.Split(strings.ToLower(spec), ".")
	if parts[0] == "" {
		return false
	}
	for _, p := range parts[1:] {
		switch p {
		case "so", "dylib", "dll":
			return true
		}
	}
	return false
}

// Default returns a process-wide [BLAS] loaded by Load() with no options on
// first use; later calls return the same value and error. The memoisation
// is the only package-level state and is immutable after the first call.
func Default() (*BLAS, error) { return loadDefault() }

var loadDefault = sync.OnceValues(func() (*BLAS, error) { return Load() })

// Backend reports which implementation this BLAS runs on.
func (b *BLAS) Backend() Backend {
	if b == nil {
		return BackendGo
	}
	return b.backend
}

// Name describes the backend for logs: the backend name followed by the file
// the library was loaded from, e.g. "openblas (/usr/lib/.../libopenblas.so.0)",
// or "pure-go".
func (b *BLAS) Name() string {
	if b == nil || b.backend == BackendGo {
		return "pure-go"
	}
	return fmt.Sprintf("%s (%s)", b.backend, b.path)
}

// Path is the file the library was loaded from (resolved through symlinks
// where the platform allows), or "" for the pure-Go backend.
func (b *BLAS) Path() string {
	if b == nil {
		return ""
	}
	return b.path
}

// Config is the library's own version or build string (openblas_get_config,
// bli_info_get_version_str), or "" when it has none. For the pure-Go backend
// it describes the kernel.
func (b *BLAS) Config() string {
	if b == nil || b.backend == BackendGo {
		b32, b64 := blocking32(), blocking64()
		kind := "portable"
		if b32.vec {
			kind = "AVX2+FMA"
		}
		return fmt.Sprintf("pure-go (loom's GEMM), %s micro-kernels %dx%d (float32) and %dx%d (float64), %d goroutines", kind, b32.mr, b32.nr, b64.mr, b64.nr, b.goThreads())
	}
	return b.conf
}

// Threads reports the thread count GEMM uses: the library's current
// setting where it can be queried, else the pure-Go goroutine bound.
func (b *BLAS) Threads() int {
	if b != nil && b.lib != nil {
		if n := b.lib.threads(); n > 0 {
			return n
		}
	}
	return b.goThreads()
}

func (b *BLAS) goThreads() int {
	if b == nil || b.gog == nil {
		return 1
	}
	return b.gog.threads
}

// Reason says why [Load] chose this backend, for logs: the option or
// environment variable that forced it, or the automatic policy's reason
// (one rank per process, in-process ranks, no library found), e.g.
// "2 in-process ranks scale better without cgo; LOOM_BLAS=openblas to force".
func (b *BLAS) Reason() string {
	if b == nil {
		return ""
	}
	return b.reason
}

// Tried lists the candidate libraries that were rejected before the chosen
// backend, each as "name: reason", in the order they were tried.
func (b *BLAS) Tried() []string {
	if b == nil {
		return nil
	}
	return append([]string(nil), b.tried...)
}

// Sgemm computes C = alpha*op(A)*op(B) + beta*C in float32, where op(X) is X
// or its transpose, op(A) is m×k, op(B) is k×n and C is m×n, all row-major
// with leading dimensions (row strides) lda, ldb and ldc: the contract of
// cblas_sgemm(CblasRowMajor, ...). When beta is 0, C is overwritten and its
// previous contents (even NaN) are ignored. Bad dimensions, leading
// dimensions or too-short slices return an error and leave C untouched.
func (b *BLAS) Sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, bm []float32, ldb int, beta float32, c []float32, ldc int) error {
	if b == nil {
		return fmt.Errorf("kernels: Sgemm: %w: nil *BLAS", ErrInvalid)
	}
	if err := checkGemm(transA, transB, m, n, k, len(a), lda, len(bm), ldb, len(c), ldc); err != nil {
		return fmt.Errorf("kernels: Sgemm: %w", err)
	}
	if m == 0 || n == 0 {
		return nil
	}
	if b.lib != nil && fitsInt32(m, n, k, lda, ldb, ldc) {
		b.lib.sgemm(transA, transB, m, n, k, alpha, a, lda, bm, ldb, beta, c, ldc)
		return nil
	}
	gemmGo(b.gog, &b.gog.pool32, b.gog.blk32, transA, transB, m, n, k, alpha, a, lda, bm, ldb, beta, c, ldc)
	return nil
}

// Dgemm is [BLAS.Sgemm] in float64 (cblas_dgemm).
func (b *BLAS) Dgemm(transA, transB bool, m, n, k int, alpha float64, a []float64, lda int, bm []float64, ldb int, beta float64, c []float64, ldc int) error {
	if b == nil {
		return fmt.Errorf("kernels: Dgemm: %w: nil *BLAS", ErrInvalid)
	}
	if err := checkGemm(transA, transB, m, n, k, len(a), lda, len(bm), ldb, len(c), ldc); err != nil {
		return fmt.Errorf("kernels: Dgemm: %w", err)
	}
	if m == 0 || n == 0 {
		return nil
	}
	if b.lib != nil && fitsInt32(m, n, k, lda, ldb, ldc) {
		b.lib.dgemm(transA, transB, m, n, k, alpha, a, lda, bm, ldb, beta, c, ldc)
		return nil
	}
	gemmGo(b.gog, &b.gog.pool64, b.gog.blk64, transA, transB, m, n, k, alpha, a, lda, bm, ldb, beta, c, ldc)
	return nil
}

// fitsInt32 reports whether all arguments fit CBLAS's 32-bit int (LP64
// builds such as Debian's libopenblas0 and libblis4). Larger problems run on
// the pure-Go GEMM instead of being truncated.
func fitsInt32(v ...int) bool {
	for _, x := range v {
		if x > math.MaxInt32 {
			return false
		}
	}
	return true
}

// checkGemm validates row-major GEMM arguments like cblas_?gemm does, plus the
// slice lengths that C cannot check.
func checkGemm(transA, transB bool, m, n, k, la, lda, lb, ldb, lc, ldc int) error {
	if m < 0 || n < 0 || k < 0 {
		return fmt.Errorf("%w: negative dimension m=%d n=%d k=%d", ErrInvalid, m, n, k)
	}
	aRows, aCols := m, k
	if transA {
		aRows, aCols = k, m
	}
	bRows, bCols := k, n
	if transB {
		bRows, bCols = n, k
	}
	if lda < max(1, aCols) {
		return fmt.Errorf("%w: lda=%d < max(1, %d)", ErrInvalid, lda, aCols)
	}
	if ldb < max(1, bCols) {
		return fmt.Errorf("%w: ldb=%d < max(1, %d)", ErrInvalid, ldb, bCols)
	}
	if ldc < max(1, n) {
		return fmt.Errorf("%w: ldc=%d < max(1, %d)", ErrInvalid, ldc, n)
	}
	if need, ok := needLen(aRows, aCols, lda); !ok || la < need {
		return fmt.Errorf("%w: len(a)=%d < %d needed for %dx%d with lda=%d", ErrInvalid, la, need, aRows, aCols, lda)
	}
	if need, ok := needLen(bRows, bCols, ldb); !ok || lb < need {
		return fmt.Errorf("%w: len(b)=%d < %d needed for %dx%d with ldb=%d", ErrInvalid, lb, need, bRows, bCols, ldb)
	}
	if need, ok := needLen(m, n, ldc); !ok || lc < need {
		return fmt.Errorf("%w: len(c)=%d < %d needed for %dx%d with ldc=%d", ErrInvalid, lc, need, m, n, ldc)
	}
	return nil
}

// needLen is (rows-1)*ld + cols, the shortest slice holding a rows×cols
// matrix with row stride ld, or 0 for an empty matrix; ok is false on overflow.
func needLen(rows, cols, ld int) (int, bool) {
	if rows == 0 || cols == 0 {
		return 0, true
	}
	n, ok := checked.Mul(rows-1, ld)
	if !ok {
		return math.MaxInt, false
	}
	if n, ok = checked.Add(n, cols); !ok {
		return math.MaxInt, false
	}
	return n, true
}
