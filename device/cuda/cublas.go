package cuda

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/dynlib"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// This file binds cuBLAS (cublasGemmEx, cublasGemmStridedBatchedEx) at run
// time and maps loom's row-major GEMMs onto its column-major ones;
// cublaslt.go adds cuBLASLt's matmul with bias epilogues.
//
// Row-major mapping. A row-major matrix X[r,c] with leading dimension ld is
// the column-major matrix Xᵀ (c×r, same ld) in the same memory. So the
// row-major C[m,n] = op(A)·op(B) is the column-major Cᵀ = op(B)ᵀ·op(A)ᵀ,
// which cuBLAS computes as cublasGemmEx(opB, opA, n, m, k, B, ldb, A, lda,
// C, ldc): the operands and the sizes m, n swap, the transposes and
// leading dimensions stay with their operands.

// CUBLASEnv names the environment variable that forces the cuBLAS library:
// a soname or path (then the only candidate, and an error when it cannot
// be used), or "off" to load none. [WithCUBLAS] takes precedence.
const CUBLASEnv = "LOOM_CUBLAS"

// CUBLASLtEnv names the environment variable that forces the cuBLASLt
// library: a soname or path (then the only candidate, and an error when it
// cannot be used), or "off" to use plain cuBLAS only, with bias epilogues
// left to the caller. [WithCUBLASLt] takes precedence.
const CUBLASLtEnv = "LOOM_CUBLASLT"

// minBLASMajor is the oldest cuBLAS (and cuBLASLt) major version loom
// uses: 11 is the first whose GEMMs take a cublasComputeType_t.
const minBLASMajor = 11

// blasInvalid marks GEMM and handle arguments rejected before any library
// call; it matches loom.ErrInvalid.
var blasInvalid = loom.NewSentinel("invalid argument", loom.ErrInvalid)

// BLASOption configures [LoadBLAS].
type BLASOption func(*blasConfig)

type blasConfig struct {
	cublas, lt       string
	cublasSet, ltSet bool
	tf32             bool
}

// WithCUBLAS forces the cuBLAS library, overriding [CUBLASEnv]: a soname
// or path, "off" to load none, or "" for the automatic search.
func WithCUBLAS(spec string) BLASOption {
	return func(c *blasConfig) { c.cublas, c.cublasSet = spec, true }
}

// WithCUBLASLt forces the cuBLASLt library, overriding [CUBLASLtEnv]: a
// soname or path, "off" to use plain cuBLAS only, or "" for the automatic
// search.
func WithCUBLASLt(spec string) BLASOption {
	return func(c *blasConfig) { c.lt, c.ltSet = spec, true }
}

// WithTF32 allows GEMMs of [PrecisionTF32], whose float32 inputs are
// rounded to TF32 (10 mantissa bits) on tensor cores, like PyTorch's
// torch.backends.cuda.matmul.allow_tf32. Off by default: float32 GEMMs
// keep float32 products unless the program opts in.
func WithTF32(allow bool) BLASOption {
	return func(c *blasConfig) { c.tf32 = allow }
}

// CUBLASCandidates returns the cuBLAS sonames [LoadBLAS] tries when none
// is forced, newest major first.
func CUBLASCandidates() []string {
	return []string{"libcublas.so.13", "libcublas.so.12", "libcublas.so.11", "libcublas.so"}
}

// CUBLASLtCandidates returns the cuBLASLt sonames [LoadBLAS] tries when
// none is forced: the one of the same major version as the cuBLAS loaded,
// which was built with it, then the unversioned name.
func CUBLASLtCandidates(cublasMajor int) []string {
	return []string{fmt.Sprintf("libcublasLt.so.%d", cublasMajor), "libcublasLt.so"}
}

// BLASLoadError is returned by [LoadBLAS] when cuBLAS cannot be loaded, or
// a forced cuBLASLt cannot.
type BLASLoadError struct {
	// Library is "cuBLAS" or "cuBLASLt".
	Library string
	// Env is the environment variable that points to another copy.
	Env string
	// Forced is true when an option or Env chose the library.
	Forced bool
	// Disabled is true when the library was turned off ("off").
	Disabled bool
	// Tried lists the candidates in order, each with the reason it was
	// rejected (missing file, missing symbols, too old a version).
	Tried []dynlib.Attempt
}

