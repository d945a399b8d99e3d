package dense_test

import (
	"bytes"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/dense"
	"github.com/b7ea7098/loom/safetensors"
	"gorgonia.org/tensor"
)

// wantErr checks that err wraps dense.ErrInvalid and mentions want.
func wantErr(t *testing.T, err error, want string) {
	t.Helper()
	if !errors.Is(err, dense.ErrInvalid) || !strings.Contains(err.Error(), want) {
		t.Errorf("error %v, want ErrInvalid mentioning %q", err, want)
	}
}

// throughFile writes st to a safetensors file in memory and reads it back.
func throughFile(t *testing.T, st safetensors.Tensor) safetensors.Tensor {
	t.Helper()
	var buf bytes.Buffer
	if err := safetensors.Write(&buf, []safetensors.Tensor{st}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := safetensors.Read(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	rt, err := f.Tensor(st.Name)
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

func TestSafetensorRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		dense *tensor.Dense
		dt    safetensors.DType
		shape []int
	}{
		{"f32 matrix", tensor.New(tensor.WithShape(2, 3), tensor.WithBacking([]float32{1, 2, 3, 4, 5, 6})), safetensors.F32, []int{2, 3}},
		{"f64 3d", tensor.New(tensor.WithShape(2, 1, 2), tensor.WithBacking([]float64{1.5, -2, 3, 1e300})), safetensors.F64, []int{2, 1, 2}},
		{"f32 vector of one", tensor.New(tensor.WithShape(1), tensor.WithBacking([]float32{7})), safetensors.F32, []int{1}},
		{"f32 scalar", tensor.New(tensor.FromScalar(float32(2.5))), safetensors.F32, []int{}},
		{"f64 scalar", tensor.New(tensor.FromScalar(-0.25)), safetensors.F64, []int{}},
		{"i64", tensor.New(tensor.WithShape(3), tensor.WithBacking([]int64{-1, 0, 1 << 50})), safetensors.I64, []int{3}},
		{"i32", tensor.New(tensor.WithShape(2), tensor.WithBacking([]int32{-7, 9})), safetensors.I32, []int{2}},
		{"i16", tensor.New(tensor.WithShape(2), tensor.WithBacking([]int16{-7, 9})), safetensors.I16, []int{2}},
		{"i8", tensor.New(tensor.WithShape(2), tensor.WithBacking([]int8{-7, 9})), safetensors.I8, []int{2}},
		{"u8", tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]uint8{0, 1, 254, 255})), safetensors.U8, []int{2, 2}},
		{"u16", tensor.New(tensor.WithShape(2), tensor.WithBacking([]uint16{0, 65535})), safetensors.U16, []int{2}},
		{"u32", tensor.New(tensor.WithShape(2), tensor.WithBacking([]uint32{0, 1 << 31})), safetensors.U32, []int{2}},
		{"u64", tensor.New(tensor.WithShape(2), tensor.WithBacking([]uint64{0, 1 << 63})), safetensors.U64, []int{2}},
		{"bool", tensor.New(tensor.WithShape(3), tensor.WithBacking([]bool{true, false, true})), safetensors.BOOL, []int{3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			st, err := dense.ToSafetensor("p", tc.dense)
			if err != nil {
				t.Fatal(err)
			}
			if st.Name != "p" || st.DType != tc.dt || !slices.Equal(st.Shape, tc.shape) {
				t.Fatalf("ToSafetensor = %s %s %v, want %s %v", st.Name, st.DType, st.Shape, tc.dt, tc.shape)
			}
			if err := st.Validate(); err != nil {
				t.Fatal(err)
			}
			d, err := dense.FromSafetensor(throughFile(t, st))
			if err != nil {
				t.Fatal(err)
			}
			if d.Dtype() != tc.dense.Dtype() || !d.Shape().Eq(tc.dense.Shape()) {
				t.Fatalf("FromSafetensor = %v %v, want %v %v", d.Dtype(), d.Shape(), tc.dense.Dtype(), tc.dense.Shape())
			}
			if !tensorEqual(d, tc.dense) {
				t.Errorf("FromSafetensor data = %v, want %v", d.Data(), tc.dense.Data())
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
	case []int16:
		return slices.Equal(av, b.Data().([]int16))
	case []int8:
		return slices.Equal(av, b.Data().([]int8))
	case []uint8:
		return slices.Equal(av, b.Data().([]uint8))
	case []uint16:
		return slices.Equal(av, b.Data().([]uint16))
	case []uint32:
		return slices.Equal(av, b.Data().([]uint32))
	case []uint64:
		return slices.Equal(av, b.Data().([]uint64))
	case []bool:
		return slices.Equal(av, b.Data().([]bool))
	default:
		return a.Data() == b.Data()
	}
}

// The conversions copy: neither side aliases the other.
func TestSafetensorCopies(t *testing.T) {
	d := tensor.New(tensor.WithShape(2, 2), tensor.WithBacking([]float32{1, 2, 3, 4}))
	st, err := dense.ToSafetensor("w", d)
	if err != nil {
		t.Fatal(err)
	}
	if v, err := st.Float32s(); err != nil || !slices.Equal(v, []float32{1, 2, 3, 4}) {
		t.Errorf("values = %v, %v", v, err)
	}
	d.Data().([]float32)[0] = 100
	if v, err := st.Float32s(); err != nil || v[0] != 1 {
		t.Errorf("ToSafetensor aliases the Dense: %v, %v", v, err)
	}
	back, err := dense.FromSafetensor(st)
	if err != nil {
		t.Fatal(err)
	}
	st.Data[0] = 0xff
	if back.Data().([]float32)[0] != 1 {
		t.Errorf("FromSafetensor aliases the Tensor")
	}
}

// Views, transposes and slices are written in logical row-major order.
func TestSafetensorViews(t *testing.T) {
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
			st, err := dense.ToSafetensor("v", tc.d)
			if err != nil {
				t.Fatal(err)
			}
			v, err := st.Float32s()
			if err != nil || !slices.Equal(st.Shape, tc.shape) || !slices.Equal(v, tc.want) {
				t.Errorf("ToSafetensor = %v %v (%v), want %v %v", st.Shape, v, err, tc.shape, tc.want)
			}
		})
	}
}

