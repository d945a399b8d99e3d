package cuda

import (
	"fmt"
	"unsafe"

	"github.com/b7ea7098/loom/internal/dynlib"
)

// This file binds cuBLASLt's matmul, which loom uses for the GEMMs whose
// epilogue (a Linear layer's bias, or its bias gradient) can be fused into
// the product; plain GEMMs stay on cuBLAS (cublas.go). Values are from
// cublasLt.h (CUDA 11 and later).

// cublasLtMatmulDescAttributes_t values loom sets.
const (
	ltDescTransA      = 3 // int32 cublasOperation_t
	ltDescTransB      = 4 // int32
	ltDescEpilogue    = 7 // uint32 cublasLtEpilogue_t
	ltDescBiasPointer = 8 // void*
)

// cublasLtEpilogue_t values.
const (
	ltEpilogueBias   = 4
	ltEpilogueBGradA = 256
	ltEpilogueBGradB = 512
)

// ltPrefMaxWorkspaceBytes is CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES
// (uint64).
const ltPrefMaxWorkspaceBytes = 1

// ltMatmulAlgo mirrors cublasLtMatmulAlgo_t: 64 opaque bytes, 8-aligned.
type ltMatmulAlgo struct {
	_ [8]uint64
}

// ltHeuristicResult mirrors cublasLtMatmulHeuristicResult_t (96 bytes;
// a test checks the size, the fake checks sizeof in C).
type ltHeuristicResult struct {
	algo          ltMatmulAlgo
	workspaceSize uint64 // size_t
	state         int32  // cublasStatus_t
	wavesCount    float32
	reserved      [4]int32
}

// cublasLtFns are cuBLASLt's entry points; types as in cublasFns, with
// uint64_t as uint64 and int64_t as int64.
type cublasLtFns struct {
	cublasLtCreate                  func(h *uintptr) int32
	cublasLtDestroy                 func(h uintptr) int32
	cublasLtGetVersion              func() uintptr
	cublasLtGetStatusName           func(s int32) string // optional
	cublasLtGetStatusString         func(s int32) string // optional
	cublasLtMatmulDescCreate        func(d *uintptr, compute, scale int32) int32
	cublasLtMatmulDescDestroy       func(d uintptr) int32
	cublasLtMatmulDescSetAttribute  func(d uintptr, attr int32, buf unsafe.Pointer, n uintptr) int32
	cublasLtMatrixLayoutCreate      func(l *uintptr, typ int32, rows, cols uint64, ld int64) int32
	cublasLtMatrixLayoutDestroy     func(l uintptr) int32
	cublasLtMatmulPreferenceCreate  func(p *uintptr) int32
	cublasLtMatmulPreferenceDestroy func(p uintptr) int32
	cublasLtMatmulPreferenceSetAttr func(p uintptr, attr int32, buf unsafe.Pointer, n uintptr) int32
	cublasLtMatmulAlgoGetHeuristic  func(h, desc, a, b, c, d, pref uintptr, requested int32, res *ltHeuristicResult, n *int32) int32
	cublasLtMatmul                  func(h, desc uintptr, alpha unsafe.Pointer, a, adesc, b, bdesc uintptr, beta unsafe.Pointer, c, cdesc, d, ddesc uintptr, algo *ltMatmulAlgo, ws, wsBytes, stream uintptr) int32
}