// Error names the library, the candidates tried and the variable to set.
func (e *BLASLoadError) Error() string {
	if e.Disabled {
		return fmt.Sprintf("cuda: %s is off (%s=off)", e.Library, e.Env)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "cuda: no %s library could be loaded", e.Library)
	if e.Forced {
		b.WriteString(" (forced)")
	}
	b.WriteString(" (tried")
	for i, a := range e.Tried {
		if i > 0 {
			b.WriteString(";")
		}
		fmt.Fprintf(&b, " %s: %v", a.Name, a.Err)
	}
	if len(e.Tried) == 0 {
		b.WriteString(" nothing")
	}
	fmt.Fprintf(&b, "); set %s to the path of another copy", e.Env)
	return b.String()
}

// Is reports a disabled library as unsupported, so that errors.Is(err,
// loom.ErrUnsupported) tells "turned off" from "not found".
func (e *BLASLoadError) Is(target error) bool {
	return e.Disabled && target == loom.ErrUnsupported
}

// BLASError is a failed cuBLAS or cuBLASLt call.
type BLASError struct {
	// Call is the C function that failed, e.g. "cublasGemmEx".
	Call string
	// Status is its cublasStatus_t.
	Status int32
	// Name is the status's symbolic name, e.g.
	// "CUBLAS_STATUS_EXECUTION_FAILED".
	Name string
	// Msg is the library's description of Status, when it has one.
	Msg string
	// Context says what loom was doing, e.g. "GEMM 3x17x33 float32".
	Context string
}

// Error formats the call, the status, its name and description.
func (e *BLASError) Error() string {
	var b strings.Builder
	b.WriteString("cuda: ")
	if e.Context != "" {
		b.WriteString(e.Context + ": ")
	}
	fmt.Fprintf(&b, "%s failed with %d", e.Call, e.Status)
	if e.Name != "" {
		b.WriteString(" " + e.Name)
	}
	if e.Msg != "" {
		b.WriteString(" (" + e.Msg + ")")
	}
	return b.String()
}

// blasStatusName returns cublas_api.h's name of a cublasStatus_t.
func blasStatusName(s int32) string {
	switch s {
	case 0:
		return "CUBLAS_STATUS_SUCCESS"
	case 1:
		return "CUBLAS_STATUS_NOT_INITIALIZED"
	case 3:
		return "CUBLAS_STATUS_ALLOC_FAILED"
	case 7:
		return "CUBLAS_STATUS_INVALID_VALUE"
	case 8:
		return "CUBLAS_STATUS_ARCH_MISMATCH"
	case 11:
		return "CUBLAS_STATUS_MAPPING_ERROR"
	case 13:
		return "CUBLAS_STATUS_EXECUTION_FAILED"
	case 14:
		return "CUBLAS_STATUS_INTERNAL_ERROR"
	case 15:
		return "CUBLAS_STATUS_NOT_SUPPORTED"
	case 16:
		return "CUBLAS_STATUS_LICENSE_ERROR"
	}
	return ""
}

// cublasStatusNotSupported is CUBLAS_STATUS_NOT_SUPPORTED, which cuBLASLt
// returns for a combination (epilogue, types) it has no kernel for.
const cublasStatusNotSupported = 15

// cublasFns are cuBLAS's entry points. C int is int32, long long int64,
// enums int32, size_t uintptr; handles, streams and device pointers are
// uintptr; alpha and beta are host pointers (the default pointer mode).
type cublasFns struct {
	cublasCreate_v2       func(h *uintptr) int32
	cublasDestroy_v2      func(h uintptr) int32
	cublasSetStream_v2    func(h, stream uintptr) int32
	cublasSetWorkspace_v2 func(h, ws, bytes uintptr) int32 // cuBLAS 11.3+; optional
	cublasGetProperty     func(prop int32, v *int32) int32
	cublasGetStatusName   func(s int32) string // optional
	cublasGetStatusString func(s int32) string // optional
	cublasGemmEx          func(h uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, a uintptr, at, lda int32,
		b uintptr, bt, ldb int32, beta unsafe.Pointer, c uintptr, ct, ldc, compute, algo int32) int32
	cublasGemmStridedBatchedEx func(h uintptr, ta, tb, m, n, k int32, alpha unsafe.Pointer, a uintptr, at, lda int32, sa int64,
		b uintptr, bt, ldb int32, sb int64, beta unsafe.Pointer, c uintptr, ct, ldc int32, sc int64,
		batch, compute, algo int32) int32
}

