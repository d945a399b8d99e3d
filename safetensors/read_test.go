package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
)

func TestReadValidationErrors(t *testing.T) {
	d8 := make([]byte, 8)
	tests := []struct {
		name   string
		file   []byte
		tensor string // tensor the error must name, if any
		want   string
	}{
		{"empty file", nil, "", "truncated file: 0 bytes"},
		{"short length field", []byte{1, 0, 0}, "", "truncated file: 3 bytes"},
		{"header too large", binary.LittleEndian.AppendUint64(nil, MaxHeaderSize+1), "", "header too large: 100000001 bytes"},
		{"huge header length", binary.LittleEndian.AppendUint64(nil, 1<<63), "", "header too large"},
		{"header past end", append(binary.LittleEndian.AppendUint64(nil, 10), `{}`...), "", "truncated file: header length 10 exceeds the 2 bytes"},
		{"empty header", binary.LittleEndian.AppendUint64(nil, 0), "", "empty header"},
		{"invalid UTF-8", rawFile("{\"a\xff\":1}", nil), "", "not valid UTF-8"},
		{"overlong UTF-8", rawFile("{\"\xc0\xaf\":1}", nil), "", "not valid UTF-8"},
		{"not an object", rawFile(`[1, 2]`, nil), "", "does not start with '{'"},
		{"leading space", rawFile(` {}`, nil), "", "does not start with '{'"},
		{"bad JSON", rawFile(`{"a":`, nil), "", "not a valid JSON object"},
		{"bad JSON token", rawFile(`{"a": tru}`, nil), "", "not a valid JSON object"},
		{"control char in string", rawFile("{\"a\x01\": {}}", nil), "", "not a valid JSON object"},
		{"trailing garbage", rawFile(`{} x`, nil), "", "unexpected data after the JSON object"},
		{"second object", rawFile(`{}{}`, nil), "", "unexpected data after the JSON object"},
		{"trailing NUL padding", rawFile("{}\x00\x00", nil), "", "unexpected data after the JSON object"},
		{"duplicate tensor", rawFile(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil), "a", "duplicate tensor name"},
		{"duplicate metadata key", rawFile(`{"__metadata__":{"k":"1","k":"2"}}`, nil), "", `duplicate metadata key "k"`},
		{"duplicate __metadata__", rawFile(`{"__metadata__":{},"__metadata__":{}}`, nil), "__metadata__", "duplicate"},
		{"metadata not object", rawFile(`{"__metadata__":"x"}`, nil), "", "__metadata__ must be an object of string values"},
		{"metadata number value", rawFile(`{"__metadata__":{"k":1}}`, nil), "", `value of "k" is not a string`},
		{"metadata nested value", rawFile(`{"__metadata__":{"k":{"x":"y"}}}`, nil), "", `value of "k" is not a string`},
		{"entry not object", rawFile(`{"a":[1]}`, nil), "a", "entry must be an object"},
		{"missing dtype", rawFile(`{"a":{"shape":[],"data_offsets":[0,0]}}`, nil), "a", "missing dtype"},
		{"missing shape", rawFile(`{"a":{"dtype":"U8","data_offsets":[0,0]}}`, nil), "a", "missing shape"},
		{"missing offsets", rawFile(`{"a":{"dtype":"U8","shape":[0]}}`, nil), "a", "missing data_offsets"},
		{"dtype wrong case", rawFile(`{"a":{"DTYPE":"U8","shape":[0],"data_offsets":[0,0]}}`, nil), "a", "missing dtype"},
		{"unknown dtype", rawFile(`{"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}}`, d8), "a", `unknown dtype "F17"`},
		{"sub-byte dtype", rawFile(`{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}`, d8[:1]), "a", `unknown dtype "F4"`},
		{"dtype not string", rawFile(`{"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}}`, d8), "a", "dtype 4 is not a string"},
		{"shape not array", rawFile(`{"a":{"dtype":"U8","shape":3,"data_offsets":[0,3]}}`, d8[:3]), "a", "shape 3: not an array"},
		{"shape null", rawFile(`{"a":{"dtype":"U8","shape":null,"data_offsets":[0,1]}}`, d8[:1]), "a", "shape null: not an array"},
		{"negative dim", rawFile(`{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}`, nil), "a", "non-negative integers"},
		{"fractional dim", rawFile(`{"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}`, d8[:1]), "a", "non-negative integers"},
		{"dim too large", rawFile(`{"a":{"dtype":"U8","shape":[0,18446744073709551615],"data_offsets":[0,0]}}`, nil), "a", "too large"},
		{"dim overflows uint64", rawFile(`{"a":{"dtype":"U8","shape":[99999999999999999999],"data_offsets":[0,0]}}`, nil), "a", "non-negative integers"},
		{"shape product overflow", rawFile(`{"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}}`, d8), "a", "too many elements"},
		{"offsets one element", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}}`, d8[:1]), "a", "has 1 elements, want 2"},
		{"offsets three elements", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,1]}}`, d8[:1]), "a", "has 3 elements, want 2"},
		{"negative offset", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}}`, d8[:1]), "a", "non-negative integers"},
		{"end before begin", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}}`, d8[:1]), "a", "end before begin"},
		{"out of bounds", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, d8[:4]), "a", "out of bounds: the data section has 4 bytes"},
		{"huge end", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}}`, nil), "a", "out of bounds"},
		{"size mismatch", rawFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, d8), "a", "F32 [3] needs 12 bytes but data_offsets [0, 8] span 8"},
		{"dtype size mismatch", rawFile(`{"a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]}}`, d8), "a", "F64 [2] needs 16 bytes"},
		{"scalar size mismatch", rawFile(`{"a":{"dtype":"F32","shape":[],"data_offsets":[0,8]}}`, d8), "a", "needs 4 bytes"},
		{"overlap", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, d8), "b", `overlap tensor "a", which ends at 8`},
		{"same range", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, d8), "b", "overlap"},
		{"empty inside other", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}}`, d8), "b", "overlap"},
		{"first not at 0", rawFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, d8), "a", "the first tensor begins at 4, not 0"},
		{"gap between", rawFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}`, d8[:6]), "b", `bytes [2, 4) after tensor "a" belong to no tensor`},
		{"uncovered tail", rawFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}`, d8[:5]), "", "data section has 5 bytes but the tensors cover only [0, 2)"},
		{"data but no tensors", rawFile(`{}`, d8), "", "data section has 8 bytes but the tensors cover only [0, 0)"},
		{"checksum not JSON", rawFile(`{"__metadata__":{"loom.sha256":"abc"}}`, nil), "", `metadata "loom.sha256" must be a JSON object`},
		{"checksum bad hex", rawFile(`{"__metadata__":{"loom.sha256":"{\"a\":\"zz\"}"},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil), "a", `checksum "zz" is not a hex SHA-256`},
		{"checksum short", rawFile(`{"__metadata__":{"loom.sha256":"{\"a\":\"abcd\"}"},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil), "a", "not a hex SHA-256"},
		{"checksum for missing tensor", rawFile(`{"__metadata__":{"loom.sha256":"{\"b\":\"`+sha256Hex(nil)+`\"}"}}`, nil), "b", "checksum listed for a tensor the file does not hold"},
		{"tensor without checksum", rawFile(`{"__metadata__":{"loom.sha256":"{}"},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`, nil), "a", `tensor has no checksum in "loom.sha256"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := readBytes(tc.file)
			if f != nil {
				t.Errorf("Read returned a File with the error")
			}
			wantErr(t, err, ErrFormat, tc.want)
			var e *Error
			if errors.As(err, &e) && e.Tensor != tc.tensor {
				t.Errorf("error names tensor %q, want %q", e.Tensor, tc.tensor)
			}
		})
	}
}