// openCUBLASLt binds cuBLASLt's entry points from lib and rejects a
// version older than minBLASMajor.
func openCUBLASLt(lib *dynlib.Library) (*cublasLtFns, error) {
	f := &cublasLtFns{}
	if err := lib.Bind([]dynlib.Symbol{
		{Name: "cublasLtCreate", Fn: &f.cublasLtCreate},
		{Name: "cublasLtDestroy", Fn: &f.cublasLtDestroy},
		{Name: "cublasLtGetVersion", Fn: &f.cublasLtGetVersion},
		{Name: "cublasLtGetStatusName", Fn: &f.cublasLtGetStatusName, Optional: true},
		{Name: "cublasLtGetStatusString", Fn: &f.cublasLtGetStatusString, Optional: true},
		{Name: "cublasLtMatmulDescCreate", Fn: &f.cublasLtMatmulDescCreate},
		{Name: "cublasLtMatmulDescDestroy", Fn: &f.cublasLtMatmulDescDestroy},
		{Name: "cublasLtMatmulDescSetAttribute", Fn: &f.cublasLtMatmulDescSetAttribute},
		{Name: "cublasLtMatrixLayoutCreate", Fn: &f.cublasLtMatrixLayoutCreate},
		{Name: "cublasLtMatrixLayoutDestroy", Fn: &f.cublasLtMatrixLayoutDestroy},
		{Name: "cublasLtMatmulPreferenceCreate", Fn: &f.cublasLtMatmulPreferenceCreate},
		{Name: "cublasLtMatmulPreferenceDestroy", Fn: &f.cublasLtMatmulPreferenceDestroy},
		{Name: "cublasLtMatmulPreferenceSetAttribute", Fn: &f.cublasLtMatmulPreferenceSetAttr},
		{Name: "cublasLtMatmulAlgoGetHeuristic", Fn: &f.cublasLtMatmulAlgoGetHeuristic},
		{Name: "cublasLtMatmul", Fn: &f.cublasLtMatmul},
	}); err != nil {
		return nil, fmt.Errorf("not a usable cuBLASLt: %w", err)
	}
	if v := f.version(); v[0] < minBLASMajor {
		return nil, fmt.Errorf("cuBLASLt %d.%d.%d is older than %d.0", v[0], v[1], v[2], minBLASMajor)
	}
	return f, nil
}

// version decodes cublasLtGetVersion's major·10000 + minor·100 + patch.
func (f *cublasLtFns) version() [3]int {
	v := int(f.cublasLtGetVersion())
	return [3]int{v / 10000, v / 100 % 100, v % 100}
}

// ltCheck turns a cuBLASLt status into nil or a *BLASError naming call.
func (b *BLAS) ltCheck(call string, s int32, context string) error {
	if s == 0 {
		return nil
	}
	e := &BLASError{Call: call, Status: s, Name: blasStatusName(s), Context: context}
	if b.lt.cublasLtGetStatusName != nil {
		if n := b.lt.cublasLtGetStatusName(s); n != "" {
			e.Name = n
		}
	}
	if b.lt.cublasLtGetStatusString != nil {
		e.Msg = b.lt.cublasLtGetStatusString(s)
	}
	return e
}

// ltEpilogue maps a row-major epilogue to cuBLASLt's, after the swap: the
// bias of row-major C's columns is the bias of column-major D's rows, and
// the row-major op(A) (whose sums over k the gradient of A's rows takes)
// is cuBLASLt's B.
func ltEpilogue(e Epilogue) uint32 {
	switch e {
	case EpilogueBiasGradA:
		return ltEpilogueBGradB
	case EpilogueBiasGradB:
		return ltEpilogueBGradA
	}
	return ltEpilogueBias
}

