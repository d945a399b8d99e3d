package safetensors

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/reference"
)

// openReference opens the embedded reference fixture name ("tiny_gpt" or
// "moe_layer") after checking its tensor file against the SHA-256 its JSON
// records, and returns the file and the JSON's keys.
func openReference(t *testing.T, name string) (*File, map[string]json.RawMessage) {
	t.Helper()
	data, err := reference.ReadFile(name + ".safetensors")
	if err != nil {
		t.Fatal(err)
	}
	raw, err := reference.ReadFile(name + ".json")
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	var wantSum string
	if err := json.Unmarshal(doc["safetensors_sha256"], &wantSum); err != nil {
		t.Fatal(err)
	}
	if s := sha256.Sum256(data); hex.EncodeToString(s[:]) != wantSum {
		t.Fatalf("%s.safetensors does not match safetensors_sha256 in %s.json", name, name)
	}
	f, err := Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, doc
}

func jsonField[T any](t *testing.T, doc map[string]json.RawMessage, key string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(doc[key], &v); err != nil {
		t.Fatalf("JSON key %q: %v", key, err)
	}
	return v
}

func l2(v []float32) float64 {
	var s float64
	for _, x := range v {
		s += float64(x) * float64(x)
	}
	return math.Sqrt(s)
}

func TestReferenceTinyGPT(t *testing.T) {
	f, doc := openReference(t, "tiny_gpt")
	order := jsonField[[]string](t, doc, "param_order")
	shapes := jsonField[map[string][]int](t, doc, "param_shapes")
	norms := jsonField[map[string]float64](t, doc, "init_norms")
	if len(order) != 29 {
		t.Fatalf("param_order has %d entries, want 29", len(order))
	}

	// reference/TINY_GPT.md §5.1: x1, y1 (I64 [16, 64]) and init/grad1/after1 for
	// each of the 29 parameters: 89 tensors.
	want := []string{"x1", "y1"}
	for _, prefix := range []string{"init.", "grad1.", "after1."} {
		for _, p := range order {
			want = append(want, prefix+p)
		}
	}
	slices.Sort(want)
	if got := f.Names(); !slices.Equal(got, want) {
		t.Fatalf("Names() = %q, want %q", got, want)
	}
	if f.HasChecksums() || f.Verify() != nil {
		t.Errorf("PyTorch's file has no loom checksums: HasChecksums() = %v", f.HasChecksums())
	}

	// Shapes from §3.1 (V=256, D=128, T=64, F=512) and from the JSON.
	doc31 := map[string][]int{
		"wte": {256, 128}, "wpe": {64, 128}, "h.0.ln1.weight": {128},
		"h.1.attn.qkv.weight": {384, 128}, "h.0.attn.qkv.bias": {384},
		"h.0.attn.proj.weight": {128, 128}, "h.1.mlp.fc.weight": {512, 128},
		"h.0.mlp.proj.weight": {128, 512}, "ln_f.bias": {128}, "lm_head.weight": {256, 128},
	}
	var params int
	for _, p := range order {
		for _, prefix := range []string{"init.", "grad1.", "after1."} {
			in, err := f.Info(prefix + p)
			if err != nil {
				t.Fatal(err)
			}
			if in.DType != F32 || !slices.Equal(in.Shape, shapes[p]) {
				t.Errorf("%s%s: %s %v, want F32 %v", prefix, p, in.DType, in.Shape, shapes[p])
			}
			if w, ok := doc31[p]; ok && !slices.Equal(in.Shape, w) {
				t.Errorf("%s%s: shape %v, reference/TINY_GPT.md says %v", prefix, p, in.Shape, w)
			}
		}
		init, err := f.Tensor("init." + p)
		if err != nil {
			t.Fatal(err)
		}
		v, err := init.Float32s()
		if err != nil {
			t.Fatal(err)
		}
		params += len(v)
		if n := l2(v); math.Abs(n-norms[p]) > 1e-6*norms[p] {
			t.Errorf("‖init.%s‖ = %.9g, init_norms says %.9g", p, n, norms[p])
		}
		switch {
		case strings.HasSuffix(p, "ln1.weight"), strings.HasSuffix(p, "ln2.weight"), p == "ln_f.weight":
			if slices.ContainsFunc(v, func(x float32) bool { return x != 1 }) {
				t.Errorf("init.%s is not all ones", p)
			}
		case strings.HasSuffix(p, ".bias"):
			if slices.ContainsFunc(v, func(x float32) bool { return x != 0 }) {
				t.Errorf("init.%s is not all zeros", p)
			}
		}
	}
	if params != 470528 {
		t.Errorf("%d parameters, reference/TINY_GPT.md says 470528", params)
	}

	// Batch 1: bytes, and y is x shifted by one position.
	x1, err := f.Tensor("x1")
	if err != nil {
		t.Fatal(err)
	}
	y1, _ := f.Tensor("y1")
	if x1.DType != I64 || !slices.Equal(x1.Shape, []int{16, 64}) || y1.DType != I64 || !slices.Equal(y1.Shape, []int{16, 64}) {
		t.Fatalf("x1 %s %v, y1 %s %v; want I64 [16 64]", x1.DType, x1.Shape, y1.DType, y1.Shape)
	}
	x, _ := x1.Int64s()
	y, _ := y1.Int64s()
	distinct := map[int64]bool{}
	for b := range 16 {
		for i := range 64 {
			v := x[b*64+i]
			if v < 0 || v > 255 {
				t.Fatalf("x1[%d][%d] = %d is not a byte", b, i, v)
			}
			distinct[v] = true
			if i < 63 && y[b*64+i] != x[b*64+i+1] {
				t.Fatalf("y1[%d][%d] = %d, want x1[%d][%d] = %d", b, i, y[b*64+i], b, i+1, x[b*64+i+1])
			}
		}
	}
	if len(distinct) != 36 {
		t.Errorf("x1 has %d distinct bytes, reference/TINY_GPT.md says 36", len(distinct))
	}
	// The 220 unused rows of wte get an exactly zero gradient.
	g, _ := f.Tensor("grad1.wte")
	gv, _ := g.Float32s()
	zeroRows := 0
	for r := range 256 {
		if !slices.ContainsFunc(gv[r*128:(r+1)*128], func(x float32) bool { return x != 0 }) {
			zeroRows++
		}
	}
	if zeroRows != 220 {
		t.Errorf("grad1.wte has %d zero rows, want 220", zeroRows)
	}

	meta := f.Metadata()
	if meta["format"] != "pt" || meta["fixture"] != "tiny_gpt" || meta["loss_step1"] != "5.520738124847412" ||
		meta["param_order"] != strings.Join(order, ",") {
		t.Errorf("metadata = %v", meta)
	}
}

