package safetensors_test

import (
	"bytes"
	"fmt"
	"log"

	"github.com/b7ea7098/loom/safetensors"
)

func Example() {
	// Write two tensors and some metadata. WriteFile does the same
	// atomically on disk.
	var buf bytes.Buffer
	err := safetensors.Write(&buf, []safetensors.Tensor{
		safetensors.FromFloat32s("fc.weight", []int{2, 3}, []float32{1, 2, 3, 4, 5, 6}),
		safetensors.FromInt64s("step", nil, []int64{100}),
	}, map[string]string{"format": "pt"})
	if err != nil {
		log.Fatal(err)
	}

	// Read them back: Read parses and validates the header; tensor data is
	// read (and checked against its SHA-256) when asked for.
	f, err := safetensors.Read(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		log.Fatal(err)
	}
	for _, name := range f.Names() {
		t, err := f.Tensor(name)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(name, t.DType, t.Shape)
	}
	w, _ := f.Tensor("fc.weight")
	vals, _ := w.Float32s()
	fmt.Println(vals, f.Metadata()["format"], f.HasChecksums())

	// A bfloat16 copy, widened back to float32.
	half, _ := w.Convert(safetensors.BF16)
	widened, _ := half.Float32s()
	fmt.Println(len(half.Data), widened)
	// Output:
	// fc.weight F32 [2 3]
	// step I64 []
	// [1 2 3 4 5 6] pt true
	// 12 [1 2 3 4 5 6]
}
