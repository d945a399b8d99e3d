package safetensors

import (
	"encoding/binary"
	"math"
	"slices"
	"testing"
)

func u16s(v ...uint16) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], x)
	}
	return b
}

func sameFloats(a, b []float32) bool {
	return slices.EqualFunc(a, b, func(x, y float32) bool {
		return math.Float32bits(x) == math.Float32bits(y) || (x != x && y != y)
	})
}

func TestFloat32sFromHalfTypes(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	tests := []struct {
		name string
		dt   DType
		data []byte
		want []float32
	}{
		{"bf16 basics", BF16, u16s(0x3f80, 0xc000, 0x0000, 0x8000, 0x4049), []float32{1, -2, 0, float32(math.Copysign(0, -1)), 3.140625}},
		{"bf16 specials", BF16, u16s(0x7f80, 0xff80, 0x7fc0, 0x0001), []float32{inf, -inf, nan, math.Float32frombits(0x00010000)}},
		{"f16 basics", F16, u16s(0x3c00, 0xc000, 0x3555, 0x7bff), []float32{1, -2, 0.333251953125, 65504}},
		{"f16 subnormal", F16, u16s(0x0001, 0x03ff, 0x8001), []float32{0x1p-24, 1023 * 0x1p-24, -0x1p-24}},
		{"f16 specials", F16, u16s(0x7c00, 0xfc00, 0x7e00, 0x8000), []float32{inf, -inf, nan, float32(math.Copysign(0, -1))}},
		{"f64 rounds", F64, binary.LittleEndian.AppendUint64(nil, math.Float64bits(0.1)), []float32{0.1}},
		{"f32", F32, binary.LittleEndian.AppendUint32(nil, math.Float32bits(-1.5)), []float32{-1.5}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			size := tc.dt.Size()
			tt := Tensor{Name: "x", DType: tc.dt, Shape: []int{len(tc.data) / size}, Data: tc.data}
			got, err := tt.Float32s()
			if err != nil {
				t.Fatal(err)
			}
			if !sameFloats(got, tc.want) {
				t.Errorf("Float32s() = %v, want %v", got, tc.want)
			}
			g64, err := tt.Float64s()
			if err != nil {
				t.Fatal(err)
			}
			for i := range g64 {
				w := float64(tc.want[i])
				if tc.dt == F64 {
					w = 0.1
				}
				if g64[i] != w && !(w != w && g64[i] != g64[i]) {
					t.Errorf("Float64s()[%d] = %v, want %v", i, g64[i], w)
				}
			}
		})
	}
}

func TestInt64s(t *testing.T) {
	tests := []struct {
		dt   DType
		data []byte
		want []int64
	}{
		{I8, []byte{0xff, 0x7f}, []int64{-1, 127}},
		{U8, []byte{0xff, 0x7f}, []int64{255, 127}},
		{BOOL, []byte{1, 0}, []int64{1, 0}},
		{I16, u16s(0xffff, 0x8000), []int64{-1, -32768}},
		{U16, u16s(0xffff, 0x8000), []int64{65535, 32768}},
		{I32, binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, 0xffffffff), 7), []int64{-1, 7}},
		{U32, binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, 0xffffffff), 7), []int64{4294967295, 7}},
		{I64, binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, 1<<63), 7), []int64{math.MinInt64, 7}},
		{U64, binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(nil, math.MaxInt64), 7), []int64{math.MaxInt64, 7}},
	}
	for _, tc := range tests {
		got, err := Tensor{DType: tc.dt, Shape: []int{2}, Data: tc.data}.Int64s()
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("%s: Int64s() = %v, %v; want %v", tc.dt, got, err, tc.want)
		}
	}
	_, err := Tensor{Name: "u", DType: U64, Shape: []int{}, Data: binary.LittleEndian.AppendUint64(nil, 1<<63)}.Int64s()
	wantErr(t, err, ErrInvalid, "overflows int64")
}