// openCUBLAS binds cuBLAS's entry points from lib and rejects a version
// older than minBLASMajor.
func openCUBLAS(lib *dynlib.Library) (*cublasFns, error) {
	f := &cublasFns{}
	if err := lib.Bind([]dynlib.Symbol{
		{Name: "cublasCreate_v2", Fn: &f.cublasCreate_v2},
		{Name: "cublasDestroy_v2", Fn: &f.cublasDestroy_v2},
		{Name: "cublasSetStream_v2", Fn: &f.cublasSetStream_v2},
		{Name: "cublasSetWorkspace_v2", Fn: &f.cublasSetWorkspace_v2, Optional: true},
		{Name: "cublasGetProperty", Fn: &f.cublasGetProperty},
		{Name: "cublasGetStatusName", Fn: &f.cublasGetStatusName, Optional: true},
		{Name: "cublasGetStatusString", Fn: &f.cublasGetStatusString, Optional: true},
		{Name: "cublasGemmEx", Fn: &f.cublasGemmEx},
		{Name: "cublasGemmStridedBatchedEx", Fn: &f.cublasGemmStridedBatchedEx},
	}); err != nil {
		return nil, fmt.Errorf("not a usable cuBLAS: %w", err)
	}
	v, err := f.version()
	if err != nil {
		return nil, err
	}
	if v[0] < minBLASMajor {
		return nil, fmt.Errorf("cuBLAS %d.%d.%d is older than %d.0", v[0], v[1], v[2], minBLASMajor)
	}
	return f, nil
}

// version probes cublasGetProperty for MAJOR_VERSION (0), MINOR_VERSION
// (1) and PATCH_LEVEL (2).
func (f *cublasFns) version() ([3]int, error) {
	var v [3]int
	for i := range v {
		var x int32
		if s := f.cublasGetProperty(int32(i), &x); s != 0 {
			return v, fmt.Errorf("cublasGetProperty(%d) failed with %d %s", i, s, blasStatusName(s))
		}
		v[i] = int(x)
	}
	return v, nil
}

// BLAS is an opened cuBLAS, and cuBLASLt when it could be loaded. It is
// safe for concurrent use. The libraries stay loaded for the life of the
// process (cuBLAS starts threads of its own), so BLAS has no Close.
type BLAS struct {
	fns       *cublasFns
	path      string
	version   [3]int
	lt        *cublasLtFns // nil: GEMMs with epilogues are not fused
	ltPath    string
	ltVersion [3]int
	ltWhy     string // why cuBLASLt is not used, when lt is nil
	tried     []dynlib.Attempt
	tf32      bool
}

// LoadBLAS loads cuBLAS as opts and [CUBLASEnv] configure, then cuBLASLt
// as [CUBLASLtEnv] configures. cuBLAS must load: a missing, too old or
// turned-off cuBLAS is a [*BLASLoadError] naming the library and the
// variable. cuBLASLt is optional unless forced: when the automatic search
// finds none (or one older than 11.0), or it is "off", GEMMs with
// epilogues run on plain cuBLAS and leave the epilogue to the caller
// ([BLASHandle.Gemm] says so); a forced cuBLASLt that cannot be used is a
// [*BLASLoadError].
func LoadBLAS(opts ...BLASOption) (*BLAS, error) {
	var c blasConfig
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	spec := dynlib.SpecFrom(c.cublas, c.cublasSet, CUBLASEnv)
	fns, lib, tried, err := dynlib.First(spec.Search("cuBLAS", CUBLASCandidates()...), openCUBLAS)
	if err != nil {
		return nil, &BLASLoadError{Library: "cuBLAS", Env: CUBLASEnv, Forced: spec.Forced(), Disabled: spec.Off(), Tried: tried}
	}
	b := &BLAS{fns: fns, path: lib.Path("cublasCreate_v2"), tried: tried, tf32: c.tf32}
	if b.version, err = fns.version(); err != nil {
		return nil, fmt.Errorf("cuda: cuBLAS %s: %w", b.path, err)
	}
	ltSpec := dynlib.SpecFrom(c.lt, c.ltSet, CUBLASLtEnv)
	if ltSpec.Off() {
		b.ltWhy = "cuBLASLt is off (" + CUBLASLtEnv + "=off)"
		return b, nil
	}
	lt, ltLib, ltTried, err := dynlib.First(ltSpec.Search("cuBLASLt", CUBLASLtCandidates(b.version[0])...), openCUBLASLt)
	b.tried = append(b.tried, ltTried...)
	if err != nil {
		if ltSpec.Forced() {
			return nil, &BLASLoadError{Library: "cuBLASLt", Env: CUBLASLtEnv, Forced: true, Tried: ltTried}
		}
		var why []string
		for _, a := range ltTried {
			why = append(why, a.Name+": "+a.Err.Error())
		}
		b.ltWhy = "no cuBLASLt (" + strings.Join(why, "; ") + ")"
		return b, nil
	}
	b.lt, b.ltPath, b.ltVersion = lt, ltLib.Path("cublasLtCreate"), lt.version()
	return b, nil
}

