package cuda

import (
	"errors"
	"math"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom"
)

// TestLtHeuristicResultSize guards the Go mirror of cuBLASLt's structs:
// cublasLtMatmulAlgoGetHeuristic writes 96 bytes per result, and a
// smaller Go struct would let it write past the end.
func TestLtHeuristicResultSize(t *testing.T) {
	if n := unsafe.Sizeof(ltMatmulAlgo{}); n != 64 {
		t.Errorf("ltMatmulAlgo is %d bytes, cublasLtMatmulAlgo_t 64", n)
	}
	if n := unsafe.Sizeof(ltHeuristicResult{}); n != 96 {
		t.Errorf("ltHeuristicResult is %d bytes, cublasLtMatmulHeuristicResult_t 96", n)
	}
	var r ltHeuristicResult
	for _, f := range []struct {
		name      string
		off, want uintptr
	}{
		{"workspaceSize", unsafe.Offsetof(r.workspaceSize), 64},
		{"state", unsafe.Offsetof(r.state), 72},
		{"wavesCount", unsafe.Offsetof(r.wavesCount), 76},
		{"reserved", unsafe.Offsetof(r.reserved), 80},
	} {
		if f.off != f.want {
			t.Errorf("%s at offset %d, C has it at %d", f.name, f.off, f.want)
		}
	}
}

// TestGemmCheckRejects: malformed GEMMs are refused before any call, with
// an error matching loom.ErrInvalid that says what is wrong.
func TestGemmCheckRejects(t *testing.T) {
	ok := Gemm{M: 3, N: 4, K: 5, A: 0x1000, B: 0x2000, C: 0x3000, Alpha: 1}
	for _, tc := range []struct {
		name string
		edit func(g *Gemm)
		tf32 bool
		want string
	}{
		{"negative M", func(g *Gemm) { g.M = -1 }, false, "M -1"},
		{"negative K", func(g *Gemm) { g.K = -2 }, false, "K -2"},
		{"M past int32", func(g *Gemm) { g.M = math.MaxInt32 + 1 }, false, "does not fit a C int"},
		{"LDA short", func(g *Gemm) { g.LDA = 4 }, false, "LDA 4 is less than the stored row length 5"},
		{"LDA short transposed", func(g *Gemm) { g.TransA, g.LDA = true, 2 }, false, "LDA 2 is less than the stored row length 3"},
		{"LDB short transposed", func(g *Gemm) { g.TransB, g.LDB = true, 4 }, false, "LDB 4 is less than the stored row length 5"},
		{"LDC short", func(g *Gemm) { g.LDC = 3 }, false, "LDC 3"},
		{"NaN alpha", func(g *Gemm) { g.Alpha = math.NaN() }, false, "Alpha NaN"},
		{"Inf beta", func(g *Gemm) { g.Beta = math.Inf(1) }, false, "Beta +Inf"},
		{"TF32 not allowed", func(g *Gemm) { g.Precision = PrecisionTF32 }, false, "TF32 is not allowed"},
		{"unknown precision", func(g *Gemm) { g.Precision = 9 }, true, "unknown precision"},
		{"unknown epilogue", func(g *Gemm) { g.Epilogue = 7; g.Bias = 1 }, false, "unknown epilogue"},
		{"nil C", func(g *Gemm) { g.C = 0 }, false, "nil device pointer"},
		{"nil A", func(g *Gemm) { g.A = 0 }, false, "nil device pointer"},
		{"epilogue without bias", func(g *Gemm) { g.Epilogue = EpilogueBias }, false, "without a Bias pointer"},
		{"epilogue in a batch", func(g *Gemm) { g.Epilogue, g.Bias, g.Batch, g.StrideC = EpilogueBias, 1, 2, 12 }, false, "needs Batch 1"},
		{"overlapping batch outputs", func(g *Gemm) { g.Batch, g.StrideC = 2, 11 }, false, "StrideC 11 is less than C's extent 12"},
		{"negative stride", func(g *Gemm) { g.Batch, g.StrideA, g.StrideC = 2, -1, 12 }, false, "negative stride"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := ok
			tc.edit(&g)
			_, err := g.check(tc.tf32)
			if !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("check = %v, want loom.ErrInvalid saying %q", err, tc.want)
			}
		})
	}
	for _, g := range []Gemm{ok, {M: 0, N: 4, K: 5}, {M: 3, N: 4, K: 0, C: 0x3000},
		{M: 3, N: 4, K: 5, A: 1, B: 1, C: 1, Batch: 2, StrideC: 12}} {
		if _, err := g.check(false); err != nil {
			t.Errorf("check(%+v) = %v", g, err)
		}
	}
	g := ok
	g.Precision = PrecisionTF32
	if _, err := g.check(true); err != nil {
		t.Errorf("TF32 allowed: %v", err)
	}
}

