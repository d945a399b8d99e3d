package safetensors

import (
	"bytes"
	"errors"
	"slices"
	"testing"
)

// FuzzRead feeds arbitrary bytes to Read. It must never panic; whatever it
// accepts must read back tensor by tensor and survive a Write/Read round
// trip unchanged.
func FuzzRead(f *testing.F) {
	f.Add(encodeAll(f, checkpoint(), map[string]string{"k": "v"}))
	f.Add(encodeAll(f, []Tensor{{Name: "e", DType: BF16, Shape: []int{0, 2}}, FromFloat32s("s", nil, []float32{1})}, nil))
	f.Add(rawFile(`{"a":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"__metadata__":{"x":"y"}}`, []byte{0, 0x3c, 0, 0xc0}))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}`, []byte{1, 2}))
	f.Add(rawFile(`{"__metadata__":{"loom.sha256":"{\"a\":\"00\"}"}}`, nil))
	f.Add(rawFile(`{}  `, nil))
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		file, err := readBytes(b)
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
			if err := x.Validate(); err != nil && name != "" {
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
		if slices.Contains(file.Names(), "") {
			return // readable, but Write refuses empty names
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
