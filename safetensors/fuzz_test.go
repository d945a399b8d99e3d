package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"slices"
	"testing"
)

// FuzzRead feeds arbitrary bytes to Read. It must never panic, never
// allocate more than a small multiple of the input, and fail only with
// errors wrapping ErrFormat; whatever it accepts must read back tensor by
// tensor and survive a Write/Read round trip unchanged.
func FuzzRead(f *testing.F) {
	entry := `{"dtype":"U8","shape":[0],"data_offsets":[0,0]}`
	f.Add(rawFile(`{"":`+entry+`}`, nil))
	f.Add(rawFile(`{"\ud800":`+entry+`}`, nil))
	f.Add(rawFile(`{"\ud83d\ude00":`+entry+`,"__metadata__":{"\u00fc":"\ud83d\ude00"}}`, nil))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":[[[{"y":[true,false,null,-1.5e+3]}]]]}}`, nil))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"dtype":"U8"}}`, nil))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[01],"data_offsets":[0,1]}}`, []byte{1}))
	f.Add(append(binary.LittleEndian.AppendUint64(nil, 94_000_000), "{}"...))
	f.Add(encodeAll(f, checkpoint(), map[string]string{"k": "v"}))
	f.Add(encodeAll(f, []Tensor{{Name: "e", DType: BF16, Shape: []int{0, 2}}, FromFloat32s("s", nil, []float32{1})}, nil))
	f.Add(rawFile(`{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"__metadata__":{"x":"y"}}`, []byte{0, 0x3c, 0, 0xc0}))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}))
	f.Add(rawFile(`{"__metadata__":{"loom.sha256":"{\"a\":\"00\"}"}}`, nil))
	f.Add(rawFile(`{}  `, nil))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		var file *File
		var err error
		if alloc, limit := allocated(func() { file, err = readBytes(b) }), 16*uint64(len(b))+256<<10; alloc > limit {
			t.Fatalf("Read of %d bytes allocated %d bytes, want at most %d", len(b), alloc, limit)
		}
		if err != nil {
			if !errors.Is(err, ErrFormat) {
				t.Fatalf("Read error %q does not wrap ErrFormat", err)
			}
			return
		}
		var all []Tensor
		for _, name := range file.Names() {
			x, err := file.Tensor(name)
			if err != nil {
				if !errors.Is(err, ErrChecksum) {
					t.Fatalf("Tensor(%q) of an accepted file: %v", name, err)
				}
				return
			}
			if err := x.Validate(); err != nil {
				t.Fatalf("Tensor(%q) is invalid: %v", name, err)
			}
			x.Float32s()
			x.Float64s()
			x.Int64s()
			x.Convert(BF16)
			all = append(all, x)
		}
		if file.Verify() != nil {
			t.Fatal("Verify fails although every tensor passed its checksum")
		}
		var buf bytes.Buffer
		if err := Write(&buf, all, file.Metadata()); err != nil {
			t.Fatalf("Write of an accepted file: %v", err)
		}
		again, err := readBytes(buf.Bytes())
		if err != nil {
			t.Fatalf("Read of a rewritten file: %v", err)
		}
		if !slices.Equal(again.Names(), file.Names()) {
			t.Fatalf("names %q became %q", file.Names(), again.Names())
		}
		for _, x := range all {
			y, err := again.Tensor(x.Name)
			if err != nil || y.DType != x.DType || !slices.Equal(y.Shape, x.Shape) || !bytes.Equal(y.Data, x.Data) {
				t.Fatalf("tensor %q changed in a round trip: %v", x.Name, err)
			}
		}
	})
}