// Version returns the loaded cuBLAS's version.
func (b *BLAS) Version() (major, minor, patch int) {
	return b.version[0], b.version[1], b.version[2]
}

// Path returns the file of the loaded cuBLAS (its soname when the file
// cannot be found).
func (b *BLAS) Path() string { return b.path }

// LtPath returns the file of the loaded cuBLASLt, or "" when none is used.
func (b *BLAS) LtPath() string { return b.ltPath }

// LtVersion returns the loaded cuBLASLt's version; ok is false when none
// is used.
func (b *BLAS) LtVersion() (major, minor, patch int, ok bool) {
	return b.ltVersion[0], b.ltVersion[1], b.ltVersion[2], b.lt != nil
}

// TF32 reports whether GEMMs of [PrecisionTF32] are allowed ([WithTF32]).
func (b *BLAS) TF32() bool { return b.tf32 }

// Tried returns every library LoadBLAS tried, in order, with the reason
// each rejected candidate was rejected.
func (b *BLAS) Tried() []dynlib.Attempt { return append([]dynlib.Attempt(nil), b.tried...) }

// Describe says which GEMM path the libraries give, for a program's
// "GEMM:" line, e.g. "cuBLAS 12.4.5 + cuBLASLt 12.4.5 (bias epilogues
// fused), TF32 off". [BLASHandle.Path] adds what the calls did.
func (b *BLAS) Describe() string {
	s := fmt.Sprintf("cuBLAS %d.%d.%d", b.version[0], b.version[1], b.version[2])
	if b.lt != nil {
		s += fmt.Sprintf(" + cuBLASLt %d.%d.%d (bias epilogues fused)", b.ltVersion[0], b.ltVersion[1], b.ltVersion[2])
	} else {
		s += " (" + b.ltWhy + "; bias epilogues by separate kernels)"
	}
	if b.tf32 {
		return s + ", TF32 allowed"
	}
	return s + ", TF32 off"
}

// blasCheck turns a cublasStatus_t into nil or a *BLASError naming call.
func (b *BLAS) blasCheck(call string, s int32, context string) error {
	if s == 0 {
		return nil
	}
	e := &BLASError{Call: call, Status: s, Name: blasStatusName(s), Context: context}
	if b.fns.cublasGetStatusName != nil {
		if n := b.fns.cublasGetStatusName(s); n != "" {
			e.Name = n
		}
	}
	if b.fns.cublasGetStatusString != nil {
		e.Msg = b.fns.cublasGetStatusString(s)
	}
	return e
}

// Precision says the data types of a GEMM's operands and how it computes.
// The zero value is PrecisionF32.
type Precision int32

const (
	// PrecisionF32: A, B and C float32, products and sums in float32
	// (CUBLAS_COMPUTE_32F).
	PrecisionF32 Precision = iota
	// PrecisionTF32: A, B and C float32, inputs rounded to TF32 on tensor
	// cores (CUBLAS_COMPUTE_32F_FAST_TF32). Only on a BLAS loaded
	// [WithTF32](true).
	PrecisionTF32
	// PrecisionBF16: A and B bfloat16, C float32, computed in float32.
	PrecisionBF16
	// PrecisionBF16Out: A, B and C bfloat16, computed in float32.
	PrecisionBF16Out
	// PrecisionF64: A, B and C float64, computed in float64.
	PrecisionF64
)