func TestSafetensorErrors(t *testing.T) {
	_, err := dense.ToSafetensor("n", nil)
	wantErr(t, err, "nil *tensor.Dense")
	_, err = dense.ToSafetensor("c", tensor.New(tensor.WithShape(1), tensor.WithBacking([]complex64{1})))
	wantErr(t, err, "unsupported gorgonia dtype")
	// gorgonia builds an empty tensor, but its Data panics: refused first.
	_, err = dense.ToSafetensor("e", tensor.New(tensor.WithShape(0, 4), tensor.WithBacking([]float32{})))
	wantErr(t, err, "empty shape [0 4]")
	tests := []struct {
		t    safetensors.Tensor
		want string
	}{
		{safetensors.Tensor{Name: "z", DType: safetensors.F32, Shape: []int{0, 3}}, "empty shape [0 3]"},
		{safetensors.Tensor{Name: "n", DType: safetensors.F32, Shape: []int{0, -1}}, "negative dimension -1"},
		{safetensors.Tensor{Name: "h", DType: safetensors.F16, Shape: []int{1}, Data: []byte{0, 0x3c}}, "use t.Convert(safetensors.F32) first"},
		{safetensors.Tensor{Name: "b", DType: safetensors.BF16, Shape: []int{1}, Data: []byte{0, 0x3f}}, "no BF16 type"},
		{safetensors.Tensor{Name: "c", DType: safetensors.C64, Shape: []int{1}, Data: make([]byte, 8)}, "no C64 type"},
		{safetensors.Tensor{Name: "s", DType: safetensors.F32, Shape: []int{2}, Data: make([]byte, 4)}, "needs 8 data bytes"},
		{safetensors.Tensor{Name: "x", DType: "X9", Shape: []int{1}, Data: make([]byte, 4)}, "no X9 type"},
	}
	for _, tc := range tests {
		_, err := dense.FromSafetensor(tc.t)
		wantErr(t, err, tc.want)
	}
	// BF16 converted first works.
	c, err := safetensors.Tensor{Name: "b", DType: safetensors.BF16, Shape: []int{1}, Data: []byte{0x80, 0x3f}}.Convert(safetensors.F32)
	if err != nil {
		t.Fatal(err)
	}
	d, err := dense.FromSafetensor(c)
	if err != nil || d.Data().([]float32)[0] != 1 {
		t.Errorf("FromSafetensor(BF16 converted) = %v, %v", d, err)
	}
}

// FuzzSafetensor: every tensor FromSafetensor accepts comes back unchanged
// through ToSafetensor.
func FuzzSafetensor(f *testing.F) {
	f.Add(uint8(0), uint16(0x0203), []byte("abcdefghijklmnopqrstuvwx"))
	f.Add(uint8(5), uint16(0), []byte{1})
	f.Add(uint8(9), uint16(0x0101), []byte{1, 0})
	f.Fuzz(func(t *testing.T, dt uint8, dims uint16, data []byte) {
		all := safetensors.DTypes()
		st := safetensors.Tensor{Name: "t", DType: all[int(dt)%len(all)], Data: data}
		for i := range int(dims>>12) % 4 {
			st.Shape = append(st.Shape, int(dims>>(3*i))&7)
		}
		d, err := dense.FromSafetensor(st)
		if err != nil {
			if !errors.Is(err, dense.ErrInvalid) {
				t.Fatalf("FromSafetensor(%s %v, %d bytes): %v does not wrap ErrInvalid", st.DType, st.Shape, len(data), err)
			}
			return
		}
		back, err := dense.ToSafetensor("t", d)
		if err != nil {
			t.Fatalf("ToSafetensor(FromSafetensor(%s %v)): %v", st.DType, st.Shape, err)
		}
		want := data
		if st.DType == safetensors.BOOL { // any non-zero byte reads as true, written as 1
			want = make([]byte, len(data))
			for i, v := range data {
				if v != 0 {
					want[i] = 1
				}
			}
		}
		sameShape := slices.Equal(back.Shape, st.Shape) || len(st.Shape) == 0 && len(back.Shape) == 0
		if back.DType != st.DType || !sameShape || !bytes.Equal(back.Data, want) {
			t.Fatalf("%s %v %x came back as %s %v %x", st.DType, st.Shape, st.Data, back.DType, back.Shape, back.Data)
		}
	})
}
