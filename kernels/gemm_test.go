package kernels

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// backendUnderTest is one GEMM implementation exercised by the tests.
type backendUnderTest struct {
	name string
	b    *BLAS
}

// goBackends returns the pure-Go GEMM in configurations that cover its code
// paths: serial, parallel, and tiny block sizes (many jc/pc/ic blocks and
// partial tiles), the latter with float32's own micro-kernel (the vector
// one where the CPU has it) and with the portable one.
func goBackends(t testing.TB) []backendUnderTest {
	mk := func(threads int) *BLAS {
		b, err := Load(WithLibrary("go"), WithThreads(threads))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	serial, par, tiny, scalar := mk(1), mk(2), mk(3), mk(2)
	par.gog.parMin = 1
	tiny.gog.parMin = 1
	tiny.gog.blk32 = blocking32()
	tiny.gog.blk32.mc, tiny.gog.blk32.kc, tiny.gog.blk32.nc = 8, 5, 20
	tiny.gog.blk64 = blocking64()
	tiny.gog.blk64.mc, tiny.gog.blk64.kc, tiny.gog.blk64.nc = 12, 7, 12
	scalar.gog.parMin = 1
	scalar.gog.blk32 = blocking{mc: 8, kc: 5, nc: 6, mr: mr, nr: nr}
	scalar.gog.blk64 = blocking{mc: 12, kc: 7, nc: 4, mr: mr, nr: nr}
	return []backendUnderTest{{"go-serial", serial}, {"go-parallel", par}, {"go-tiny-blocks", tiny}, {"go-tiny-blocks-portable", scalar}}
}

// libBackend loads the named library family, or skips naming what is missing.
func libBackend(t testing.TB, family string) *BLAS {
	b, err := Load(WithLibrary(family))
	if err != nil {
		t.Skipf("%s not available (install libopenblas0 / libblis4 to test it): %v", family, err)
	}
	t.Logf("loaded %s; config %q; threads %d", b.Name(), b.Config(), b.Threads())
	return b
}

type shape struct{ m, n, k int }

func testShapes(short bool) []shape {
	small := []int{1, 3, 17, 129}
	var s []shape
	for _, m := range small {
		for _, n := range small {
			for _, k := range small {
				s = append(s, shape{m, n, k})
			}
		}
	}
	s = append(s, shape{64, 64, 64}, shape{64, 1, 257}, shape{1, 64, 3}, shape{17, 257, 64},
		shape{257, 3, 17}, shape{129, 64, 257}, shape{3, 3, 0}, shape{0, 5, 3}, shape{5, 0, 3})
	if !short {
		s = append(s, shape{257, 257, 257}, shape{257, 129, 64})
	}
	return s
}

// scalars are the (alpha, beta) pairs tested; NaN-filled C is used with beta 0.
var scalars = [][2]float64{{1, 0}, {1, 1}, {-0.75, 2.5}, {0, 0.5}, {2, 0}, {0, 0}}

// refGemm is the naive float64 reference. It also returns, per element,
// |alpha|·Σ|a||b| + |beta||c0| for the error bound.
func refGemm(transA, transB bool, m, n, k int, alpha float64, a []float64, lda int, b []float64, ldb int, beta float64, c []float64, ldc int) (out, mag []float64) {
	out = make([]float64, m*n)
	mag = make([]float64, m*n)
	for i := range m {
		for j := range n {
			var s, sa float64
			for p := range k {
				var av, bv float64
				if transA {
					av = a[p*lda+i]
				} else {
					av = a[i*lda+p]
				}
				if transB {
					bv = b[j*ldb+p]
				} else {
					bv = b[p*ldb+j]
				}
				s += av * bv
				sa += math.Abs(av * bv)
			}
			r := alpha * s
			mg := math.Abs(alpha) * sa
			if beta != 0 {
				r += beta * c[i*ldc+j]
				mg += math.Abs(beta * c[i*ldc+j])
			}
			out[i*n+j] = r
			mag[i*n+j] = mg
		}
	}
	return out, mag
}

// fill returns a rows×cols matrix with row stride ld; padding holds NaN so
// that reading it shows up in the result.
func fill(rng *rand.Rand, rows, cols, ld int) []float64 {
	if rows == 0 || cols == 0 {
		return nil
	}
	x := make([]float64, (rows-1)*ld+cols)
	for i := range x {
		x[i] = math.NaN()
	}
	for i := range rows {
		for j := range cols {
			x[i*ld+j] = float64(float32(rng.Float64()*2 - 1))
		}
	}
	return x
}

func to32(x []float64) []float32 {
	y := make([]float32, len(x))
	for i, v := range x {
		y[i] = float32(v)
	}
	return y
}

// checkGEMM runs every transpose, shape, scalar pair and padding on b in
// float32 and float64 and compares with the reference under the bound
// |got - ref| <= 2(k+2)·eps·(|alpha|Σ|a·b| + |beta·c0|) + tiny, a summation
// error bound valid for any summation order (with or without FMA).
func checkGEMM(t *testing.T, b *BLAS) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, sh := range testShapes(testing.Short()) {
		for _, tr := range [4][2]bool{{false, false}, {false, true}, {true, false}, {true, true}} {
			for si, ab := range scalars {
				pad := si % 3 * 2 // 0, 2 or 4 extra columns of padding
				m, n, k := sh.m, sh.n, sh.k
				aRows, aCols := m, k
				if tr[0] {
					aRows, aCols = k, m
				}
				bRows, bCols := k, n
				if tr[1] {
					bRows, bCols = n, k
				}
				lda, ldb, ldc := max(1, aCols+pad), max(1, bCols+pad+1), max(1, n+pad)
				a := fill(rng, aRows, aCols, lda)
				bm := fill(rng, bRows, bCols, ldb)
				c := fill(rng, m, n, ldc)
				if ab[1] == 0 {
					for i := range c {
						c[i] = math.NaN()
					}
				}
				ref, mag := refGemm(tr[0], tr[1], m, n, k, ab[0], a, lda, bm, ldb, ab[1], c, ldc)
				name := fmt.Sprintf("m%d_n%d_k%d_tA%v_tB%v_alpha%g_beta%g_pad%d", m, n, k, tr[0], tr[1], ab[0], ab[1], pad)

				c32 := to32(c)
				if err := b.Sgemm(tr[0], tr[1], m, n, k, float32(ab[0]), to32(a), lda, to32(bm), ldb, float32(ab[1]), c32, ldc); err != nil {
					t.Fatalf("%s: Sgemm: %v", name, err)
				}
				got := make([]float64, len(c32))
				for i, v := range c32 {
					got[i] = float64(v)
				}
				compare(t, "Sgemm "+name, got, c, ref, mag, m, n, k, ldc, 0x1p-24)

				c64 := append([]float64(nil), c...)
				if err := b.Dgemm(tr[0], tr[1], m, n, k, ab[0], a, lda, bm, ldb, ab[1], c64, ldc); err != nil {
					t.Fatalf("%s: Dgemm: %v", name, err)
				}
				compare(t, "Dgemm "+name, c64, c, ref, mag, m, n, k, ldc, 0x1p-53)
				if t.Failed() {
					t.FailNow()
				}
			}
		}
	}
}