// String names the precision: "float32", "tf32", "bf16", "bf16-out",
// "float64".
func (p Precision) String() string {
	switch p {
	case PrecisionF32:
		return "float32"
	case PrecisionTF32:
		return "tf32"
	case PrecisionBF16:
		return "bf16"
	case PrecisionBF16Out:
		return "bf16-out"
	case PrecisionF64:
		return "float64"
	}
	return fmt.Sprintf("Precision(%d)", int32(p))
}

// cudaDataType and cublasComputeType_t values (library_types.h,
// cublas_api.h).
const (
	cudaR32F  = 0
	cudaR64F  = 1
	cudaR16BF = 14

	computeF32     = 68
	computeF32TF32 = 77
	computeF64     = 70

	cublasGemmDefault = -1
)

// types returns the cudaDataType of A and B, that of C, and the compute
// type.
func (p Precision) types() (ab, c, compute int32) {
	switch p {
	case PrecisionTF32:
		return cudaR32F, cudaR32F, computeF32TF32
	case PrecisionBF16:
		return cudaR16BF, cudaR32F, computeF32
	case PrecisionBF16Out:
		return cudaR16BF, cudaR16BF, computeF32
	case PrecisionF64:
		return cudaR64F, cudaR64F, computeF64
	}
	return cudaR32F, cudaR32F, computeF32
}

// Epilogue is work fused into a GEMM after the product (cuBLASLt).
type Epilogue int32

const (
	// EpilogueNone: C = alpha·op(A)·op(B) + beta·C.
	EpilogueNone Epilogue = iota
	// EpilogueBias adds Bias (N elements of C's type) to every row of C,
	// after alpha and beta: a Linear layer's forward pass.
	EpilogueBias
	// EpilogueBiasGradA also writes to Bias (M elements of C's type) the
	// sums of op(A)'s rows over k, unscaled: the bias gradient in a
	// Linear layer's dW GEMM when op(A) is the output gradient
	// transposed (dW = gᵀ·x).
	EpilogueBiasGradA
	// EpilogueBiasGradB also writes to Bias (N elements of C's type) the
	// sums of op(B)'s columns over k, unscaled: the bias gradient when
	// op(B) is the output gradient (dWᵀ = xᵀ·g).
	EpilogueBiasGradB
)

// String names the epilogue: "none", "bias", "bias-grad-a", "bias-grad-b".
func (e Epilogue) String() string {
	switch e {
	case EpilogueNone:
		return "none"
	case EpilogueBias:
		return "bias"
	case EpilogueBiasGradA:
		return "bias-grad-a"
	case EpilogueBiasGradB:
		return "bias-grad-b"
	}
	return fmt.Sprintf("Epilogue(%d)", int32(e))
}

// Gemm describes one row-major GEMM, or a strided batch of them:
//
//	C[m,n] = alpha·op(A)[m,k]·op(B)[k,n] + beta·C[m,n]
//
// where op(X) is X, or Xᵀ when TransX is set. Matrices are row-major as
// stored: A is stored [M,K] (or [K,M] with TransA) with LDA elements
// between rows, B [K,N] (or [N,K] with TransB) with LDB, C [M,N] with LDC.
// A leading dimension of 0 means the stored rows are packed. A, B, C and
// Bias are device addresses. With beta 0, C is not read.
type Gemm struct {
	// TransA and TransB transpose the stored A and B.
	TransA, TransB bool
	// M, N, K are the sizes; each at least 0 and at most 2³¹-1. M or N
	// of 0 is a no-op.
	M, N, K int
	// LDA, LDB, LDC are the leading dimensions in elements: at least the
	// stored row length (0 = exactly that).
	LDA, LDB, LDC int
	// A, B, C are the device addresses of the operands.
	A, B, C uintptr
	// Alpha and Beta scale the product and C; finite. They are rounded
	// to float32 except for PrecisionF64.
	Alpha, Beta float64
	// Batch is the number of GEMMs (0 or 1: one); more than one runs a
	// strided batch, matrix i at A + i·StrideA elements and so on.
	Batch int
	// StrideA, StrideB, StrideC are the element distances between the
	// matrices of a batch; 0 for A or B reuses one matrix. C's matrices
	// must not overlap.
	StrideA, StrideB, StrideC int64
	// Precision gives the data types and the compute type.
	Precision Precision
	// Epilogue is work fused after the product; not with Batch > 1.
	Epilogue Epilogue
	// Bias is the device address of the bias (EpilogueBias) or of the
	// bias gradient written (EpilogueBiasGradA/B), of C's element type.
	Bias uintptr
}