func TestDecodeErrors(t *testing.T) {
	tests := []struct {
		name string
		t    Tensor
		call func(Tensor) error
		want string
	}{
		{"Float32s of I64", FromInt64s("x", []int{1}, []int64{1}), func(t Tensor) error { _, err := t.Float32s(); return err }, "cannot decode I64 as float32"},
		{"Float64s of U8", Tensor{Name: "x", DType: U8, Shape: []int{1}, Data: []byte{1}}, func(t Tensor) error { _, err := t.Float64s(); return err }, "cannot decode U8 as float64"},
		{"Float64s of F64 short", Tensor{Name: "x", DType: F64, Shape: []int{2}, Data: make([]byte, 8)}, func(t Tensor) error { _, err := t.Float64s(); return err }, "needs 16 data bytes"},
		{"Float64s of BF16 short", Tensor{Name: "x", DType: BF16, Shape: []int{2}, Data: make([]byte, 3)}, func(t Tensor) error { _, err := t.Float64s(); return err }, "needs 4 data bytes"},
		{"Int64s of F32", FromFloat32s("x", []int{1}, []float32{1}), func(t Tensor) error { _, err := t.Int64s(); return err }, "cannot decode F32 as int64"},
		{"Int64s of C64", Tensor{Name: "x", DType: C64, Shape: []int{}, Data: make([]byte, 8)}, func(t Tensor) error { _, err := t.Int64s(); return err }, "cannot decode C64 as int64"},
		{"Float32s short", Tensor{Name: "x", DType: F32, Shape: []int{3}, Data: make([]byte, 11)}, func(t Tensor) error { _, err := t.Float32s(); return err }, "needs 12 data bytes, have 11"},
		{"Float32s unknown dtype", Tensor{Name: "x", DType: "Q", Shape: []int{}, Data: nil}, func(t Tensor) error { _, err := t.Float32s(); return err }, `unknown dtype "Q"`},
		{"Int64s negative dim", Tensor{Name: "x", DType: I64, Shape: []int{-2}}, func(t Tensor) error { _, err := t.Int64s(); return err }, "negative dimension"},
		{"Convert to I32", FromFloat32s("x", []int{1}, []float32{1}), func(t Tensor) error { _, err := t.Convert(I32); return err }, "cannot convert to I32"},
		{"Convert from I64", FromInt64s("x", []int{1}, []int64{1}), func(t Tensor) error { _, err := t.Convert(F32); return err }, "cannot decode I64 as float32"},
		{"Convert from I64 to F64", FromInt64s("x", []int{1}, []int64{1}), func(t Tensor) error { _, err := t.Convert(F64); return err }, "cannot decode I64 as float64"},
		{"Convert same dtype short", Tensor{Name: "x", DType: F16, Shape: []int{1}}, func(t Tensor) error { _, err := t.Convert(F16); return err }, "needs 2 data bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			wantErr(t, tc.call(tc.t), ErrInvalid, tc.want, `tensor "x"`)
		})
	}
}

func TestConvert(t *testing.T) {
	src := []float32{1, -2.5, 0.1, 65520, 1e-8, float32(math.Inf(-1))}
	f32 := FromFloat32s("w", []int{2, 3}, src)
	tests := []struct {
		to   DType
		want []float32
	}{
		{F32, src},
		{F64, src},
		// bf16: 0.1 -> 0x3dcd, 65520 -> 0x4780 (65536), 1e-8 -> 0x322c
		{BF16, []float32{1, -2.5, math.Float32frombits(0x3dcd0000), 65536, math.Float32frombits(0x322c0000), float32(math.Inf(-1))}},
		// f16: 0.1 -> 0x2e66, 65520 overflows, 1e-8 underflows to 0
		{F16, []float32{1, -2.5, 0.0999755859375, float32(math.Inf(1)), 0, float32(math.Inf(-1))}},
	}
	for _, tc := range tests {
		c, err := f32.Convert(tc.to)
		if err != nil {
			t.Fatalf("Convert(%s): %v", tc.to, err)
		}
		if c.DType != tc.to || c.Name != "w" || !slices.Equal(c.Shape, []int{2, 3}) || len(c.Data) != 6*tc.to.Size() {
			t.Errorf("Convert(%s) = %s %v with %d bytes", tc.to, c.DType, c.Shape, len(c.Data))
		}
		got, err := c.Float32s()
		if err != nil || !sameFloats(got, tc.want) {
			t.Errorf("Convert(%s) values = %v, %v; want %v", tc.to, got, err, tc.want)
		}
		back, err := c.Convert(F32)
		if err != nil {
			t.Fatal(err)
		}
		if bv, _ := back.Float32s(); !sameFloats(bv, tc.want) {
			t.Errorf("Convert(%s).Convert(F32) = %v", tc.to, bv)
		}
	}
	// Converting copies: changing the result leaves the source alone.
	c, _ := f32.Convert(F32)
	c.Data[0] ^= 0xff
	c.Shape[0] = 7
	if v, _ := f32.Float32s(); v[0] != 1 || f32.Shape[0] != 2 {
		t.Errorf("Convert aliases its source")
	}
	// F64 -> F16 and zero-size.
	h, err := FromFloat64s("d", []int{2}, []float64{0.5, 3}).Convert(F16)
	if err != nil || !slices.Equal(h.Data, u16s(0x3800, 0x4200)) {
		t.Errorf("F64->F16 = %x, %v", h.Data, err)
	}
	z, err := Tensor{Name: "z", DType: BF16, Shape: []int{0, 4}}.Convert(F64)
	if err != nil || len(z.Data) != 0 || z.Data == nil {
		t.Errorf("zero-size convert = %+v, %v", z, err)
	}
}

func TestConstructorsCopy(t *testing.T) {
	v := []float32{1, 2}
	shape := []int{2}
	tt := FromFloat32s("a", shape, v)
	v[0], shape[0] = 9, 9
	if got, _ := tt.Float32s(); !slices.Equal(got, []float32{1, 2}) || tt.Shape[0] != 2 {
		t.Errorf("FromFloat32s aliases its input: %v %v", got, tt.Shape)
	}
	i := FromInt64s("i", []int{2}, []int64{-3, 1 << 40})
	if i.DType != I64 {
		t.Errorf("FromInt64s dtype = %s", i.DType)
	}
	if got, err := i.Int64s(); err != nil || !slices.Equal(got, []int64{-3, 1 << 40}) {
		t.Errorf("FromInt64s round trip = %v, %v", got, err)
	}
	f := FromFloat64s("f", nil, []float64{math.Pi})
	if f.DType != F64 || f.Validate() != nil {
		t.Errorf("FromFloat64s scalar: %s, %v", f.DType, f.Validate())
	}
	if got, _ := f.Float64s(); got[0] != math.Pi {
		t.Errorf("FromFloat64s value = %v", got)
	}
}
