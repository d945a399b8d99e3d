package kernels

import (
	"fmt"
	"testing"
)

// stepGEMM is one GEMM of a tiny-GPT training step (reference/TINY_GPT.md §1: B·T =
// 1024 rows, D = 128, F = 512, V = 256): C[m×n] = op(A)·op(B) with op(A)
// m×k and op(B) k×n.
type stepGEMM struct {
	name           string
	transA, transB bool
	m, n, k        int
}

// stepGEMMs lists the distinct GEMM shapes of a training step. A linear
// layer y = x·Wᵀ with x [M, K] and W [N, K] runs "fwd" (NT) forward and,
// backward, "dx" = g·W (NN, [M, N]·[N, K]) and "dw" = gᵀ·x (TN, [N, M]ᵀ·[M,
// K]).
func stepGEMMs() []stepGEMM {
	const m = 1024
	var out []stepGEMM
	for _, nk := range [][2]int{{384, 128}, {128, 128}, {512, 128}, {128, 512}, {256, 128}} {
		n, k := nk[0], nk[1]
		out = append(out,
			stepGEMM{fmt.Sprintf("fwd-NT/m=%d,n=%d,k=%d", m, n, k), false, true, m, n, k},
			stepGEMM{fmt.Sprintf("dx-NN/m=%d,n=%d,k=%d", m, k, n), false, false, m, k, n},
			stepGEMM{fmt.Sprintf("dw-TN/m=%d,n=%d,k=%d", n, k, m), true, false, n, k, m},
		)
	}
	return out
}

// BenchmarkSgemm runs the GEMM shapes of a tiny-GPT training step on the
// pure-Go GEMM and on each library that loads, with 1 and 2 threads, and
// reports GFLOP/s (2·m·n·k per call) and the percentage of the estimated
// peak of the cores it may use (EstimatePeak, per core × threads).
func BenchmarkSgemm(b *testing.B) {
	peak := EstimatePeak()
	b.Logf("peak estimate: %v", peak)
	for _, name := range []string{"go", "openblas", "blis"} {
		for _, threads := range []int{1, 2} {
			if _, err := Load(WithLibrary(name)); err != nil {
				b.Logf("%s: skipped: %v", name, err)
				break
			}
			for _, s := range stepGEMMs() {
				b.Run(fmt.Sprintf("%s/threads=%d/%s", name, threads, s.name), func(b *testing.B) {
					// Loaded here: the thread count is library-wide state,
					// so it is set right before the measurement.
					bl, err := Load(WithLibrary(name), WithThreads(threads))
					if err != nil {
						b.Fatal(err)
					}
					ar, ac := s.m, s.k
					if s.transA {
						ar, ac = ac, ar
					}
					br, bc := s.k, s.n
					if s.transB {
						br, bc = bc, br
					}
					x, y, z := fill32(ar*ac, 13), fill32(br*bc, 7), make([]float32, s.m*s.n)
					for b.Loop() {
						if err := bl.Sgemm(s.transA, s.transB, s.m, s.n, s.k, 1, x, ac, y, bc, 0, z, s.n); err != nil {
							b.Fatal(err)
						}
					}
					flops := 2 * float64(s.m) * float64(s.n) * float64(s.k) * float64(b.N) / b.Elapsed().Seconds()
					b.ReportMetric(flops/1e9, "GFLOP/s")
					b.ReportMetric(100*flops/(peak.PerCoreFLOPS()*float64(min(threads, peak.Cores))), "%peak")
				})
			}
		}
	}
}

func fill32(n, mod int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%mod) / float32(mod)
	}
	return x
}

// BenchmarkSgemmSquare reports GFLOP/s (2·n³ per call) for square n×n
// float32 products on the pure-Go GEMM and on each library that loads.
func BenchmarkSgemmSquare(b *testing.B) {
	benchGEMM(b, func(bl *BLAS, n int, x, y, z []float32) error {
		return bl.Sgemm(false, false, n, n, n, 1, x, n, y, n, 0, z, n)
	})
}

// BenchmarkDgemm is BenchmarkSgemmSquare in float64.
func BenchmarkDgemm(b *testing.B) {
	benchGEMM(b, func(bl *BLAS, n int, x, y, z []float64) error {
		return bl.Dgemm(false, false, n, n, n, 1, x, n, y, n, 0, z, n)
	})
}

func benchGEMM[T float](b *testing.B, call func(*BLAS, int, []T, []T, []T) error) {
	backends := []string{"go", "openblas", "blis"}
	for _, name := range backends {
		bl, err := Load(WithLibrary(name))
		if err != nil {
			b.Logf("%s: skipped: %v", name, err)
			continue
		}
		for _, n := range []int{64, 256, 512, 1024} {
			b.Run(fmt.Sprintf("%s/n=%d", name, n), func(b *testing.B) {
				x, y, z := make([]T, n*n), make([]T, n*n), make([]T, n*n)
				for i := range x {
					x[i] = T(i%13) / 13
					y[i] = T(i%7) / 7
				}
				for b.Loop() {
					if err := call(bl, n, x, y, z); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(2*float64(n)*float64(n)*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
			})
		}
	}
}
