package safetensors

import (
	"slices"
	"testing"

	"gorgonia.org/tensor"
)

func TestDenseRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		dense *tensor.Dense
		dt    DType
		shape []int
	}{
		{"f32 matrix", tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]float32{1, 2, 3, 4, 5, 6})), F32, []int{2, 3}},
		{"f64 3d", tensor.New(tensor.WithShape(2, 1, 2), tensor.WithBacking([]float64{1.5, -2, 3, 1e300})), F64, []int{2, 1, 2}},
		{"f32 vector of one", tensor.New(tensor.WithShape(1), tensor.WithBacking([]float32{7})), F32, []int{1}},
		{"f32 scalar", tensor.New(tensor.FromScalar(float32(2.5))), F32, []int{}},
		{"f64 scalar", tensor.New(tensor.FromScalar(-0.25)), F64, []int{}},
		{"i64", tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{-1, 0, 1 << 50})), I64, []int{3}},
		{"i32", tensor.New(tensor.WithShape(2), tensor.WithBacking([]int32{-7, 9})), I32, []int{2}},
		{"u8", tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]uint8{0, 1, 254, 255})), U8, []int{2, 2}},
		{"bool", tensor.New(tensor.WithShape(3), tensor.WithBacking([]bool{true, false, true})), BOOL, []int{3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st, err := FromDense("p", tc.dense)
			if err != nil {
				t.Fatal(err)
			}
			if st.Name != "p" || st.DType != tc.dt || !slices.Equal(st.Shape, tc.shape) {
				t.Fatalf("FromDense = %s %s %v, want %s %v", st.Name, st.DType, st.Shape, tc.dt, tc.shape)
			}
			if err := st.Validate(); err != nil {
				t.Fatal(err)
			}
			// Through a file and back.
			f, err := readBytes(encodeAll(t, []Tensor{st}, nil))
			if err != nil {
				t.Fatal(err)
			}
			rt, err := f.Tensor("p")
			if err != nil {
				t.Fatal(err)
			}
			d, err := ToDense(rt)
			if err != nil {
				t.Fatal(err)
			}
			if d.Dtype() != tc.dense.Dtype() || !d.Shape().Eq(tc.dense.Shape()) {
				t.Fatalf("ToDense = %v %v, want %v %v", d.Dtype(), d.Shape(), tc.dense.Dtype(), tc.dense.Shape())
			}
			if !tensorEqual(d, tc.dense) {
				t.Errorf("ToDense data = %v, want %v", d.Data(), tc.dense.Data())
			}
		})
	}
}

func tensorEqual(a, b *tensor.Dense) bool {
	switch av := a.Data().(type) {
	case []float32:
		return slices.Equal(av, b.Data().([]float32))
	case []float64:
		return slices.Equal(av, b.Data().([]float64))
	case []int64:
		return slices.Equal(av, b.Data().([]int64))
	case []int32:
		return slices.Equal(av, b.Data().([]int32))
	case []uint8:
		return slices.Equal(av, b.Data().([]uint8))
	case []bool:
		return slices.Equal(av, b.Data().([]bool))
	default:
		return a.Data() == b.Data()
	}
}

func TestFromDenseValues(t *testing.T) {
	d := tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]float32{1, 2, 3, 4}))
	st, err := FromDense("w", d)
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := st.Float32s(); !slices.Equal(v, []float32{1, 2, 3, 4}) {
		t.Errorf("values = %v", v)
	}
	// The Tensor owns its bytes; the Dense owns its slice.
	d.Data().([]float32)[0] = 100
	if v, _ := st.Float32s(); v[0] != 1 {
		t.Errorf("FromDense aliases the Dense")
	}
	back, _ := ToDense(st)
	st.Data[0] = 0xff
	if back.Data().([]float32)[0] != 1 {
		t.Errorf("ToDense aliases the Tensor")
	}
}

func TestFromDenseViews(t *testing.T) {
	base := tensor.New(tensor.WithShape(3, 4), tensor.WithBacking([]float32{
		0, 1, 2, 3,
		4, 5, 6, 7,
		8, 9, 10, 11,
	}))
	tr := base.Clone().(*tensor.Dense)
	if err := tr.T(); err != nil { // lazy transpose: only the strides change
		t.Fatal(err)
	}
	rows, err := base.Slice(tensor.S(1, 3))
	if err != nil {
		t.Fatal(err)
	}
	cols, err := base.Slice(nil, tensor.S(1, 3))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		d     *tensor.Dense
		shape []int
		want  []float32
	}{
		{"lazy transpose", tr, []int{4, 3}, []float32{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}},
		{"row slice", rows.(*tensor.Dense), []int{2, 4}, []float32{4, 5, 6, 7, 8, 9, 10, 11}},
		{"column slice", cols.(*tensor.Dense), []int{3, 2}, []float32{1, 2, 5, 6, 9, 10}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st, err := FromDense("v", tc.d)
			if err != nil {
				t.Fatal(err)
			}
			v, err := st.Float32s()
			if err != nil || !slices.Equal(st.Shape, tc.shape) || !slices.Equal(v, tc.want) {
				t.Errorf("FromDense = %v %v (%v), want %v %v", st.Shape, v, err, tc.shape, tc.want)
			}
		})
	}
}

func TestDenseErrors(t *testing.T) {
	_, err := FromDense("n", nil)
	wantErr(t, err, ErrInvalid, "nil *tensor.Dense")
	_, err = FromDense("c", tensor.New(tensor.WithShape(1), tensor.WithBacking([]complex64{1})))
	wantErr(t, err, ErrInvalid, "unsupported gorgonia dtype")
	tests := []struct {
		t    Tensor
		want string
	}{
		{Tensor{Name: "z", DType: F32, Shape: []int{0, 3}}, "empty shape [0 3]"},
		{Tensor{Name: "h", DType: F16, Shape: []int{1}, Data: []byte{0, 0x3c}}, "use t.Convert(F32) first"},
		{Tensor{Name: "b", DType: BF16, Shape: []int{1}, Data: []byte{0, 0x3f}}, "no BF16 type"},
		{Tensor{Name: "c", DType: C64, Shape: []int{1}, Data: make([]byte, 8)}, "no C64 type"},
		{Tensor{Name: "s", DType: F32, Shape: []int{2}, Data: make([]byte, 4)}, "needs 8 data bytes"},
	}
	for _, tc := range tests {
		_, err := ToDense(tc.t)
		wantErr(t, err, ErrInvalid, tc.want)
	}
	// BF16 converted first works.
	c, _ := Tensor{Name: "b", DType: BF16, Shape: []int{1}, Data: []byte{0x80, 0x3f}}.Convert(F32)
	d, err := ToDense(c)
	if err != nil || d.Data().([]float32)[0] != 1 {
		t.Errorf("ToDense(BF16 converted) = %v, %v", d, err)
	}
}
