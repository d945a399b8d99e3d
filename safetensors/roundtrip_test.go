package safetensors

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"
)

func TestDTypeSizes(t *testing.T) {
	tests := []struct {
		dt   DType
		size int
	}{
		{BOOL, 1}, {U8, 1}, {I8, 1}, {F8E5M2, 1}, {F8E4M3, 1}, {F8E8M0, 1},
		{I16, 2}, {U16, 2}, {F16, 2}, {BF16, 2},
		{I32, 4}, {U32, 4}, {F32, 4},
		{C64, 8}, {F64, 8}, {I64, 8}, {U64, 8},
		{"F4", 0}, {"f32", 0}, {"", 0}, {"FLOAT", 0},
	}
	for _, tc := range tests {
		if got := tc.dt.Size(); got != tc.size {
			t.Errorf("%q.Size() = %d, want %d", tc.dt, got, tc.size)
		}
		if got := tc.dt.Valid(); got != (tc.size > 0) {
			t.Errorf("%q.Valid() = %v", tc.dt, got)
		}
	}
	if got := len(DTypes()); got != 17 {
		t.Errorf("DTypes() has %d entries, want 17", got)
	}
	for _, dt := range DTypes() {
		if !dt.Valid() || dt.String() != string(dt) {
			t.Errorf("DTypes() lists %q, which is not valid", dt)
		}
	}
}

func TestRoundTripEveryDTypeAndShape(t *testing.T) {
	shapes := [][]int{nil, {}, {0}, {1}, {5}, {2, 3}, {2, 0, 4}, {1, 1, 1, 1}, {3, 1, 2}}
	for _, dt := range DTypes() {
		for si, shape := range shapes {
			t.Run(fmt.Sprintf("%s/%v", dt, shape), func(t *testing.T) {
				n, err := byteSize(dt, shape)
				if err != nil {
					t.Fatal(err)
				}
				in := []Tensor{
					{Name: "t", DType: dt, Shape: shape, Data: filler(n, byte(si))},
					{Name: "other", DType: U8, Shape: []int{3}, Data: []byte{1, 2, 3}},
				}
				b := encodeAll(t, in, map[string]string{"k": "v"})
				if hl := binary.LittleEndian.Uint64(b); (8+hl)%8 != 0 || int(8+hl)+n+3 != len(b) {
					t.Errorf("header length %d, file length %d: data section not 8-aligned or wrong size", hl, len(b))
				}
				f, err := readBytes(b)
				if err != nil {
					t.Fatalf("Read: %v", err)
				}
				if got := f.Names(); !slices.Equal(got, []string{"other", "t"}) {
					t.Errorf("Names() = %q", got)
				}
				got, err := f.Tensor("t")
				if err != nil {
					t.Fatal(err)
				}
				wantShape := shape
				if wantShape == nil {
					wantShape = []int{}
				}
				if got.Name != "t" || got.DType != dt || !slices.Equal(got.Shape, wantShape) || !bytes.Equal(got.Data, in[0].Data) {
					t.Errorf("got %s %v %v %x, want %s %v %x", got.Name, got.DType, got.Shape, got.Data, dt, wantShape, in[0].Data)
				}
				if err := f.Verify(); err != nil {
					t.Errorf("Verify: %v", err)
				}
				if f.Metadata()["k"] != "v" {
					t.Errorf("Metadata() = %v", f.Metadata())
				}
			})
		}
	}
}

func TestRoundTripNamesAndMetadata(t *testing.T) {
	names := []string{"ünïcödé.weight", "with space", `quote"and\backslash`, "tab\tnewline\n", "ctl\x01", "日本", "a/b:c", "__metadata", "z"}
	var in []Tensor
	for i, n := range names {
		in = append(in, FromFloat32s(n, []int{2}, []float32{float32(i), -float32(i)}))
	}
	meta := map[string]string{"": "empty key", "json": `{"a": [1, 2]}`, "ü": "ß\n<&>"}
	f, err := readBytes(encodeAll(t, in, meta))
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Clone(names)
	slices.Sort(want)
	if got := f.Names(); !slices.Equal(got, want) {
		t.Errorf("Names() = %q, want %q", got, want)
	}
	for i, n := range names {
		tt, err := f.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		v, err := tt.Float32s()
		if err != nil || !slices.Equal(v, []float32{float32(i), -float32(i)}) {
			t.Errorf("%q = %v, %v", n, v, err)
		}
	}
	got := f.Metadata()
	for k, v := range meta {
		if got[k] != v {
			t.Errorf("metadata[%q] = %q, want %q", k, got[k], v)
		}
	}
	if _, ok := got[ChecksumKey]; !ok || len(got) != len(meta)+1 {
		t.Errorf("metadata = %q, want the input plus %q", got, ChecksumKey)
	}
}

func TestRoundTripRewriteOfReadMetadata(t *testing.T) {
	// Reading a file and writing its metadata back must work: the stale
	// checksum entry is replaced, not trusted.
	a := FromFloat32s("a", []int{1}, []float32{1})
	f, err := readBytes(encodeAll(t, []Tensor{a}, map[string]string{"step": "3"}))
	if err != nil {
		t.Fatal(err)
	}
	b := FromFloat32s("b", []int{1}, []float32{2})
	g, err := readBytes(encodeAll(t, []Tensor{a, b}, f.Metadata()))
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Verify(); err != nil {
		t.Fatal(err)
	}
	if g.Metadata()["step"] != "3" {
		t.Errorf("metadata lost: %v", g.Metadata())
	}
}

