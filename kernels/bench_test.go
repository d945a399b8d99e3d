package kernels

import (
	"fmt"
	"testing"
)

// BenchmarkSgemm reports GFLOP/s (2·n³ per call) for square n×n float32
// products on the pure-Go GEMM and on each library that loads.
func BenchmarkSgemm(b *testing.B) {
	benchGEMM(b, func(bl *BLAS, n int, x, y, z []float32) error {
		return bl.Sgemm(false, false, n, n, n, 1, x, n, y, n, 0, z, n)
	})
}

// BenchmarkDgemm is BenchmarkSgemm in float64.
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