// String describes g for errors, e.g. "GEMM 3x17x33 (TA) float32 batch 4".
func (g *Gemm) String() string {
	s := fmt.Sprintf("GEMM %dx%dx%d", g.M, g.N, g.K)
	if g.TransA || g.TransB {
		s += " ("
		if g.TransA {
			s += "TA"
		}
		if g.TransB {
			s += "TB"
		}
		s += ")"
	}
	s += " " + g.Precision.String()
	if g.Batch > 1 {
		s += fmt.Sprintf(" batch %d", g.Batch)
	}
	if g.Epilogue != EpilogueNone {
		s += " epilogue " + g.Epilogue.String()
	}
	return s
}

// colMajor is a Gemm after the row-major swap: the arguments cuBLAS gets.
type colMajor struct {
	ta, tb              int32 // CUBLAS_OP_N 0, CUBLAS_OP_T 1
	m, n, k             int32
	a, b, c             uintptr // cuBLAS's A is loom's B, its B loom's A
	lda, ldb, ldc       int32
	sa, sb, sc          int64
	batch               int32
	abType, cType, comp int32
	alpha, beta         unsafe.Pointer // *float32, or *float64 for F64
}

// check validates g and returns its column-major form. tf32 says whether
// PrecisionTF32 is allowed.
func (g *Gemm) check(tf32 bool) (colMajor, error) {
	var cm colMajor
	bad := func(format string, a ...any) (colMajor, error) {
		return cm, fmt.Errorf("cuda: %v: %w: %s", g, blasInvalid, fmt.Sprintf(format, a...))
	}
	for _, d := range []struct {
		name string
		v    int
	}{{"M", g.M}, {"N", g.N}, {"K", g.K}, {"LDA", g.LDA}, {"LDB", g.LDB}, {"LDC", g.LDC}, {"Batch", g.Batch}} {
		if err := numcheck.NonNegativeCount(blasInvalid, d.name, d.v); err != nil {
			return cm, fmt.Errorf("cuda: %v: %w", g, err)
		}
		if d.v > math.MaxInt32 {
			return bad("%s %d does not fit a C int", d.name, d.v)
		}
	}
	for _, s := range []struct {
		name string
		v    float64
	}{{"Alpha", g.Alpha}, {"Beta", g.Beta}} {
		if err := numcheck.Finite(blasInvalid, s.name, s.v); err != nil {
			return cm, fmt.Errorf("cuda: %v: %w", g, err)
		}
	}
	if g.Precision < PrecisionF32 || g.Precision > PrecisionF64 {
		return bad("unknown precision")
	}
	if g.Precision == PrecisionTF32 && !tf32 {
		return bad("TF32 is not allowed; load the BLAS WithTF32(true)")
	}
	if g.Epilogue < EpilogueNone || g.Epilogue > EpilogueBiasGradB {
		return bad("unknown epilogue")
	}
	// Stored row lengths: what a leading dimension must cover.
	rowA, rowB := g.K, g.N
	if g.TransA {
		rowA = g.M
	}
	if g.TransB {
		rowB = g.K
	}
	lda, ldb, ldc := ldOr(g.LDA, rowA), ldOr(g.LDB, rowB), ldOr(g.LDC, g.N)
	for _, l := range []struct {
		name    string
		ld, row int
	}{{"LDA", lda, rowA}, {"LDB", ldb, rowB}, {"LDC", ldc, g.N}} {
		if l.ld < l.row {
			return bad("%s %d is less than the stored row length %d", l.name, l.ld, l.row)
		}
		if l.ld > math.MaxInt32 {
			return bad("%s %d does not fit a C int", l.name, l.ld)
		}
	}
	batch := max(g.Batch, 1)
	if batch > 1 {
		if g.Epilogue != EpilogueNone {
			return bad("an epilogue needs Batch 1")
		}
		if g.StrideA < 0 || g.StrideB < 0 {
			return bad("negative stride")
		}
		if need := int64(g.M-1)*int64(ldc) + int64(g.N); g.M > 0 && g.N > 0 && g.StrideC < need {
			return bad("StrideC %d is less than C's extent %d: the batch's outputs would overlap", g.StrideC, need)
		}
	}
	if g.M > 0 && g.N > 0 {
		if g.C == 0 || (g.K > 0 && (g.A == 0 || g.B == 0)) {
			return bad("nil device pointer")
		}
		if g.Epilogue != EpilogueNone && g.Bias == 0 {
			return bad("epilogue %v without a Bias pointer", g.Epilogue)
		}
	}
	ab, c, comp := g.Precision.types()
	cm = colMajor{
		ta: opOf(g.TransB), tb: opOf(g.TransA),
		m: int32(g.N), n: int32(g.M), k: int32(g.K),
		a: g.B, b: g.A, c: g.C,
		lda: int32(ldb), ldb: int32(lda), ldc: int32(ldc),
		sa: g.StrideB, sb: g.StrideA, sc: g.StrideC,
		batch:  int32(batch),
		abType: ab, cType: c, comp: comp,
	}
	if g.Precision == PrecisionF64 {
		alpha, beta := g.Alpha, g.Beta
		cm.alpha, cm.beta = unsafe.Pointer(&alpha), unsafe.Pointer(&beta)
	} else {
		alpha, beta := float32(g.Alpha), float32(g.Beta)
		cm.alpha, cm.beta = unsafe.Pointer(&alpha), unsafe.Pointer(&beta)
	}
	return cm, nil
}