func TestReferenceMoELayer(t *testing.T) {
	f, doc := openReference(t, "moe_layer")
	tensors := jsonField[map[string]struct {
		DType string `json:"dtype"`
		Shape []int  `json:"shape"`
	}](t, doc, "tensors")
	dtypes := map[string]DType{"float32": F32, "int64": I64}
	var want []string
	for name, spec := range tensors {
		want = append(want, name)
		in, err := f.Info(name)
		if err != nil {
			t.Fatal(err)
		}
		if in.DType != dtypes[spec.DType] || !slices.Equal(in.Shape, spec.Shape) {
			t.Errorf("%s: %s %v, moe_layer.json says %s %v", name, in.DType, in.Shape, spec.DType, spec.Shape)
		}
	}
	slices.Sort(want)
	if got := f.Names(); len(got) != 22 || !slices.Equal(got, want) {
		t.Fatalf("Names() = %q, want the 22 tensors %q", got, want)
	}
	// reference/MOE_LAYER.md §2 and §5 (N=64, D=32, E=8, k=2, Hd=64), scalars as [1].
	docShapes := map[string][]int{
		"x": {64, 32}, "Wr": {8, 32}, "W1": {8, 64, 32}, "b1": {8, 64}, "W2": {8, 32, 64},
		"b2": {8, 32}, "topk_idx": {64, 2}, "tokens_per_expert": {8}, "aux": {1}, "L": {1},
	}
	for name, shape := range docShapes {
		if in, _ := f.Info(name); !slices.Equal(in.Shape, shape) {
			t.Errorf("%s: shape %v, reference/MOE_LAYER.md says %v", name, in.Shape, shape)
		}
	}
	tpe, _ := f.Tensor("tokens_per_expert")
	counts, err := tpe.Int64s()
	if err != nil || !slices.Equal(counts, []int64{4, 15, 11, 14, 18, 27, 21, 18}) {
		t.Errorf("tokens_per_expert = %v, %v", counts, err)
	}
	topk, _ := f.Tensor("topk_idx")
	idx, _ := topk.Int64s()
	hist := make([]int64, 8)
	for _, e := range idx {
		if e < 0 || e >= 8 {
			t.Fatalf("topk_idx holds expert %d", e)
		}
		hist[e]++
	}
	if !slices.Equal(hist, counts) {
		t.Errorf("topk_idx histogram %v != tokens_per_expert %v", hist, counts)
	}
	norms := jsonField[map[string]float64](t, doc, "grad_norms")
	for p, want := range norms {
		g, err := f.Tensor("grad." + p)
		if err != nil {
			t.Fatal(err)
		}
		v, _ := g.Float32s()
		if n := l2(v); math.Abs(n-want) > 1e-6*want {
			t.Errorf("‖grad.%s‖ = %.9g, grad_norms says %.9g", p, n, want)
		}
	}
	aux, _ := f.Tensor("aux")
	if v, _ := aux.Float32s(); len(v) != 1 || math.Abs(float64(v[0])-1.0372535) > 1e-6 {
		t.Errorf("aux = %v, want 1.0372535", v)
	}
	if m := f.Metadata(); m["fixture"] != "moe_layer" || m["aux_coef"] != "0.01" {
		t.Errorf("metadata = %v", m)
	}
}

// TestReferenceRewrite copies a reference file through Write and checks
// that every tensor and metadata entry survives, now with checksums.
func TestReferenceRewrite(t *testing.T) {
	f, _ := openReference(t, "moe_layer")
	var all []Tensor
	for _, n := range f.Names() {
		x, err := f.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, x)
	}
	path := filepath.Join(t.TempDir(), "copy.safetensors")
	if err := WriteFile(path, all, f.Metadata()); err != nil {
		t.Fatal(err)
	}
	g, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := g.Verify(); err != nil || !g.HasChecksums() {
		t.Fatalf("Verify = %v, HasChecksums = %v", err, g.HasChecksums())
	}
	for _, x := range all {
		y, err := g.Tensor(x.Name)
		if err != nil {
			t.Fatal(err)
		}
		if y.DType != x.DType || !slices.Equal(y.Shape, x.Shape) || string(y.Data) != string(x.Data) {
			t.Errorf("%s changed in the copy", x.Name)
		}
	}
	gm := g.Metadata()
	for k, v := range f.Metadata() {
		if gm[k] != v {
			t.Errorf("metadata %q = %q, want %q", k, gm[k], v)
		}
	}
}
