// Package kernels holds loom's local compute kernels.
//
// # GEMM
//
// [BLAS] multiplies dense row-major matrices (C = alpha*op(A)*op(B) + beta*C,
// the contract of cblas_sgemm/cblas_dgemm with CblasRowMajor). It runs on a
// CBLAS library loaded at run time when one can be found, and on a pure-Go,
// cache-blocked, register-tiled GEMM otherwise (Goto/BLIS blocking; on
// AVX2+FMA CPUs, 6×16 float32 and 6×8 float64 assembly micro-kernels: the
// float32 one reaches 55-75% of one core's peak on the tiny GPT's shapes
// against OpenBLAS's 80-100%, BenchmarkSgemm). Building this package needs
// no C library, no C headers and no cgo link flags.
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
//   - Except when the caller says, with [WithRanksInProcess], that several
//     ranks of this process will call GEMM at once (comm/local's
//     goroutines): then, on CPUs where the pure-Go GEMM has its vector
//     micro-kernels, it is used without looking for a library. Every call
//     into C hands the calling goroutine's scheduler slot (P) to another
//     thread, and with one rank per core that leaves cores idle while the
//     ranks' Go work waits: on the 2-core development machine, dp=2 ran at
//     1.86× one rank on the pure-Go GEMM against 1.42× on OpenBLAS. A
//     process that is one rank of a multi-process job (mpirun, loomrun)
//     has no such contention and keeps the library.
//   - Except, too, when the library is an OpenBLAS that runs kernels
//     without AVX2 and FMA (its build string names a core such as
//     Prescott, which OpenBLAS falls back to on a CPU it does not
//     recognise) on a CPU where the pure-Go GEMM has its AVX2 kernels:
//     then the pure-Go GEMM, about twice as fast there, is used (with
//     OPENBLAS_CORETYPE=Prescott on an AVX-512 EPYC, the tiny GPT ran at
//     11,280 tokens/s on OpenBLAS and 23,280 on loom's GEMM).
//   - The environment variable LOOM_BLAS (see [EnvVar]), or [WithLibrary],
//     forces a choice: "openblas" or "blis" (that family's sonames only), "go"
//     or "off" (the pure-Go GEMM), or a shared library (a path, or a name
//     such as libmkl_rt.so). A forced library that does not load is an
//     error, not a silent fallback, and so is any other value ([ErrInvalid]):
//     a misspelt name is not searched for as a library.
//
// [BLAS.Reason] says which of these rules chose, [BLAS.Name] reports the
// choice, e.g.
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
//
// On a 2-core machine, OpenBLAS with two threads measured faster for the
// tiny GPT's step than with one, although its idle worker spins (in
// sched_yield) between calls: the Go side of a step is mostly serial, so
// the spinning core is otherwise idle. Where the caller runs its own
// goroutines on every core, set WithThreads(1) (or OPENBLAS_NUM_THREADS=1).
//
// # Row kernels
//
// The non-GEMM work of a transformer step runs as fused float32 loops over
// the rows of row-major blocks: [SoftmaxRows], [LogSoftmaxRows],
// [CausalSoftmax] and their backward, [LayerNorm] (one pass for the mean
// and variance, which it saves for [LayerNormBackward]), [BiasGELU] (the
// erf form, saving GELU' for [BiasGELUBackward]), [CrossEntropyRows] (with
// the logsumexp per row that [CrossEntropyRowsBackward] takes),
// [ColumnSums] (bias gradients), [Add] and [Mul]. Reductions accumulate in
// float64 and transcendentals are evaluated in float64, so each result is
// rounded to float32 once, as a float64 computation rounded at the end
// would be, up to summation order. Large calls of the kernels that
// evaluate exp or erfc (and attention) split their rows over up to as many
// goroutines as the [Workers] bound they are given, each row computed
// exactly as serially, so the results do not depend on it; the
// memory-bound ones stay on the calling goroutine, where two measured no
// faster. A rank running beside others passes its share of the cores,
// as it sizes its BLAS with [WithThreads].
//
// [CausalAttentionForward] and [CausalAttentionBackward] compute causal
// scaled-dot-product attention on many small per-head blocks (T×T×Dh,
// e.g. 64×64×32) with a register-tiled 4×16 micro-kernel instead of one
// BLAS call per product, which packing and thread start-up dominate at
// these sizes; tiles above the diagonal and the masked part of every
// k-loop are skipped.
//
// On amd64 CPUs with AVX2 and FMA the inner loops are assembly
// (vec_amd64.s): exp and erfc in four float64 lanes (exp by range
// reduction and a degree-10 Taylor polynomial, relative error below 2e-12;
// erfc as exp(−z²)·t·P(u) with a degree-10 fit of relative error below
// 3.5e-10), the layer-norm, softmax and elementwise loops in float64 or
// float32 lanes, and the 4×16 GEMM tile in float32. Elsewhere the same
// functions run portable loops on math.Exp and math.Erfc; both agree with
// a float64 reference to within float32 rounding.
//
// # Elementwise, layout and float64 kernels
//
// The rest of an op's arithmetic is here too, so that every op of package
// autograd is one kernel call a device can replace: [Add], [Mul],
// [Scale], [Fill] and [FillRows]; [SumDims] and its adjoint
// [BroadcastDims]; [PermuteDims]; [NarrowDim], its adjoint [PadDim] and
// [ConcatDim]; [EmbeddingForward] and [EmbeddingBackward]. They are
// generic over float32 and float64 and move or combine values exactly as
// a plain loop does (float32 elementwise products and sums on the AVX2
// lanes, which round the same). [GELU64], [Softmax64] (over any dim),
// [CausalSoftmax64], [CrossEntropy64] and [LayerNorm64], with their
// backwards, are the float64-computed forms of the row kernels, for
// float64 tensors and layouts the float32 kernels do not take.
//
// # Block attention
//
// [BlockAttentionForward], [MergeAttention], [AttentionRowDots] and
// [BlockAttentionBackward] are attention of one Q block against one K/V
// block under the causal mask by global position, merged by log-sum-exp,
// and its backward from the merged output's LSE: what context parallelism
// (parallel/cp) builds exact attention from when the sequence is split
// over ranks. They are generic over float32 and float64, and run their
// products as GEMMs on tiles of Q rows against the keys those rows may
// see (a BLAS's, or loom's on the calling goroutine), so they cost about
// what the fused [CausalAttentionForward] and [CausalAttentionBackward]
// do per (query, key) pair (BenchmarkBlockAttention).
//
// # Peak throughput
//
// [EstimatePeak] estimates the CPU's peak single-precision FLOP/s from the
// detected ISA, the core count and the clock in /proc/cpuinfo, assuming two
// FMA units per core for AVX2 (see [Peak]); BenchmarkSgemm reports each
// GEMM shape of a training step in GFLOP/s and as a percentage of it.
package kernels

import "github.com/b7ea7098/loom"

// ErrInvalid marks arguments a kernel rejected before touching any data:
// lengths or sizes that do not agree, negative sizes, indices out of
// range, a nil receiver. errors.Is(err, loom.ErrInvalid) matches it too.
var ErrInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)
