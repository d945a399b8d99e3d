//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/dynlib"
	"github.com/b7ea7098/loom/internal/half"
)

// These tests load testdata/fakecublas.cpp, built here with g++, as both
// cuBLAS and cuBLASLt. The fake computes GEMMs on the host in double from
// "device memory" it hands out (fake_malloc) and logs every call, so the
// tests check both the numbers (exactly, against a Go reference that sums
// in the same order) and what the binding passed: transposes, sizes and
// leading dimensions after the row-major swap, strides, batch counts,
// data and compute types, epilogues, bias and workspace pointers, the
// stream.

// fakeBLAS is the built fake and its controls.
type fakeBLAS struct {
	path         string
	malloc       func(bytes uintptr) unsafe.Pointer
	free         func(p unsafe.Pointer) int32
	log          func() string
	logReset     func()
	fail         func(symbol string, status, n int32)
	setVersion   func(lib string, major, minor, patch int32)
	setHeuristic func(n int32)
	live         func(kind string) int64
	sizeofResult func() int32
}

// buildFakeBLAS compiles the fake into a temporary directory; it skips
// the test when there is no C++ compiler.
func buildFakeBLAS(t *testing.T) *fakeBLAS {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ to build the fake cuBLAS: ", err)
	}
	lib := filepath.Join(t.TempDir(), "libfakecublas.so")
	// -ffp-contract=off: no fused multiply-adds, so the fake's sums round
	// exactly as the Go reference's.
	cmd := exec.Command(cxx, "-std=c++20", "-shared", "-fPIC", "-O1", "-ffp-contract=off", "-Wall", "-Werror",
		"-Wno-unused-parameter", "-o", lib, filepath.Join("testdata", "fakecublas.cpp"))
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the fake cuBLAS: %v\n%s", err, out)
	}
	dl, err := dynlib.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeBLAS{path: lib}
	if err := dl.Bind([]dynlib.Symbol{
		{Name: "fake_malloc", Fn: &f.malloc}, {Name: "fake_free", Fn: &f.free},
		{Name: "fake_log", Fn: &f.log}, {Name: "fake_log_reset", Fn: &f.logReset},
		{Name: "fake_fail", Fn: &f.fail}, {Name: "fake_set_version", Fn: &f.setVersion},
		{Name: "fake_set_heuristic", Fn: &f.setHeuristic}, {Name: "fake_live", Fn: &f.live},
		{Name: "fake_sizeof_heuristic_result", Fn: &f.sizeofResult},
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// reset puts the fake's controls back to their defaults.
func (f *fakeBLAS) reset() {
	f.logReset()
	f.setVersion("cublas", 12, 4, 5)
	f.setVersion("cublasLt", 12, 4, 5)
	f.setHeuristic(1)
}

// load loads the fake as cuBLAS and cuBLASLt.
func (f *fakeBLAS) load(t *testing.T, opts ...BLASOption) *BLAS {
	t.Helper()
	b, err := LoadBLAS(append([]BLASOption{WithCUBLAS(f.path), WithCUBLASLt(f.path)}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// alloc returns n bytes of fake device memory, freed when t ends.
func (f *fakeBLAS) alloc(t *testing.T, n int) unsafe.Pointer {
	t.Helper()
	p := f.malloc(uintptr(n))
	t.Cleanup(func() {
		if f.free(p) != 0 {
			t.Errorf("fake_free(%p): not a live block", p)
		}
	})
	return p
}

// f32 copies v into fake device memory.
func (f *fakeBLAS) f32(t *testing.T, v []float32) unsafe.Pointer {
	p := f.alloc(t, 4*len(v))
	copy(unsafe.Slice((*float32)(p), len(v)), v)
	return p
}

// f64 copies v into fake device memory.
func (f *fakeBLAS) f64(t *testing.T, v []float64) unsafe.Pointer {
	p := f.alloc(t, 8*len(v))
	copy(unsafe.Slice((*float64)(p), len(v)), v)
	return p
}

// bf16 copies v, as bfloat16 bit patterns, into fake device memory.
func (f *fakeBLAS) bf16(t *testing.T, v []uint16) unsafe.Pointer {
	p := f.alloc(t, 2*len(v))
	copy(unsafe.Slice((*uint16)(p), len(v)), v)
	return p
}

// lastCall parses the last log line of call into its key=value fields.
func (f *fakeBLAS) lastCall(t *testing.T, call string) map[string]string {
	t.Helper()
	lines := strings.Split(f.log(), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		fields := strings.Fields(lines[i])
		if len(fields) == 0 || fields[0] != call {
			continue
		}
		m := map[string]string{}
		for _, kv := range fields[1:] {
			k, v, _ := strings.Cut(kv, "=")
			m[k] = v
		}
		return m
	}
	t.Fatalf("no %s in the fake's log:\n%s", call, f.log())
	return nil
}

// blasWantFields fails t for every field of got that differs from want.
func blasWantFields(t *testing.T, what string, got map[string]string, want map[string]string) {
	t.Helper()
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %s=%q, want %q", what, k, got[k], v)
		}
	}
}

// hex formats an address as the fake's %p and %#lx do.
func blasHex(p uintptr) string { return fmt.Sprintf("%#x", p) }

// op is the fake's log name of a cuBLAS operation.
func blasOp(trans bool) string {
	if trans {
		return "T"
	}
	return "N"
}

// blasRefGemm computes the row-major GEMM g in float64 over the stored
// matrices a, b, c (already widened, and rounded as the precision rounds
// its inputs), summing over k in order as the fake does; batch i reads
// a, b, c at i times the strides. It returns the new C, unrounded.
func blasRefGemm(g Gemm, a, b, c []float64) []float64 {
	out := append([]float64(nil), c...)
	lda, ldb, ldc := ldOr(g.LDA, g.K), ldOr(g.LDB, g.N), ldOr(g.LDC, g.N)
	if g.TransA {
		lda = ldOr(g.LDA, g.M)
	}
	if g.TransB {
		ldb = ldOr(g.LDB, g.K)
	}
	for bi := range max(g.Batch, 1) {
		oa, ob, oc := bi*int(g.StrideA), bi*int(g.StrideB), bi*int(g.StrideC)
		for i := range g.M {
			for j := range g.N {
				s := 0.0
				for p := range g.K {
					ia, ib := oa+i*lda+p, ob+p*ldb+j
					if g.TransA {
						ia = oa + p*lda + i
					}
					if g.TransB {
						ib = ob + j*ldb + p
					}
					x, y := a[ia], b[ib]
					s += float64(x * y) // the conversion forbids fusing into an FMA
				}
				v := float64(g.Alpha * s)
				if g.Beta != 0 {
					v += float64(g.Beta * c[oc+i*ldc+j])
				}
				out[oc+i*ldc+j] = v
			}
		}
	}
	return out
}

// blasRandF32 returns n float32 values in [-1, 1) with 24 random mantissa bits.
func blasRandF32(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.Float64()*2 - 1)
	}
	return v
}

func blasWiden32(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// blasTF32Round rounds x to 10 mantissa bits, ties to even: what TF32 tensor
// cores do to float32 inputs.
func blasTF32Round(x float32) float32 {
	b := math.Float32bits(x)
	b = (b + 0xfff + (b>>13)&1) &^ 0x1fff
	return math.Float32frombits(b)
}

// blasStoredLen is the number of elements a stored row-major matrix of rows
// rows with leading dimension ld spans, over batch matrices stride apart.
func blasStoredLen(rows, row, ld, batch int, stride int64) int {
	return (batch-1)*int(stride) + (rows-1)*ld + row
}

func TestFakeCUBLAS(t *testing.T) {
	f := buildFakeBLAS(t)
	if n := f.sizeofResult(); n != int32(unsafe.Sizeof(ltHeuristicResult{})) {
		t.Fatalf("the fake's cublasLtMatmulHeuristicResult_t is %d bytes, the Go mirror %d", n, unsafe.Sizeof(ltHeuristicResult{}))
	}
	r := rand.New(rand.NewPCG(27, 3))

	t.Run("Load", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		if a, bb, c := b.Version(); a != 12 || bb != 4 || c != 5 {
			t.Errorf("Version = %d.%d.%d", a, bb, c)
		}
		if a, bb, c, ok := b.LtVersion(); !ok || a != 12 || bb != 4 || c != 5 {
			t.Errorf("LtVersion = %d.%d.%d %v", a, bb, c, ok)
		}
		if b.Path() != f.path || b.LtPath() != f.path {
			t.Errorf("paths %q %q, want %q", b.Path(), b.LtPath(), f.path)
		}
		if d := b.Describe(); d != "cuBLAS 12.4.5 + cuBLASLt 12.4.5 (bias epilogues fused), TF32 off" {
			t.Errorf("Describe = %q", d)
		}
		if tr := b.Tried(); len(tr) != 2 || tr[0].Err != nil || tr[1].Err != nil {
			t.Errorf("Tried = %v", tr)
		}
	})

	t.Run("Handle", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		ws := uintptr(f.alloc(t, 1<<16))
		h, err := b.NewHandle(0x5eed, ws, 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		handle := f.lastCall(t, "cublasCreate_v2")["handle"]
		blasWantFields(t, "SetStream", f.lastCall(t, "cublasSetStream_v2"), map[string]string{"handle": handle, "stream": "0x5eed"})
		blasWantFields(t, "SetWorkspace", f.lastCall(t, "cublasSetWorkspace_v2"),
			map[string]string{"handle": handle, "ws": blasHex(ws), "bytes": "65536"})
		if f.live("cublas_handle") != 1 || f.live("lt_handle") != 1 {
			t.Errorf("live handles %d, %d after NewHandle", f.live("cublas_handle"), f.live("lt_handle"))
		}
		if err := h.Close(); err != nil {
			t.Fatal(err)
		}
		if err := h.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if f.live("cublas_handle") != 0 || f.live("lt_handle") != 0 {
			t.Errorf("live handles %d, %d after Close", f.live("cublas_handle"), f.live("lt_handle"))
		}
		if _, err := h.Gemm(Gemm{M: 1, N: 1, K: 1, A: ws, B: ws, C: ws}); !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("Gemm on a closed handle: %v", err)
		}
		for _, bad := range []struct {
			ws    uintptr
			bytes int64
		}{{0, 16}, {ws, -1}} {
			if _, err := b.NewHandle(0, bad.ws, bad.bytes); !errors.Is(err, loom.ErrInvalid) {
				t.Errorf("NewHandle(0, %#x, %d) = %v, want loom.ErrInvalid", bad.ws, bad.bytes, err)
			}
		}
		// A failure half-way through NewHandle names the call and leaks no handle.
		f.fail("cublasSetStream_v2", 7, 1)
		_, err = b.NewHandle(1, 0, 0)
		var be *BLASError
		if !errors.As(err, &be) || be.Call != "cublasSetStream_v2" || be.Name != "CUBLAS_STATUS_INVALID_VALUE" {
			t.Errorf("NewHandle with SetStream failing: %v", err)
		}
		if f.live("cublas_handle") != 0 {
			t.Errorf("%d cuBLAS handles left after a failed NewHandle", f.live("cublas_handle"))
		}
	})

	// Every shape of {1,3,17,33}³ and every transpose combination, with
	// and without padded leading dimensions, against the Go reference,
	// bit for bit; the log shows the swapped call.
	t.Run("GemmShapes", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		h, err := b.NewHandle(0x77, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		sizes := []int{1, 3, 17, 33}
		for _, m := range sizes {
			for _, n := range sizes {
				for _, k := range sizes {
					for tr := range 4 {
						g := Gemm{M: m, N: n, K: k, TransA: tr&1 != 0, TransB: tr&2 != 0, Alpha: 0.75, Beta: -0.5}
						pad := (m + n + k + tr) % 3
						rowsA, rowA := m, k
						if g.TransA {
							rowsA, rowA = k, m
						}
						rowsB, rowB := k, n
						if g.TransB {
							rowsB, rowB = n, k
						}
						if pad > 0 {
							g.LDA, g.LDB, g.LDC = rowA+pad, rowB+2*pad, n+pad
						}
						av := blasRandF32(r, rowsA*ldOr(g.LDA, rowA))
						bv := blasRandF32(r, rowsB*ldOr(g.LDB, rowB))
						cv := blasRandF32(r, m*ldOr(g.LDC, n))
						pa, pb, pc := f.f32(t, av), f.f32(t, bv), f.f32(t, cv)
						g.A, g.B, g.C = uintptr(pa), uintptr(pb), uintptr(pc)
						if fused, err := h.Gemm(g); err != nil || fused {
							t.Fatalf("%v: fused %v, %v", &g, fused, err)
						}
						want := blasRefGemm(g, blasWiden32(av), blasWiden32(bv), blasWiden32(cv))
						got := unsafe.Slice((*float32)(pc), len(cv))
						for i := range got {
							if got[i] != float32(want[i]) {
								t.Fatalf("%v: C[%d] = %v, want %v", &g, i, got[i], float32(want[i]))
							}
						}
						blasWantFields(t, g.String(), f.lastCall(t, "cublasGemmEx"), map[string]string{
							"stream": "0x77", "transa": blasOp(g.TransB), "transb": blasOp(g.TransA),
							"m": fmt.Sprint(n), "n": fmt.Sprint(m), "k": fmt.Sprint(k),
							"lda": fmt.Sprint(ldOr(g.LDB, rowB)), "ldb": fmt.Sprint(ldOr(g.LDA, rowA)), "ldc": fmt.Sprint(ldOr(g.LDC, n)),
							"A": blasHex(g.B), "B": blasHex(g.A), "C": blasHex(g.C),
							"Atype": "0", "Btype": "0", "Ctype": "0", "compute": "68", "algo": "-1",
							"alpha": "0.75", "beta": "-0.5",
						})
					}
				}
			}
		}
		if st := h.Stats(); st.Plain != 256 || st.Fused != 0 || st.Unfused != 0 {
			t.Errorf("Stats = %+v", st)
		}
	})

	// Precisions: each against the reference on inputs rounded as the
	// precision rounds them, and TF32 visibly different from float32.
	t.Run("Precision", func(t *testing.T) {
		f.reset()
		const m, n, k = 5, 7, 33
		av, bv := blasRandF32(r, m*k), blasRandF32(r, k*n)
		g0 := Gemm{M: m, N: n, K: k, Alpha: 1}
		b := f.load(t)
		h, err := b.NewHandle(0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		if _, err := h.Gemm(Gemm{M: m, N: n, K: k, A: 1, B: 1, C: 1, Precision: PrecisionTF32}); !errors.Is(err, loom.ErrInvalid) ||
			!strings.Contains(err.Error(), "WithTF32(true)") {
			t.Errorf("TF32 without WithTF32: %v", err)
		}
		bt := f.load(t, WithTF32(true))
		if !bt.TF32() || !strings.HasSuffix(bt.Describe(), "TF32 allowed") {
			t.Errorf("TF32() = %v, Describe %q", bt.TF32(), bt.Describe())
		}
		ht, err := bt.NewHandle(0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer ht.Close()

		run32 := func(h *BLASHandle, p Precision) []float32 {
			g := g0
			g.Precision = p
			pc := f.f32(t, make([]float32, m*n))
			g.A, g.B, g.C = uintptr(f.f32(t, av)), uintptr(f.f32(t, bv)), uintptr(pc)
			if _, err := h.Gemm(g); err != nil {
				t.Fatal(err)
			}
			return append([]float32(nil), unsafe.Slice((*float32)(pc), m*n)...)
		}
		check := func(what string, got []float32, want []float64) {
			t.Helper()
			for i := range got {
				if got[i] != float32(want[i]) {
					t.Fatalf("%s: C[%d] = %v, want %v", what, i, got[i], float32(want[i]))
				}
			}
		}
		f32 := run32(h, PrecisionF32)
		check("float32", f32, blasRefGemm(g0, blasWiden32(av), blasWiden32(bv), make([]float64, m*n)))
		blasWantFields(t, "float32", f.lastCall(t, "cublasGemmEx"), map[string]string{"compute": "68", "Atype": "0", "Ctype": "0"})

		tf := run32(ht, PrecisionTF32)
		blasWantFields(t, "tf32", f.lastCall(t, "cublasGemmEx"), map[string]string{"compute": "77", "Atype": "0", "Ctype": "0"})
		rt := func(v []float32) []float64 {
			out := make([]float64, len(v))
			for i, x := range v {
				out[i] = float64(blasTF32Round(x))
			}
			return out
		}
		check("tf32", tf, blasRefGemm(g0, rt(av), rt(bv), make([]float64, m*n)))
		diff := 0.0
		for i := range tf {
			diff = max(diff, math.Abs(float64(tf[i]-f32[i])))
		}
		// TF32 keeps 10 of float32's 23 mantissa bits: over 33 products of
		// values below 1 the results move by about 2⁻¹¹·√33 ≈ 3e-3, never
		// by more than 33·2⁻¹⁰.
		if diff == 0 || diff > 33.0/1024 {
			t.Errorf("TF32 differs from float32 by at most %g; want a visible difference below %g", diff, 33.0/1024)
		}

		// bf16 inputs: widened bit-exactly, products in float32 compute.
		a16, b16 := make([]uint16, len(av)), make([]uint16, len(bv))
		ab, bb := make([]float64, len(av)), make([]float64, len(bv))
		for i, x := range av {
			a16[i] = half.ToBFloat16(x)
			ab[i] = float64(half.BFloat16ToFloat32(a16[i]))
		}
		for i, x := range bv {
			b16[i] = half.ToBFloat16(x)
			bb[i] = float64(half.BFloat16ToFloat32(b16[i]))
		}
		want := blasRefGemm(g0, ab, bb, make([]float64, m*n))
		g := g0
		g.Precision = PrecisionBF16
		pc := f.f32(t, make([]float32, m*n))
		g.A, g.B, g.C = uintptr(f.bf16(t, a16)), uintptr(f.bf16(t, b16)), uintptr(pc)
		if _, err := h.Gemm(g); err != nil {
			t.Fatal(err)
		}
		check("bf16", unsafe.Slice((*float32)(pc), m*n), want)
		blasWantFields(t, "bf16", f.lastCall(t, "cublasGemmEx"), map[string]string{"compute": "68", "Atype": "14", "Btype": "14", "Ctype": "0"})

		g.Precision = PrecisionBF16Out
		pc16 := f.bf16(t, make([]uint16, m*n))
		g.C = uintptr(pc16)
		if _, err := h.Gemm(g); err != nil {
			t.Fatal(err)
		}
		for i, x := range unsafe.Slice((*uint16)(pc16), m*n) {
			if w := half.ToBFloat16(float32(want[i])); x != w {
				t.Fatalf("bf16 out: C[%d] = %#04x, want %#04x", i, x, w)
			}
		}
		blasWantFields(t, "bf16 out", f.lastCall(t, "cublasGemmEx"), map[string]string{"compute": "68", "Atype": "14", "Ctype": "14"})

		g = g0
		g.Precision, g.Alpha, g.Beta = PrecisionF64, 1.0/3, 0.25
		a64, b64, c64 := blasWiden32(av), blasWiden32(bv), blasWiden32(blasRandF32(r, m*n))
		pc = f.f64(t, c64)
		g.A, g.B, g.C = uintptr(f.f64(t, a64)), uintptr(f.f64(t, b64)), uintptr(pc)
		if _, err := h.Gemm(g); err != nil {
			t.Fatal(err)
		}
		want = blasRefGemm(g, a64, b64, c64)
		for i, x := range unsafe.Slice((*float64)(pc), m*n) {
			if x != want[i] {
				t.Fatalf("float64: C[%d] = %v, want %v", i, x, want[i])
			}
		}
		blasWantFields(t, "float64", f.lastCall(t, "cublasGemmEx"), map[string]string{"compute": "70", "Atype": "1", "Ctype": "1",
			"alpha": "0.33333333333333331", "beta": "0.25"})
	})

	// Strided batches, as attention's per-head GEMMs: strides swap with
	// their operands; a stride of 0 reuses one B for every batch.
	t.Run("StridedBatched", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		h, err := b.NewHandle(0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		for _, tc := range []struct {
			batch, m, n, k int
			ta, tb         bool
			sa, sb, sc     int64
		}{
			{3, 5, 7, 9, false, true, 5 * 9, 7 * 9, 5 * 7},
			{4, 17, 3, 33, true, false, 33*17 + 4, 0, 17*3 + 1},
			{2, 1, 1, 1, true, true, 1, 1, 1},
		} {
			g := Gemm{M: tc.m, N: tc.n, K: tc.k, TransA: tc.ta, TransB: tc.tb, Batch: tc.batch,
				StrideA: tc.sa, StrideB: tc.sb, StrideC: tc.sc, Alpha: 1.5, Beta: 0.5}
			rowsA, rowA, rowsB, rowB := tc.m, tc.k, tc.k, tc.n
			if tc.ta {
				rowsA, rowA = tc.k, tc.m
			}
			if tc.tb {
				rowsB, rowB = tc.n, tc.k
			}
			av := blasRandF32(r, blasStoredLen(rowsA, rowA, rowA, tc.batch, tc.sa))
			bv := blasRandF32(r, blasStoredLen(rowsB, rowB, rowB, tc.batch, tc.sb))
			cv := blasRandF32(r, blasStoredLen(tc.m, tc.n, tc.n, tc.batch, tc.sc))
			pc := f.f32(t, cv)
			g.A, g.B, g.C = uintptr(f.f32(t, av)), uintptr(f.f32(t, bv)), uintptr(pc)
			if _, err := h.Gemm(g); err != nil {
				t.Fatalf("%v: %v", &g, err)
			}
			want := blasRefGemm(g, blasWiden32(av), blasWiden32(bv), blasWiden32(cv))
			for i, x := range unsafe.Slice((*float32)(pc), len(cv)) {
				if x != float32(want[i]) {
					t.Fatalf("%v: C[%d] = %v, want %v", &g, i, x, float32(want[i]))
				}
			}
			blasWantFields(t, g.String(), f.lastCall(t, "cublasGemmStridedBatchedEx"), map[string]string{
				"transa": blasOp(tc.tb), "transb": blasOp(tc.ta), "m": fmt.Sprint(tc.n), "n": fmt.Sprint(tc.m), "k": fmt.Sprint(tc.k),
				"lda": fmt.Sprint(rowB), "ldb": fmt.Sprint(rowA), "ldc": fmt.Sprint(tc.n),
				"strideA": fmt.Sprint(tc.sb), "strideB": fmt.Sprint(tc.sa), "strideC": fmt.Sprint(tc.sc),
				"batch": fmt.Sprint(tc.batch), "compute": "68", "A": blasHex(g.B), "B": blasHex(g.A),
			})
		}
	})

	// Epilogues on cuBLASLt: a Linear forward with its bias, and the dW
	// GEMM with the bias gradient of whichever operand holds g.
	t.Run("Epilogues", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		const wsBytes = 1 << 15
		ws := uintptr(f.alloc(t, wsBytes))
		h, err := b.NewHandle(0x51, ws, wsBytes)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		const tokens, in, out = 17, 7, 3

		// y[T,out] = x[T,in]·W[out,in]ᵀ + bias[out].
		x, w, bias := blasRandF32(r, tokens*in), blasRandF32(r, out*in), blasRandF32(r, out)
		py, pbias := f.f32(t, make([]float32, tokens*out)), f.f32(t, bias)
		g := Gemm{M: tokens, N: out, K: in, TransB: true, A: uintptr(f.f32(t, x)), B: uintptr(f.f32(t, w)), C: uintptr(py),
			Alpha: 1, Epilogue: EpilogueBias, Bias: uintptr(pbias)}
		fused, err := h.Gemm(g)
		if err != nil || !fused {
			t.Fatalf("bias GEMM: fused %v, %v", fused, err)
		}
		want := blasRefGemm(g, blasWiden32(x), blasWiden32(w), make([]float64, tokens*out))
		for i, v := range unsafe.Slice((*float32)(py), tokens*out) {
			if wv := float32(want[i] + float64(bias[i%out])); v != wv {
				t.Fatalf("bias GEMM: y[%d] = %v, want %v", i, v, wv)
			}
		}
		blasWantFields(t, "bias", f.lastCall(t, "cublasLtMatmul"), map[string]string{
			"stream": "0x51", "transa": "T", "transb": "N", "m": "3", "n": "17", "k": "7",
			"lda": "7", "ldb": "7", "ldc": "3", "ldd": "3", "epilogue": "4", "bias": blasHex(uintptr(pbias)),
			"ws": blasHex(ws), "wsBytes": fmt.Sprint(wsBytes), "compute": "68", "scale": "0",
			"A": blasHex(g.B), "B": blasHex(g.A), "C": blasHex(g.C), "D": blasHex(g.C),
		})
		blasWantFields(t, "heuristic", f.lastCall(t, "cublasLtMatmulAlgoGetHeuristic"),
			map[string]string{"epilogue": "4", "maxWorkspace": fmt.Sprint(wsBytes)})

		// dW[out,in] = gᵀ·x with db[out] = Σ_t g[t,:]: g is blasOp(A).
		gr := blasRandF32(r, tokens*out)
		pdw, pdb := f.f32(t, blasRandF32(r, out*in)), f.f32(t, make([]float32, out))
		gw := Gemm{M: out, N: in, K: tokens, TransA: true, A: uintptr(f.f32(t, gr)), B: uintptr(f.f32(t, x)), C: uintptr(pdw),
			Alpha: 1, Beta: 1, Epilogue: EpilogueBiasGradA, Bias: uintptr(pdb)}
		dw0 := blasWiden32(unsafe.Slice((*float32)(pdw), out*in))
		if fused, err := h.Gemm(gw); err != nil || !fused {
			t.Fatalf("bias-grad-a GEMM: fused %v, %v", fused, err)
		}
		wantDW := blasRefGemm(gw, blasWiden32(gr), blasWiden32(x), dw0)
		for i, v := range unsafe.Slice((*float32)(pdw), out*in) {
			if v != float32(wantDW[i]) {
				t.Fatalf("dW[%d] = %v, want %v", i, v, float32(wantDW[i]))
			}
		}
		for j, v := range unsafe.Slice((*float32)(pdb), out) {
			s := 0.0
			for tk := range tokens {
				s += float64(gr[tk*out+j])
			}
			if v != float32(s) {
				t.Fatalf("db[%d] = %v, want %v", j, v, float32(s))
			}
		}
		blasWantFields(t, "bias-grad-a", f.lastCall(t, "cublasLtMatmul"), map[string]string{
			"epilogue": "512", "transa": "N", "transb": "T", "m": fmt.Sprint(in), "n": fmt.Sprint(out), "bias": blasHex(uintptr(pdb)),
		})

		// dWᵀ[in,out] = xᵀ·g: g is blasOp(B), the bias gradient sums B's columns.
		pdwt, pdb2 := f.f32(t, make([]float32, in*out)), f.f32(t, make([]float32, out))
		gb := Gemm{M: in, N: out, K: tokens, TransA: true, A: gw.B, B: gw.A, C: uintptr(pdwt),
			Alpha: 1, Epilogue: EpilogueBiasGradB, Bias: uintptr(pdb2)}
		if fused, err := h.Gemm(gb); err != nil || !fused {
			t.Fatalf("bias-grad-b GEMM: fused %v, %v", fused, err)
		}
		if got, want := unsafe.Slice((*float32)(pdb2), out), unsafe.Slice((*float32)(pdb), out); !blasEqual32(got, want) {
			t.Errorf("bias-grad-b db = %v, want %v", got, want)
		}
		blasWantFields(t, "bias-grad-b", f.lastCall(t, "cublasLtMatmul"), map[string]string{"epilogue": "256", "m": fmt.Sprint(out)})
		if st := h.Stats(); st.Fused != 3 || st.Plain != 0 || st.Unfused != 0 {
			t.Errorf("Stats = %+v", st)
		}
		for _, kind := range []string{"lt_desc", "lt_layout", "lt_pref"} {
			if n := f.live(kind); n != 0 {
				t.Errorf("%d %s left after the matmuls", n, kind)
			}
		}

		// The heuristic finding nothing: the product alone on cuBLAS, the
		// bias left to the caller, and Path says so.
		f.setHeuristic(0)
		before := append([]float32(nil), unsafe.Slice((*float32)(pbias), out)...)
		fused, err = h.Gemm(g)
		if err != nil || fused {
			t.Fatalf("bias GEMM without an algorithm: fused %v, %v", fused, err)
		}
		for i, v := range unsafe.Slice((*float32)(py), tokens*out) {
			if v != float32(want[i]) {
				t.Fatalf("unfused bias GEMM: y[%d] = %v, want the product alone %v", i, v, float32(want[i]))
			}
		}
		if !blasEqual32(before, unsafe.Slice((*float32)(pbias), out)) {
			t.Error("unfused bias GEMM wrote the bias")
		}
		blasWantFields(t, "fallback", f.lastCall(t, "cublasGemmEx"), map[string]string{"m": "3", "n": "17", "k": "7", "transa": "T"})
		if p := h.Path(); !strings.Contains(p, "1 of 4 epilogue GEMMs unfused (cuBLASLt heuristic found no algorithm for GEMM 17x3x7 (TB) float32 epilogue bias)") {
			t.Errorf("Path = %q", p)
		}

		// A workspace smaller than the algorithm needs: not fused either.
		f.setHeuristic(1)
		hs, err := b.NewHandle(0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer hs.Close()
		if fused, err := hs.Gemm(g); err != nil || fused {
			t.Errorf("bias GEMM without a workspace: fused %v, %v", fused, err)
		}
	})

	// Without cuBLASLt (off, or not found by the automatic search) GEMMs
	// with epilogues run unfused; a forced cuBLASLt that cannot be used is
	// an error, not a fallback.
	t.Run("LtUnavailable", func(t *testing.T) {
		for _, tc := range []struct {
			name    string
			version int32 // the fake cuBLAS's major version
			lt      string
			why     string
		}{
			{"off", 12, "off", "cuBLASLt is off (LOOM_CUBLASLT=off)"},
			// cuBLAS 99 makes the search look for libcublasLt.so.99.
			{"not found", 99, "", "no cuBLASLt (libcublasLt.so.99: "},
		} {
			t.Run(tc.name, func(t *testing.T) {
				f.reset()
				f.setVersion("cublas", tc.version, 0, 0)
				t.Setenv(CUBLASLtEnv, f.path) // the option wins over the variable
				b, err := LoadBLAS(WithCUBLAS(f.path), WithCUBLASLt(tc.lt))
				if err != nil {
					t.Fatal(err)
				}
				if b.LtPath() != "" && tc.lt == "" {
					// This machine has a libcublasLt.so that the search
					// found; the fallback cannot be shown with it.
					return
				}
				if _, _, _, ok := b.LtVersion(); ok || b.LtPath() != "" {
					t.Errorf("cuBLASLt in use: %q", b.LtPath())
				}
				if d := b.Describe(); !strings.Contains(d, tc.why) || !strings.Contains(d, "bias epilogues by separate kernels") {
					t.Errorf("Describe = %q, want it to say %q", d, tc.why)
				}
				h, err := b.NewHandle(0, 0, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer h.Close()
				pb := uintptr(f.f32(t, []float32{1}))
				if fused, err := h.Gemm(Gemm{M: 1, N: 1, K: 1, A: pb, B: pb, C: uintptr(f.f32(t, []float32{0})),
					Epilogue: EpilogueBias, Bias: pb}); err != nil || fused {
					t.Errorf("epilogue without cuBLASLt: fused %v, %v", fused, err)
				}
				if st := h.Stats(); st.Unfused != 1 {
					t.Errorf("Stats = %+v", st)
				}
				if p := h.Path(); p != b.Describe() {
					t.Errorf("Path = %q, want Describe's %q", p, b.Describe())
				}
			})
		}
		f.reset()
		f.setVersion("cublasLt", 10, 2, 1)
		_, err := LoadBLAS(WithCUBLAS(f.path), WithCUBLASLt(f.path))
		var le *BLASLoadError
		if !errors.As(err, &le) || le.Library != "cuBLASLt" || !le.Forced || !strings.Contains(err.Error(), "cuBLASLt 10.2.1 is older than 11.0") ||
			!strings.Contains(err.Error(), "set LOOM_CUBLASLT ") {
			t.Errorf("forced old cuBLASLt: %v", err)
		}
	})

	t.Run("Versions", func(t *testing.T) {
		f.reset()
		f.setVersion("cublas", 10, 2, 2)
		_, err := LoadBLAS(WithCUBLAS(f.path), WithCUBLASLt(f.path))
		var le *BLASLoadError
		if !errors.As(err, &le) || le.Library != "cuBLAS" || !le.Forced ||
			!strings.Contains(err.Error(), "cuBLAS 10.2.2 is older than 11.0") || !strings.Contains(err.Error(), "set LOOM_CUBLAS ") {
			t.Errorf("old cuBLAS: %v", err)
		}
		f.reset()
		f.setVersion("cublas", 11, 0, 0)
		f.setVersion("cublasLt", 11, 0, 3)
		b := f.load(t)
		if a, bb, c, ok := b.LtVersion(); !ok || a != 11 || bb != 0 || c != 3 {
			t.Errorf("LtVersion = %d.%d.%d %v", a, bb, c, ok)
		}
		f.reset()
		f.fail("cublasGetProperty", 14, 1)
		if _, err := LoadBLAS(WithCUBLAS(f.path)); err == nil || !strings.Contains(err.Error(), "cublasGetProperty(0) failed with 14 CUBLAS_STATUS_INTERNAL_ERROR") {
			t.Errorf("failing version probe: %v", err)
		}
	})

	// Failed calls name the call, the status and its name.
	t.Run("Errors", func(t *testing.T) {
		f.reset()
		b := f.load(t)
		ws := uintptr(f.alloc(t, 1<<13))
		h, err := b.NewHandle(0, ws, 1<<13)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		one := uintptr(f.f32(t, []float32{1, 2, 3, 4}))
		for _, tc := range []struct {
			call string
			g    Gemm
			want string
		}{
			{"cublasGemmEx", Gemm{M: 2, N: 2, K: 1, A: one, B: one, C: one},
				"cuda: GEMM 2x2x1 float32: cublasGemmEx failed with 13 CUBLAS_STATUS_EXECUTION_FAILED (the GPU program failed to execute)"},
			{"cublasGemmStridedBatchedEx", Gemm{M: 1, N: 1, K: 1, A: one, B: one, C: one, Batch: 2, StrideC: 1},
				"cublasGemmStridedBatchedEx failed with 13 CUBLAS_STATUS_EXECUTION_FAILED"},
			{"cublasLtMatmul", Gemm{M: 1, N: 2, K: 1, A: one, B: one, C: one, Epilogue: EpilogueBias, Bias: one},
				"epilogue bias: cublasLtMatmul failed with 13 CUBLAS_STATUS_EXECUTION_FAILED"},
			{"cublasLtMatmulAlgoGetHeuristic", Gemm{M: 1, N: 2, K: 1, A: one, B: one, C: one, Epilogue: EpilogueBias, Bias: one},
				"cublasLtMatmulAlgoGetHeuristic failed with 13"},
		} {
			f.fail(tc.call, 13, 1)
			_, err := h.Gemm(tc.g)
			var be *BLASError
			if !errors.As(err, &be) || be.Call != tc.call || be.Status != 13 || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s failing: %v, want %q", tc.call, err, tc.want)
			}
			if _, err := h.Gemm(tc.g); err != nil {
				t.Errorf("%s after the injected failure: %v", tc.call, err)
			}
		}
		// An operand past its block is the fake's INVALID_VALUE.
		_, err = h.Gemm(Gemm{M: 3, N: 3, K: 3, A: one, B: one, C: one})
		var be *BLASError
		if !errors.As(err, &be) || be.Name != "CUBLAS_STATUS_INVALID_VALUE" {
			t.Errorf("out-of-block operand: %v", err)
		}
		for _, kind := range []string{"lt_desc", "lt_layout", "lt_pref"} {
			if n := f.live(kind); n != 0 {
				t.Errorf("%d %s left after failed matmuls", n, kind)
			}
		}
	})
}

// TestLoadBLASMissing: a missing or turned-off cuBLAS names the library,
// what was tried and the variable to set; it needs no fake.
func TestLoadBLASMissing(t *testing.T) {
	_, err := LoadBLAS(WithCUBLAS("/nonexistent/libcublas.so.12"))
	var le *BLASLoadError
	if !errors.As(err, &le) || le.Library != "cuBLAS" || !le.Forced || le.Env != CUBLASEnv ||
		!strings.HasPrefix(err.Error(), "cuda: no cuBLAS library could be loaded (forced) (tried /nonexistent/libcublas.so.12: ") ||
		!strings.HasSuffix(err.Error(), "; set LOOM_CUBLAS to the path of another copy") {
		t.Errorf("missing forced cuBLAS: %v", err)
	}
	t.Setenv(CUBLASEnv, "off")
	_, err = LoadBLAS()
	if !errors.As(err, &le) || !le.Disabled || !errors.Is(err, loom.ErrUnsupported) || err.Error() != "cuda: cuBLAS is off (LOOM_CUBLAS=off)" {
		t.Errorf("cuBLAS off: %v", err)
	}
	t.Setenv(CUBLASEnv, "/nonexistent/from-env.so")
	if _, err = LoadBLAS(); !errors.As(err, &le) || !le.Forced || !strings.Contains(err.Error(), "from-env.so") {
		t.Errorf("cuBLAS forced by %s: %v", CUBLASEnv, err)
	}
}

func blasEqual32(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
