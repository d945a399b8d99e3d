//go:build linux && (amd64 || arm64)

package kernels

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"unsafe"

	"github.com/ebitengine/purego"
)

// CBLAS enum values (cblas.h).
const (
	cblasRowMajor = 101
	cblasNoTrans  = 111
	cblasTrans    = 112
)

func openblasCandidates() []string { return []string{"libopenblas.so.0", "libopenblas.so"} }
func blisCandidates() []string     { return []string{"libblis.so.4", "libblis.so"} }
func autoCandidates() []string {
	return append(append(openblasCandidates(), blisCandidates()...), "libcblas.so.3", "libblas.so.3")
}

// cblasLib is one dlopen'd CBLAS library. Its fields are set once by
// openCBLAS and never change.
type cblasLib struct {
	backend Backend
	path    string
	handle  uintptr

	sgemmFn func(order, ta, tb, m, n, k int32, alpha float32, a unsafe.Pointer, lda int32, b unsafe.Pointer, ldb int32, beta float32, c unsafe.Pointer, ldc int32)
	dgemmFn func(order, ta, tb, m, n, k int32, alpha float64, a unsafe.Pointer, lda int32, b unsafe.Pointer, ldb int32, beta float64, c unsafe.Pointer, ldc int32)

	configFn     func() string // openblas_get_config or bli_info_get_version_str
	setThreadsFn func(int32)   // openblas_set_num_threads
	setThreads64 func(int64)   // bli_thread_set_num_threads (dim_t)
	getThreadsFn func() int32  // openblas_get_num_threads
	getThreads64 func() int64  // bli_thread_get_num_threads
}

// openCBLAS dlopens name and binds the CBLAS GEMM entry points. The library
// is never closed: BLAS libraries start worker threads that must outlive
// every call.
func openCBLAS(name string) (*cblasLib, error) {
	h, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, err
	}
	sg, err1 := purego.Dlsym(h, "cblas_sgemm")
	dg, err2 := purego.Dlsym(h, "cblas_dgemm")
	if err := errors.Join(err1, err2); err != nil {
		_ = purego.Dlclose(h)
		return nil, fmt.Errorf("not a CBLAS library: %v", err)
	}
	l := &cblasLib{backend: BackendCBLAS, handle: h, path: name}
	purego.RegisterFunc(&l.sgemmFn, sg)
	purego.RegisterFunc(&l.dgemmFn, dg)
	if p := mappedFile(sg); p != "" {
		l.path = p
	}
	if sym, err := purego.Dlsym(h, "openblas_get_config"); err == nil {
		l.backend = BackendOpenBLAS
		purego.RegisterFunc(&l.configFn, sym)
		if s, err := purego.Dlsym(h, "openblas_set_num_threads"); err == nil {
			purego.RegisterFunc(&l.setThreadsFn, s)
		}
		if s, err := purego.Dlsym(h, "openblas_get_num_threads"); err == nil {
			purego.RegisterFunc(&l.getThreadsFn, s)
		}
	} else if sym, err := purego.Dlsym(h, "bli_info_get_version_str"); err == nil {
		l.backend = BackendBLIS
		purego.RegisterFunc(&l.configFn, sym)
		if s, err := purego.Dlsym(h, "bli_thread_set_num_threads"); err == nil {
			purego.RegisterFunc(&l.setThreads64, s)
		}
		if s, err := purego.Dlsym(h, "bli_thread_get_num_threads"); err == nil {
			purego.RegisterFunc(&l.getThreads64, s)
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

// mappedFile finds the file mapped at address addr in /proc/self/maps, so
// that Name can report the real library behind a soname or symlink. It
// returns "" when that is not possible.
func mappedFile(addr uintptr) string {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode path
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
		p := strings.Join(fields[5:], " ")
		if filepath.IsAbs(p) {
			return p
		}
		return ""
	}
	return ""
}