func TestReadAcceptsValidVariants(t *testing.T) {
	tests := []struct {
		name  string
		file  []byte
		names []string
		meta  map[string]string
	}{
		{"empty object", rawFile(`{}`, nil), nil, map[string]string{}},
		{"space padding", rawFile(`{}      `, nil), nil, map[string]string{}},
		{"whitespace padding", rawFile("{}\n\t\r ", nil), nil, map[string]string{}},
		{"inner whitespace", rawFile(`{ "a" : { "dtype" : "U8" , "shape" : [ 2 ] , "data_offsets" : [ 0 , 2 ] } }`, []byte{1, 2}), []string{"a"}, map[string]string{}},
		{"null metadata", rawFile(`{"__metadata__":null}`, nil), nil, map[string]string{}},
		{"metadata last", rawFile(`{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]},"__metadata__":{"x":"y"}}`, []byte{9}), []string{"a"}, map[string]string{"x": "y"}},
		{"unknown entry fields ignored", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[1,{}]}}`, []byte{9}), []string{"a"}, map[string]string{}},
		{"escaped names", rawFile(`{"\u00fc\n":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{9}), []string{"ü\n"}, map[string]string{}},
		{"raw non-ASCII names", rawFile(`{"日本":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{9}), []string{"日本"}, map[string]string{}},
		{"out of order offsets", rawFile(`{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}`, []byte{1, 2}), []string{"a", "b"}, map[string]string{}},
		{"zero-size tensors anywhere on boundaries", rawFile(`{"e":{"dtype":"F32","shape":[0,3],"data_offsets":[2,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"z":{"dtype":"I64","shape":[0],"data_offsets":[0,0]},"w":{"dtype":"BOOL","shape":[0],"data_offsets":[3,3]},"b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}`, []byte{1, 2, 3}), []string{"a", "b", "e", "w", "z"}, map[string]string{}},
		{"only zero-size", rawFile(`{"e":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}}`, nil), []string{"e"}, map[string]string{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := readBytes(tc.file)
			if err != nil {
				t.Fatal(err)
			}
			if got := f.Names(); !slices.Equal(got, tc.names) && !(len(got) == 0 && len(tc.names) == 0) {
				t.Errorf("Names() = %q, want %q", got, tc.names)
			}
			if got := f.Metadata(); len(got) != len(tc.meta) || got == nil {
				t.Errorf("Metadata() = %#v, want %v", got, tc.meta)
			} else {
				for k, v := range tc.meta {
					if got[k] != v {
						t.Errorf("Metadata()[%q] = %q, want %q", k, got[k], v)
					}
				}
			}
			if f.HasChecksums() {
				t.Errorf("HasChecksums() = true for a file without %q", ChecksumKey)
			}
			for _, n := range f.Names() {
				if _, err := f.Tensor(n); err != nil {
					t.Errorf("Tensor(%q): %v", n, err)
				}
			}
			if err := f.Verify(); err != nil {
				t.Errorf("Verify: %v", err)
			}
		})
	}
}

func TestReadOffsetsAndInfo(t *testing.T) {
	f, err := readBytes(rawFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]},"b":{"dtype":"I8","shape":[],"data_offsets":[0,1]}}`, []byte{0xff, 5, 6}))
	if err != nil {
		t.Fatal(err)
	}
	a, err := f.Tensor("a")
	if err != nil || !bytes.Equal(a.Data, []byte{5, 6}) || a.DType != U8 || !slices.Equal(a.Shape, []int{2}) {
		t.Errorf("a = %+v, %v", a, err)
	}
	b, _ := f.Tensor("b")
	if v, err := b.Int64s(); err != nil || !slices.Equal(v, []int64{-1}) {
		t.Errorf("b = %v, %v", v, err)
	}
	in, err := f.Info("a")
	if err != nil || in.Offset != 1 || in.Size != 2 || in.DType != U8 || !slices.Equal(in.Shape, []int{2}) {
		t.Errorf("Info(a) = %+v, %v", in, err)
	}
	in.Shape[0] = 99 // must not alias the File's state
	a2, _ := f.Tensor("a")
	if a2.Shape[0] != 2 {
		t.Errorf("Info shares its shape with the File")
	}
	_, err = f.Tensor("missing")
	wantErr(t, err, ErrNotFound, `tensor "missing"`)
	_, err = f.Info("missing")
	wantErr(t, err, ErrNotFound, "missing")
	names := f.Names()
	names[0] = "changed"
	if f.Names()[0] != "a" {
		t.Errorf("Names shares its slice with the File")
	}
}

// shortReader claims more bytes than it holds.
type shortReader struct{ b []byte }

func (r shortReader) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(r.b)) {
		return 0, io.EOF
	}
	n := copy(p, r.b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func TestReadTruncatedReader(t *testing.T) {
	b := encodeAll(t, []Tensor{FromFloat32s("a", []int{4}, []float32{1, 2, 3, 4})}, nil)
	for _, cut := range []int{4, 12, len(b) - 16, len(b) - 1} {
		_, err := Read(shortReader{b[:cut]}, int64(len(b)))
		wantErr(t, err, ErrFormat, "truncated file")
		if !errors.Is(err, io.ErrUnexpectedEOF) && cut >= 8 {
			t.Errorf("cut %d: error %q does not wrap io.ErrUnexpectedEOF", cut, err)
		}
		// A truncated byte slice stated at its true size is also caught.
		_, err = readBytes(b[:cut])
		wantErr(t, err, ErrFormat)
	}
}

func TestOpen(t *testing.T) {
	path := t.TempDir() + "/m.safetensors"
	if err := WriteFile(path, []Tensor{FromFloat64s("w", []int{2}, []float64{0.5, -1})}, nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	w, err := f.Tensor("w")
	if v, _ := w.Float64s(); err != nil || !slices.Equal(v, []float64{0.5, -1}) {
		t.Errorf("w = %v, %v", v, err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	_, err = f.Tensor("w")
	if err == nil {
		t.Errorf("Tensor after Close succeeded")
	}
	if _, err := Open(path + ".missing"); err == nil {
		t.Errorf("Open of a missing file succeeded")
	}
	bad := t.TempDir() + "/bad.safetensors"
	writeRaw(t, bad, rawFile(`{"a":1}`, nil))
	_, err = Open(bad)
	wantErr(t, err, ErrFormat, bad, `tensor "a"`)
	if !strings.HasPrefix(err.Error(), "safetensors: "+bad+": ") {
		t.Errorf("error %q does not start with the path", err)
	}
}
