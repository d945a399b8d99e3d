// Package kernels holds loom's local compute kernels.
//
// # GEMM
//
// [BLAS] multiplies dense row-major matrices (C = alpha*op(A)*op(B) + beta*C,
// the contract of cblas_sgemm/cblas_dgemm with CblasRowMajor). It runs on a
// CBLAS library loaded at run time when one can be found, and on a pure-Go,
// cache-blocked, register-tiled GEMM otherwise. Building this package needs no
// C library, no C headers and no cgo link flags.
//
// Libraries are opened with dlopen through github.com/ebitengine/purego. That
// dependency is deliberate: purego calls C functions without cgo (with
// CGO_ENABLED=0 it brings its own minimal runtime hooks, with cgo it uses
// runtime/cgo), it is maintained, and it handles the System V calling
// convention for float and stack arguments that cblas_sgemm's 14 parameters
// need. Writing that trampoline by hand would duplicate it badly.
//
// Which library is used is chosen by [Load]:
//
//   - With no preference, these sonames are tried in order and the first one
//     that exports cblas_sgemm and cblas_dgemm wins: libopenblas.so.0,
//     libopenblas.so, libblis.so.4, libblis.so, libcblas.so.3, libblas.so.3.
//     If none loads, the pure-Go GEMM is used; [BLAS.Tried] says why each
//     candidate was rejected.
//   - The environment variable LOOM_BLAS (see [EnvVar]), or [WithLibrary],
//     forces a choice: "openblas" or "blis" (that family's sonames only), "go"
//     (the pure-Go GEMM), or a path to a shared library. A forced library that
//     does not load is an error, not a silent fallback.
//
// [BLAS.Name] reports the choice, e.g.
// "openblas (/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so)"
// or "pure-go", and [BLAS.Config] the library's own build string where it has
// one (openblas_get_config, bli_info_get_version_str).
//
// Threads: OpenBLAS and BLIS keep their thread count in process-wide library
// state. [WithThreads] sets it (openblas_set_num_threads,
// bli_thread_set_num_threads) and also bounds the pure-Go GEMM's goroutines;
// without it the library keeps its own default (usually all cores, or
// OPENBLAS_NUM_THREADS / BLIS_NUM_THREADS) and the pure-Go GEMM uses
// GOMAXPROCS. Calling GEMM from many goroutines at once while the library
// itself is multi-threaded oversubscribes the cores; set WithThreads(1) when
// the caller parallelises.
//
// Dynamic loading is implemented on linux/amd64 and linux/arm64; on other
// platforms [Load] always returns the pure-Go GEMM (or an error when a library
// was forced).
package kernels