// ldOr returns ld, or row when ld is 0 (packed rows).
func ldOr(ld, row int) int {
	if ld == 0 {
		return max(row, 1)
	}
	return ld
}

// opOf returns CUBLAS_OP_T for a transposed operand, CUBLAS_OP_N otherwise.
func opOf(trans bool) int32 {
	if trans {
		return 1
	}
	return 0
}

// BLASHandle is a cuBLAS handle (and a cuBLASLt one when cuBLASLt is loaded)
// bound to one stream and one workspace. Its methods may be called
// concurrently; they are serialised, as one cuBLAS handle runs one call
// at a time. Close it when done.
type BLASHandle struct {
	b       *BLAS
	stream  uintptr
	ws      uintptr
	wsBytes int64

	mu       sync.Mutex
	h, lt    uintptr // 0 once closed; lt 0 without cuBLASLt
	closed   bool
	stats    GemmStats
	lastWhy  string // why the last unfused epilogue was not fused
	closeErr error
}

// GemmStats counts the GEMMs a [BLASHandle] ran, by path.
type GemmStats struct {
	// Plain counts GEMMs without an epilogue (cublasGemmEx and
	// cublasGemmStridedBatchedEx).
	Plain int64
	// Fused counts GEMMs whose epilogue cuBLASLt applied.
	Fused int64
	// Unfused counts GEMMs with an epilogue that ran on plain cuBLAS,
	// leaving the epilogue to the caller.
	Unfused int64
}

// NewHandle creates a cuBLAS handle whose work goes on stream (a
// CUstream; 0 is the legacy default stream) and that uses the device
// memory at workspace, wsBytes long, as its workspace, so that cuBLAS
// allocates none behind loom's allocator (cublasSetWorkspace_v2 where the
// library has it; cuBLASLt gets it on every call). A workspace of 0 bytes
// lets cuBLAS use its own. The calling thread's current CUDA context must
// be the device's, as cuBLAS binds a handle to the current device.
// Errors: one matching loom.ErrInvalid for a negative size or a
// size without an address, [*BLASError] for a failed call.
func (b *BLAS) NewHandle(stream, workspace uintptr, wsBytes int64) (*BLASHandle, error) {
	if b == nil {
		return nil, fmt.Errorf("cuda: NewHandle: %w: nil BLAS", blasInvalid)
	}
	if wsBytes < 0 || (wsBytes > 0 && workspace == 0) {
		return nil, fmt.Errorf("cuda: NewHandle: %w: workspace %#x of %d bytes", blasInvalid, workspace, wsBytes)
	}
	h := &BLASHandle{b: b, stream: stream, ws: workspace, wsBytes: wsBytes}
	if err := b.blasCheck("cublasCreate_v2", b.fns.cublasCreate_v2(&h.h), "creating a handle"); err != nil {
		return nil, err
	}
	fail := func(err error) (*BLASHandle, error) {
		_ = h.Close() // err is the one to report
		return nil, err
	}
	if err := b.blasCheck("cublasSetStream_v2", b.fns.cublasSetStream_v2(h.h, stream), "setting the handle's stream"); err != nil {
		return fail(err)
	}
	if wsBytes > 0 && b.fns.cublasSetWorkspace_v2 != nil {
		s := b.fns.cublasSetWorkspace_v2(h.h, workspace, uintptr(wsBytes))
		if err := b.blasCheck("cublasSetWorkspace_v2", s, fmt.Sprintf("setting a workspace of %d bytes", wsBytes)); err != nil {
			return fail(err)
		}
	}
	if b.lt != nil {
		if err := b.ltCheck("cublasLtCreate", b.lt.cublasLtCreate(&h.lt), "creating a cuBLASLt handle"); err != nil {
			return fail(err)
		}
	}
	return h, nil
}