// TestGemmColumnMajorSwap checks the row-major to column-major mapping on
// its own: operands, sizes and leading dimensions swap, each transpose
// stays with its operand, packed leading dimensions are the stored rows.
func TestGemmColumnMajorSwap(t *testing.T) {
	for _, tc := range []struct {
		g    Gemm
		want colMajor
	}{
		{Gemm{M: 3, N: 4, K: 5, A: 0xa, B: 0xb, C: 0xc},
			colMajor{ta: 0, tb: 0, m: 4, n: 3, k: 5, a: 0xb, b: 0xa, c: 0xc, lda: 4, ldb: 5, ldc: 4, batch: 1, comp: 68}},
		{Gemm{TransA: true, M: 3, N: 4, K: 5, A: 0xa, B: 0xb, C: 0xc, LDC: 9},
			colMajor{ta: 0, tb: 1, m: 4, n: 3, k: 5, a: 0xb, b: 0xa, c: 0xc, lda: 4, ldb: 3, ldc: 9, batch: 1, comp: 68}},
		{Gemm{TransB: true, M: 3, N: 4, K: 5, A: 0xa, B: 0xb, C: 0xc, LDA: 7, Precision: PrecisionBF16},
			colMajor{ta: 1, tb: 0, m: 4, n: 3, k: 5, a: 0xb, b: 0xa, c: 0xc, lda: 5, ldb: 7, ldc: 4, batch: 1,
				abType: cudaR16BF, cType: cudaR32F, comp: 68}},
		{Gemm{TransA: true, TransB: true, M: 3, N: 4, K: 5, A: 0xa, B: 0xb, C: 0xc, Batch: 2, StrideA: 15, StrideB: 0, StrideC: 20,
			Precision: PrecisionF64},
			colMajor{ta: 1, tb: 1, m: 4, n: 3, k: 5, a: 0xb, b: 0xa, c: 0xc, lda: 5, ldb: 3, ldc: 4, sa: 0, sb: 15, sc: 20, batch: 2,
				abType: cudaR64F, cType: cudaR64F, comp: 70}},
	} {
		got, err := tc.g.check(true)
		if err != nil {
			t.Fatal(err)
		}
		got.alpha, got.beta = nil, nil
		if got != tc.want {
			t.Errorf("%v:\n got %+v\nwant %+v", &tc.g, got, tc.want)
		}
	}
}

func TestBLASLoadErrorText(t *testing.T) {
	for _, tc := range []struct {
		e    BLASLoadError
		want []string
	}{
		{BLASLoadError{Library: "cuBLAS", Env: CUBLASEnv, Disabled: true}, []string{"cuda: cuBLAS is off (LOOM_CUBLAS=off)"}},
		{BLASLoadError{Library: "cuBLASLt", Env: CUBLASLtEnv}, []string{"no cuBLASLt library could be loaded (tried nothing); set LOOM_CUBLASLT"}},
	} {
		for _, w := range tc.want {
			if !strings.Contains(tc.e.Error(), w) {
				t.Errorf("%q does not say %q", tc.e.Error(), w)
			}
		}
	}
	if off := (&BLASLoadError{Disabled: true}); !errors.Is(off, loom.ErrUnsupported) {
		t.Error("a disabled library does not match loom.ErrUnsupported")
	}
	if missing := (&BLASLoadError{}); errors.Is(missing, loom.ErrUnsupported) {
		t.Error("a missing library matches loom.ErrUnsupported")
	}
}
