package kernels

import (
	"errors"
	"testing"

	"github.com/b7ea7098/loom"
)

// TestErrInvalid: every kind of argument check (lengths, sizes, indices,
// nil receivers and routings, GEMM strides) wraps ErrInvalid, which
// matches loom.ErrInvalid, and names the kernel.
func TestErrInvalid(t *testing.T) {
	var nilBLAS *BLAS
	goBLAS, err := Load(WithLibrary("go"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		err  error
	}{
		{"Add lengths", Add(make([]float32, 2), make([]float32, 3), make([]float32, 2))},
		{"AdamW nil coefficients", AdamW(make([]float32, 1), make([]float32, 1), make([]float32, 1), make([]float32, 1), nil)},
		{"SoftmaxRows ragged", SoftmaxRows(Workers(0), make([]float32, 5), make([]float32, 5), 2)},
		{"LayerNorm eps", LayerNorm(make([]float32, 2), nil, nil, make([]float32, 2), nil, nil, 2, -1)},
		{"CausalSoftmax size", CausalSoftmax(Workers(0), nil, nil, -1, 1)},
		{"PlanRouting expert", PlanRouting(new(Routing), []int32{0, 9}, 1, 4, 0)},
		{"PlanRouting nil", PlanRouting[int32](nil, nil, 1, 4, 0)},
		{"Sgemm nil", nilBLAS.Sgemm(false, false, 1, 1, 1, 1, nil, 1, nil, 1, 0, nil, 1)},
		{"Sgemm lda", goBLAS.Sgemm(false, false, 2, 2, 2, 1, make([]float32, 4), 1, make([]float32, 4), 2, 0, make([]float32, 4), 2)},
	} {
		if !errors.Is(c.err, ErrInvalid) || !errors.Is(c.err, loom.ErrInvalid) {
			t.Errorf("%s: %v, want an error wrapping ErrInvalid", c.name, c.err)
		}
	}
	if _, err := ExpertBounds(4, 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("ExpertBounds over 0 ranks: %v, want ErrInvalid", err)
	}
}