func compare(t *testing.T, name string, got, c0, ref, mag []float64, m, n, k, ldc int, eps float64) {
	t.Helper()
	for i := range m {
		for j := range ldc {
			if i*ldc+j >= len(got) {
				break
			}
			g := got[i*ldc+j]
			if j >= n { // padding of C must be left alone
				if !math.IsNaN(c0[i*ldc+j]) && g != c0[i*ldc+j] || math.IsNaN(c0[i*ldc+j]) != math.IsNaN(g) {
					t.Errorf("%s: padding C[%d][%d] changed to %g", name, i, j, g)
					return
				}
				continue
			}
			r := ref[i*n+j]
			tol := 2*float64(k+2)*eps*mag[i*n+j] + 1e-30
			if math.IsNaN(g) || math.Abs(g-r) > tol {
				t.Errorf("%s: C[%d][%d] = %g, want %g (tol %g)", name, i, j, g, r, tol)
				return
			}
		}
	}
}

func TestGEMMPureGo(t *testing.T) {
	for _, bt := range goBackends(t) {
		t.Run(bt.name, func(t *testing.T) { checkGEMM(t, bt.b) })
	}
}

func TestGEMMOpenBLAS(t *testing.T) { checkGEMM(t, libBackend(t, "openblas")) }

func TestGEMMBLIS(t *testing.T) { checkGEMM(t, libBackend(t, "blis")) }

func TestGEMMDefault(t *testing.T) {
	b, err := Default()
	if err != nil {
		t.Skipf("%s forces a BLAS library that does not load: %v", EnvVar, err)
	}
	t.Logf("Default: %s (%s); tried: %q", b.Name(), b.Config(), b.Tried())
	b2, _ := Default()
	if b != b2 {
		t.Fatal("Default returned different instances")
	}
	checkGEMM(t, b)
}