// ltMatmul runs g with its epilogue on cuBLASLt. It returns a reason, and
// no error, when cuBLASLt cannot fuse the epilogue (it rejects the
// epilogue, or the heuristic returns no algorithm that fits the
// workspace); nothing was computed then.
func (h *BLASHandle) ltMatmul(g *Gemm, c *colMajor) (why string, err error) {
	b, lt := h.b, h.b.lt
	ctx := g.String()
	check := func(call string, s int32) error { return b.ltCheck(call, s, ctx) }
	scale := int32(cudaR32F)
	if c.comp == computeF64 {
		scale = cudaR64F
	}
	var desc uintptr
	if err := check("cublasLtMatmulDescCreate", lt.cublasLtMatmulDescCreate(&desc, c.comp, scale)); err != nil {
		return "", err
	}
	defer lt.cublasLtMatmulDescDestroy(desc)
	ta, tb, epi, bias := c.ta, c.tb, ltEpilogue(g.Epilogue), g.Bias
	for _, a := range []struct {
		attr int32
		p    unsafe.Pointer
		n    uintptr
	}{
		{ltDescTransA, unsafe.Pointer(&ta), 4},
		{ltDescTransB, unsafe.Pointer(&tb), 4},
		{ltDescEpilogue, unsafe.Pointer(&epi), 4},
		{ltDescBiasPointer, unsafe.Pointer(&bias), unsafe.Sizeof(bias)},
	} {
		s := lt.cublasLtMatmulDescSetAttribute(desc, a.attr, a.p, a.n)
		if a.attr == ltDescEpilogue && (s == cublasStatusNotSupported || s == 7) {
			// An older cuBLASLt that does not know this epilogue.
			return fmt.Sprintf("cuBLASLt rejects epilogue %v: %s", g.Epilogue, blasStatusName(s)), nil
		}
		if err := check("cublasLtMatmulDescSetAttribute", s); err != nil {
			return "", err
		}
	}
	layout := func(typ int32, rows, cols int32, ld int32) (uintptr, error) {
		var l uintptr
		err := check("cublasLtMatrixLayoutCreate", lt.cublasLtMatrixLayoutCreate(&l, typ, uint64(rows), uint64(cols), int64(ld)))
		return l, err
	}
	// Stored column-major shapes: A is m×k (k×m transposed), B k×n (n×k).
	ar, ac := c.m, c.k
	if c.ta == 1 {
		ar, ac = c.k, c.m
	}
	br, bc := c.k, c.n
	if c.tb == 1 {
		br, bc = c.n, c.k
	}
	al, err := layout(c.abType, ar, ac, c.lda)
	if err != nil {
		return "", err
	}
	defer lt.cublasLtMatrixLayoutDestroy(al)
	bl, err := layout(c.abType, br, bc, c.ldb)
	if err != nil {
		return "", err
	}
	defer lt.cublasLtMatrixLayoutDestroy(bl)
	cl, err := layout(c.cType, c.m, c.n, c.ldc)
	if err != nil {
		return "", err
	}
	defer lt.cublasLtMatrixLayoutDestroy(cl)
	var pref uintptr
	if err := check("cublasLtMatmulPreferenceCreate", lt.cublasLtMatmulPreferenceCreate(&pref)); err != nil {
		return "", err
	}
	defer lt.cublasLtMatmulPreferenceDestroy(pref)
	wsMax := uint64(h.wsBytes)
	if err := check("cublasLtMatmulPreferenceSetAttribute",
		lt.cublasLtMatmulPreferenceSetAttr(pref, ltPrefMaxWorkspaceBytes, unsafe.Pointer(&wsMax), 8)); err != nil {
		return "", err
	}
	var res ltHeuristicResult
	var n int32
	s := lt.cublasLtMatmulAlgoGetHeuristic(h.lt, desc, al, bl, cl, cl, pref, 1, &res, &n)
	if s == cublasStatusNotSupported {
		return "cuBLASLt heuristic: " + blasStatusName(s) + " for " + ctx, nil
	}
	if err := check("cublasLtMatmulAlgoGetHeuristic", s); err != nil {
		return "", err
	}
	if n == 0 || res.state != 0 || res.workspaceSize > wsMax {
		return "cuBLASLt heuristic found no algorithm for " + ctx, nil
	}
	s = lt.cublasLtMatmul(h.lt, desc, c.alpha, c.a, al, c.b, bl, c.beta, c.c, cl, c.c, cl, &res.algo, h.ws, uintptr(h.wsBytes), h.stream)
	return "", check("cublasLtMatmul", s)
}
