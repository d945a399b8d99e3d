package dense_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/dense"
	"gorgonia.org/tensor"
)

// TestToBuffer: a buffer wraps the tensor's memory; what has no comm
// layout is an ErrInvalid error.
func TestToBuffer(t *testing.T) {
	tests := []struct {
		name string
		d    *tensor.Dense
		dt   comm.DType
		n    int
	}{
		{"float32", tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]float32{0, 1, 2, 3, 4, 5})), comm.Float32, 6},
		{"float64", tensor.New(tensor.WithShape(4), tensor.WithBacking([]float64{0, 1, 2, 3})), comm.Float64, 4},
		{"int32", tensor.New(tensor.Of(tensor.Int32), tensor.WithShape(2, 2)), comm.Int32, 4},
		{"int64", tensor.New(tensor.Of(tensor.Int64), tensor.WithShape(5)), comm.Int64, 5},
		{"uint8", tensor.New(tensor.Of(tensor.Uint8), tensor.WithShape(3, 1)), comm.Uint8, 3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := dense.ToBuffer(tc.d)
			if err != nil {
				t.Fatal(err)
			}
			if b.DType() != tc.dt || b.Len() != tc.n {
				t.Fatalf("DType=%v Len=%d, want %v %d", b.DType(), b.Len(), tc.dt, tc.n)
			}
			// No copy: a byte written through the buffer shows in the tensor.
			b.Bytes()[0] = 1
			if v := fmt.Sprint(tc.d.Get(0)); v == "0" {
				t.Errorf("write through the buffer not seen in the tensor (element 0 = %s)", v)
			}
		})
	}
	d := tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]float32{0, 1, 2, 3, 4, 5}))
	row, err := d.Slice(tensor.S(1))
	if err != nil {
		t.Fatal(err)
	}
	b, err := dense.ToBuffer(row.(*tensor.Dense))
	if err != nil {
		t.Fatalf("contiguous row view: %v", err)
	}
	if got := b.Float32s(); fmt.Sprint(got) != "[3 4 5]" {
		t.Errorf("row view wraps %v, want [3 4 5]", got)
	}

	col, err := d.Slice(nil, tensor.S(1))
	if err != nil {
		t.Fatal(err)
	}
	transposed := d.Clone().(*tensor.Dense)
	if err := transposed.T(); err != nil {
		t.Fatal(err)
	}
	type errCase struct {
		name string
		d    *tensor.Dense
		want string
	}
	errs := []errCase{
		{"nil", nil, "nil *tensor.Dense"},
		{"scalar", tensor.New(tensor.FromScalar(float32(3))), "scalar"},
		{"empty", tensor.New(tensor.WithShape(0, 2), tensor.WithBacking([]float32{})), "empty shape [0 2]"},
		{"column view", col.(*tensor.Dense), "non-contiguous"},
		{"transposed", transposed, "transposed"},
	}
	for _, dt := range []tensor.Dtype{tensor.Int, tensor.Uint, tensor.Int8, tensor.Int16, tensor.Uint16, tensor.Uint32,
		tensor.Uint64, tensor.Bool, tensor.Complex64, tensor.Complex128, tensor.String} {
		errs = append(errs, errCase{dt.String(), tensor.New(tensor.Of(dt), tensor.WithShape(3)), "tensor dtype " + dt.String() + " has no comm dtype"})
	}
	for _, tc := range errs {
		t.Run(tc.name, func(t *testing.T) {
			b, err := dense.ToBuffer(tc.d)
			if b != nil || !errors.Is(err, dense.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("ToBuffer = %v, %v; want ErrInvalid containing %q", b, err, tc.want)
			}
		})
	}
}
