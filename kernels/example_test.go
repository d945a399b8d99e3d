package kernels_test

import (
	"fmt"

	"github.com/b7ea7098/loom/kernels"
)

func Example() {
	// Default() picks OpenBLAS or BLIS when installed; here the pure-Go
	// GEMM is forced so that the output does not depend on the machine.
	blas, err := kernels.Load(kernels.WithLibrary("go"))
	if err != nil {
		panic(err)
	}
	// C (2×2) = A (2×3) · B (3×2), row-major.
	a := []float32{1, 2, 3, 4, 5, 6}
	b := []float32{7, 8, 9, 10, 11, 12}
	c := make([]float32, 4)
	if err := blas.Sgemm(false, false, 2, 2, 3, 1, a, 3, b, 2, 0, c, 2); err != nil {
		panic(err)
	}
	fmt.Println(blas.Name(), c)
	// Output: pure-go [58 64 139 154]
}
