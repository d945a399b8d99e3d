package kernels

import (
	"fmt"
	"runtime"
	"strings"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// CBLAS enum values (cblas.h).
const (
	cblasRowMajor = 101
	cblasNoTrans  = 111
	cblasTrans    = 112
)

func openblasCandidates() []string { return []string{"libopenblas.so.0", "libopenblas.so"} }
func blisCandidates() []string     { return []string{"libblis.so.4", "libblis.so"} }

// autoCandidates are the libraries the automatic selection tries: none
// where no library can be loaded, so that it then settles on the pure-Go
// GEMM with nothing to report.
func autoCandidates() []string {
	if !dynlib.Supported {
		return nil
	}
	return append(append(openblasCandidates(), blisCandidates()...), "libcblas.so.3", "libblas.so.3")
}

// cblasLib is one dlopen'd CBLAS library. Its fields are set once by
// openCBLAS and never change.
type cblasLib struct {
	backend Backend
	path    string

	sgemmFn func(order, ta, tb, m, n, k int32, alpha float32, a unsafe.Pointer, lda int32, b unsafe.Pointer, ldb int32, beta float32, c unsafe.Pointer, ldc int32)
	dgemmFn func(order, ta, tb, m, n, k int32, alpha float64, a unsafe.Pointer, lda int32, b unsafe.Pointer, ldb int32, beta float64, c unsafe.Pointer, ldc int32)

	configFn     func() string // openblas_get_config or bli_info_get_version_str
	setThreadsFn func(int32)   // openblas_set_num_threads
	setThreads64 func(int64)   // bli_thread_set_num_threads (dim_t)
	getThreadsFn func() int32  // openblas_get_num_threads
	getThreads64 func() int64  // bli_thread_get_num_threads
}

// openCBLAS binds the CBLAS GEMM entry points of lib, and those of OpenBLAS
// or BLIS when lib is one of them. The library is never closed: BLAS
// libraries start worker threads that must outlive every call.
func openCBLAS(lib *dynlib.Library) (*cblasLib, error) {
	l := &cblasLib{backend: BackendCBLAS}
	if err := lib.Bind([]dynlib.Symbol{
		{Name: "cblas_sgemm", Fn: &l.sgemmFn},
		{Name: "cblas_dgemm", Fn: &l.dgemmFn},
	}); err != nil {
		return nil, fmt.Errorf("not a CBLAS library: %w", err)
	}
	l.path = lib.Path("cblas_sgemm")
	// OpenBLAS and BLIS are told apart by their version functions, and
	// their thread settings are bound only for them.
	for _, fam := range []struct {
		backend Backend
		config  string
		threads []dynlib.Symbol
	}{
		{BackendOpenBLAS, "openblas_get_config", []dynlib.Symbol{
			{Name: "openblas_set_num_threads", Fn: &l.setThreadsFn, Optional: true},
			{Name: "openblas_get_num_threads", Fn: &l.getThreadsFn, Optional: true},
		}},
		{BackendBLIS, "bli_info_get_version_str", []dynlib.Symbol{
			{Name: "bli_thread_set_num_threads", Fn: &l.setThreads64, Optional: true},
			{Name: "bli_thread_get_num_threads", Fn: &l.getThreads64, Optional: true},
		}},
	} {
		if err := lib.Bind([]dynlib.Symbol{{Name: fam.config, Fn: &l.configFn, Optional: true}}); err != nil {
			return nil, err
		}
		if l.configFn != nil {
			l.backend = fam.backend
			if err := lib.Bind(fam.threads); err != nil {
				return nil, err
			}
			break
		}
	}
	return l, nil
}

func (l *cblasLib) config() string {
	if l.configFn == nil {
		return ""
	}
	s := strings.TrimSpace(l.configFn())
	if l.backend == BackendBLIS && s != "" {
		s = "BLIS " + s
	}
	return s
}

func (l *cblasLib) setThreads(n int) {
	switch {
	case l.setThreadsFn != nil:
		l.setThreadsFn(int32(min(n, 1<<20)))
	case l.setThreads64 != nil:
		l.setThreads64(int64(n))
	}
}

// threads returns the library's thread setting, or 0 when unknown. BLIS
// reports -1 when it has not been set explicitly; that is returned as 0.
func (l *cblasLib) threads() int {
	switch {
	case l.getThreadsFn != nil:
		return max(0, int(l.getThreadsFn()))
	case l.getThreads64 != nil:
		return max(0, int(l.getThreads64()))
	}
	return 0
}

func trans(t bool) int32 {
	if t {
		return cblasTrans
	}
	return cblasNoTrans
}

// ptr returns the address of s's first element, or nil for an empty slice.
func ptr[T any](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(s))
}

// sgemm calls cblas_sgemm; the arguments have been validated and fit int32.
func (l *cblasLib) sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	l.sgemmFn(cblasRowMajor, trans(transA), trans(transB), int32(m), int32(n), int32(k),
		alpha, ptr(a), int32(lda), ptr(b), int32(ldb), beta, ptr(c), int32(ldc))
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
	runtime.KeepAlive(c)
}

// dgemm calls cblas_dgemm; the arguments have been validated and fit int32.
func (l *cblasLib) dgemm(transA, transB bool, m, n, k int, alpha float64, a []float64, lda int, b []float64, ldb int, beta float64, c []float64, ldc int) {
	l.dgemmFn(cblasRowMajor, trans(transA), trans(transB), int32(m), int32(n), int32(k),
		alpha, ptr(a), int32(lda), ptr(b), int32(ldb), beta, ptr(c), int32(ldc))
	runtime.KeepAlive(a)
	runtime.KeepAlive(b)
	runtime.KeepAlive(c)
}