func TestWriteByteExact(t *testing.T) {
	a := Tensor{Name: "a", DType: I64, Shape: []int{}, Data: []byte{7, 0, 0, 0, 0, 0, 0, 0}}
	b := Tensor{Name: "b", DType: F32, Shape: []int{2}, Data: []byte{0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0}}
	e := Tensor{Name: "e", DType: U8, Shape: []int{0}}
	// Hand-built: tensors in name order, compact JSON, metadata first with
	// sorted keys, padded with spaces to a multiple of 8.
	sum := func(x []byte) string {
		h := sha256Hex(x)
		return h
	}
	header := `{"__metadata__":{"format":"pt","loom.sha256":"{\"a\":\"` + sum(a.Data) +
		`\",\"b\":\"` + sum(b.Data) + `\",\"e\":\"` + sum(nil) + `\"}"},` +
		`"a":{"dtype":"I64","shape":[],"data_offsets":[0,8]},` +
		`"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},` +
		`"e":{"dtype":"U8","shape":[0],"data_offsets":[16,16]}}`
	for len(header)%8 != 0 {
		header += " "
	}
	want := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	want = append(want, header...)
	want = append(want, a.Data...)
	want = append(want, b.Data...)

	got := encodeAll(t, []Tensor{e, b, a}, map[string]string{"format": "pt"})
	if !bytes.Equal(got, want) {
		t.Errorf("Write produced\n%q\nwant\n%q", got, want)
	}
	// And the hand-built file reads back.
	f, err := readBytes(want)
	if err != nil {
		t.Fatal(err)
	}
	v, err := f.Tensor("b")
	if err != nil {
		t.Fatal(err)
	}
	if fl, _ := v.Float32s(); !slices.Equal(fl, []float32{1, -2}) {
		t.Errorf("b = %v", fl)
	}
	x, _ := f.Tensor("a")
	if iv, _ := x.Int64s(); !slices.Equal(iv, []int64{7}) {
		t.Errorf("a = %v", iv)
	}
}

func TestWriteEmpty(t *testing.T) {
	b := encodeAll(t, nil, nil)
	header := `{"__metadata__":{"loom.sha256":"{}"}}`
	for len(header)%8 != 0 {
		header += " "
	}
	if want := rawFile(header, nil); !bytes.Equal(b, want) {
		t.Errorf("got %q, want %q", b, want)
	}
	f, err := readBytes(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Names()) != 0 || !f.HasChecksums() {
		t.Errorf("Names() = %q, HasChecksums() = %v", f.Names(), f.HasChecksums())
	}
}

func TestWriteRejectsInvalidInput(t *testing.T) {
	ok := FromFloat32s("ok", []int{1}, []float32{1})
	tests := []struct {
		name    string
		tensors []Tensor
		meta    map[string]string
		want    string
	}{
		{"empty name", []Tensor{{DType: F32, Shape: []int{}, Data: make([]byte, 4)}}, nil, "empty tensor name"},
		{"reserved name", []Tensor{{Name: "__metadata__", DType: U8, Shape: []int{0}}}, nil, "reserved"},
		{"invalid UTF-8 name", []Tensor{{Name: "a\xff", DType: U8, Shape: []int{0}}}, nil, "UTF-8"},
		{"duplicate", []Tensor{ok, ok}, nil, "duplicate tensor name"},
		{"unknown dtype", []Tensor{{Name: "x", DType: "F4", Shape: []int{2}, Data: []byte{1}}}, nil, `unknown dtype "F4"`},
		{"negative dim", []Tensor{{Name: "x", DType: U8, Shape: []int{-1}}}, nil, "negative dimension"},
		{"short data", []Tensor{{Name: "x", DType: F32, Shape: []int{2, 2}, Data: make([]byte, 12)}}, nil, "needs 16 data bytes, have 12"},
		{"long data", []Tensor{{Name: "x", DType: BF16, Shape: []int{}, Data: make([]byte, 4)}}, nil, "needs 2 data bytes, have 4"},
		{"overflow", []Tensor{{Name: "x", DType: F64, Shape: []int{1 << 40, 1 << 40}}}, nil, "too many elements"},
		{"float list mismatch", []Tensor{FromFloat32s("x", []int{3}, []float32{1, 2})}, nil, "needs 12 data bytes, have 8"},
		{"invalid UTF-8 metadata", []Tensor{ok}, map[string]string{"k": "\xc3"}, "not valid UTF-8"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			err := Write(&buf, tc.tensors, tc.meta)
			wantErr(t, err, ErrInvalid, tc.want)
			if buf.Len() != 0 {
				t.Errorf("Write wrote %d bytes before failing", buf.Len())
			}
		})
	}
}

type failWriter struct{ n int }

func (w *failWriter) Write(p []byte) (int, error) {
	if len(p) > w.n {
		return w.n, fmt.Errorf("disk full")
	}
	w.n -= len(p)
	return len(p), nil
}

func TestWritePropagatesWriterErrors(t *testing.T) {
	in := []Tensor{FromFloat32s("a", []int{4}, []float32{1, 2, 3, 4})}
	full := len(encodeAll(t, in, nil))
	for _, n := range []int{0, 4, 8, 20, full - 1} {
		if err := Write(&failWriter{n: n}, in, nil); err == nil {
			t.Errorf("writer failing after %d bytes: Write returned nil", n)
		}
	}
	if err := Write(&failWriter{n: full}, in, nil); err != nil {
		t.Errorf("writer with room for %d bytes: %v", full, err)
	}
}