func TestLoadSelection(t *testing.T) {
	t.Setenv(EnvVar, "go")
	b, err := Load()
	if err != nil || b.Backend() != BackendGo || b.Name() != "pure-go" {
		t.Fatalf("LOOM_BLAS=go: got %v, %v", b.Name(), err)
	}
	if !strings.HasPrefix(b.Config(), "pure-go") {
		t.Errorf("Config = %q", b.Config())
	}
	if _, err := Load(WithLibrary("/nonexistent/libnothing.so")); err == nil {
		t.Error("forcing a missing library did not fail")
	}
	t.Setenv(EnvVar, "/nonexistent/libnothing.so")
	if _, err := Load(); err == nil {
		t.Error("LOOM_BLAS pointing at a missing library did not fail")
	}
	// WithLibrary overrides the environment.
	if b, err := Load(WithLibrary("go")); err != nil || b.Backend() != BackendGo {
		t.Errorf("WithLibrary(go) over env: %v, %v", b, err)
	}
	// libc exists everywhere but is no CBLAS: rejected with a reason.
	if _, err := Load(WithLibrary("libc.so.6")); err == nil || !strings.Contains(err.Error(), "libc.so.6") {
		t.Errorf("libc.so.6 accepted or unexplained: %v", err)
	}
	t.Setenv(EnvVar, "")
	b, err = Load()
	if err != nil {
		t.Fatalf("automatic Load failed: %v", err)
	}
	t.Logf("automatic: %s; tried %q", b.Name(), b.Tried())
	if b.Backend() == BackendGo && len(b.Tried()) == 0 && len(autoCandidates()) > 0 {
		t.Error("fell back to pure Go without saying why")
	}
}

func TestLibraryThreads(t *testing.T) {
	for _, fam := range []string{"openblas", "blis"} {
		t.Run(fam, func(t *testing.T) {
			b := libBackend(t, fam)
			before := b.Threads()
			b1, err := Load(WithLibrary(fam), WithThreads(1))
			if err != nil {
				t.Fatal(err)
			}
			if got := b1.Threads(); got != 1 {
				t.Errorf("after WithThreads(1): Threads() = %d", got)
			}
			if before > 0 {
				Load(WithLibrary(fam), WithThreads(before)) // restore process-wide setting
			}
		})
	}
}

func TestGEMMBadArguments(t *testing.T) {
	bs := goBackends(t)[:1]
	if b, err := Load(WithLibrary("openblas")); err == nil {
		bs = append(bs, backendUnderTest{"openblas", b})
	}
	a := make([]float32, 12)
	c := make([]float32, 12)
	cases := []struct {
		name                   string
		tA, tB                 bool
		m, n, k, lda, ldb, ldc int
		la, lb, lc             int
	}{
		{"negative m", false, false, -1, 2, 2, 2, 2, 2, 12, 12, 12},
		{"negative k", false, false, 2, 2, -3, 2, 2, 2, 12, 12, 12},
		{"lda too small", false, false, 3, 3, 4, 3, 3, 3, 12, 12, 12},
		{"lda too small transA", true, false, 4, 3, 3, 3, 3, 3, 12, 12, 12},
		{"ldb too small", false, false, 3, 4, 3, 3, 3, 4, 12, 12, 12},
		{"ldb too small transB", false, true, 3, 3, 4, 4, 3, 3, 12, 12, 12},
		{"ldc too small", false, false, 3, 4, 3, 3, 4, 3, 12, 12, 12},
		{"ld zero on empty", false, false, 0, 0, 0, 0, 1, 1, 0, 0, 0},
		{"a too short", false, false, 3, 3, 3, 3, 3, 3, 8, 12, 12},
		{"b too short", false, false, 3, 3, 3, 3, 3, 3, 12, 8, 12},
		{"c too short", false, false, 3, 3, 3, 3, 3, 3, 12, 12, 8},
		{"c too short for ldc", false, false, 2, 2, 2, 2, 2, 8, 12, 12, 9},
		{"overflowing ld", false, false, 3, 3, 3, math.MaxInt / 2, 3, 3, 12, 12, 12},
	}
	for _, bt := range bs {
		for _, tc := range cases {
			for i := range c {
				c[i] = 7
			}
			err := bt.b.Sgemm(tc.tA, tc.tB, tc.m, tc.n, tc.k, 1, a[:tc.la], tc.lda, a[:tc.lb], tc.ldb, 0, c[:tc.lc], tc.ldc)
			if err == nil {
				t.Errorf("%s: %s: no error", bt.name, tc.name)
			}
			err64 := bt.b.Dgemm(tc.tA, tc.tB, tc.m, tc.n, tc.k, 1, make([]float64, tc.la), tc.lda, make([]float64, tc.lb), tc.ldb, 0, make([]float64, tc.lc), tc.ldc)
			if err64 == nil {
				t.Errorf("%s: %s: Dgemm: no error", bt.name, tc.name)
			}
			for _, v := range c {
				if v != 7 {
					t.Fatalf("%s: %s: C modified on error", bt.name, tc.name)
				}
			}
		}
	}
	var nilBLAS *BLAS
	if nilBLAS.Sgemm(false, false, 1, 1, 1, 1, a, 1, a, 1, 0, c, 1) == nil {
		t.Error("nil *BLAS: no error")
	}
	// Empty problems are valid and touch nothing.
	if err := bs[0].b.Sgemm(false, false, 0, 0, 0, 1, nil, 1, nil, 1, 0, nil, 1); err != nil {
		t.Errorf("empty problem: %v", err)
	}
}