// Close destroys the handle's cuBLAS and cuBLASLt handles. Closing twice
// returns the first Close's result.
func (h *BLASHandle) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return h.closeErr
	}
	h.closed = true
	var errs []error
	if h.lt != 0 {
		errs = append(errs, h.b.ltCheck("cublasLtDestroy", h.b.lt.cublasLtDestroy(h.lt), "destroying a cuBLASLt handle"))
		h.lt = 0
	}
	if h.h != 0 {
		errs = append(errs, h.b.blasCheck("cublasDestroy_v2", h.b.fns.cublasDestroy_v2(h.h), "destroying a handle"))
		h.h = 0
	}
	h.closeErr = errors.Join(errs...)
	return h.closeErr
}

// Stats returns how many GEMMs the handle ran by each path.
func (h *BLASHandle) Stats() GemmStats {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.stats
}

// Path says which GEMM path the handle's calls took, for a program's
// "GEMM:" line: [BLAS.Describe], and, when epilogue GEMMs ran unfused,
// how many and why (no cuBLASLt, or its heuristic found no algorithm).
func (h *BLASHandle) Path() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.b.Describe()
	if st := h.stats; st.Unfused > 0 && h.b.lt != nil {
		s += fmt.Sprintf("; %d of %d epilogue GEMMs unfused (%s)", st.Unfused, st.Fused+st.Unfused, h.lastWhy)
	}
	return s
}

// Gemm runs g on the handle's stream (asynchronously: the result is there
// once the stream reaches this point). Without an epilogue it calls
// cublasGemmEx, or cublasGemmStridedBatchedEx for Batch > 1. With one it
// calls cuBLASLt's matmul with the epilogue fused and returns fused true;
// when cuBLASLt is not loaded, or its heuristic has no algorithm for g, it
// computes the product alone on plain cuBLAS and returns fused false, and
// the caller adds the bias or computes the bias gradient itself. Errors:
// an error matching loom.ErrInvalid for a malformed g or TF32 not
// allowed, before any call; [*BLASError] for a failed call.
func (h *BLASHandle) Gemm(g Gemm) (fused bool, err error) {
	cm, err := g.check(h.b.tf32)
	if err != nil {
		return false, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false, fmt.Errorf("cuda: %v: %w: handle is closed", &g, blasInvalid)
	}
	if g.M == 0 || g.N == 0 {
		return false, nil
	}
	if g.Epilogue != EpilogueNone {
		if h.lt != 0 {
			why, err := h.ltMatmul(&g, &cm)
			if err != nil {
				return false, err
			}
			if why == "" {
				h.stats.Fused++
				return true, nil
			}
			h.lastWhy = why
		}
		h.stats.Unfused++
	} else {
		h.stats.Plain++
	}
	return false, h.plain(&g, &cm)
}

// plain runs the product on cublasGemmEx or cublasGemmStridedBatchedEx.
func (h *BLASHandle) plain(g *Gemm, c *colMajor) error {
	f := h.b.fns
	if c.batch > 1 {
		s := f.cublasGemmStridedBatchedEx(h.h, c.ta, c.tb, c.m, c.n, c.k, c.alpha, c.a, c.abType, c.lda, c.sa,
			c.b, c.abType, c.ldb, c.sb, c.beta, c.c, c.cType, c.ldc, c.sc, c.batch, c.comp, cublasGemmDefault)
		return h.b.blasCheck("cublasGemmStridedBatchedEx", s, g.String())
	}
	s := f.cublasGemmEx(h.h, c.ta, c.tb, c.m, c.n, c.k, c.alpha, c.a, c.abType, c.lda,
		c.b, c.abType, c.ldb, c.beta, c.c, c.cType, c.ldc, c.comp, cublasGemmDefault)
	return h.b.blasCheck("cublasGemmEx", s, g.String())
}
