package checkpoint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/safetensors"
)

// exportOn exports defs laid out by l to path.
func exportOn(t *testing.T, path string, l meshLayout, defs map[string]tdef, opts ...Option) {
	t.Helper()
	simulate(t, l.shape, l.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, defs, l.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, defs)
		if err != nil {
			return err
		}
		return Export(ctx, path, st, opts...)
	})
}

// TestExportImport exports from several layouts, checks the file with the
// safetensors reader (exactly the tensors, under their names, whole, bit
// for bit, metadata {"format": "pt"}, no staging remains), and imports it
// onto another layout, each rank reading only its blocks' bytes.
func TestExportImport(t *testing.T) {
	cases := []struct {
		from, to meshLayout
		prefix   string
	}{
		{dp2tp2, tp3, ""},
		{fsdpOverT, oneRank, "model."},
		{five, dp3tp2, ""},
	}
	for _, c := range cases {
		t.Run(c.from.name+"→"+c.to.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "model.safetensors")
			var opts []Option
			if c.prefix != "" {
				opts = append(opts, WithPrefix(c.prefix))
			}
			exportOn(t, path, c.from, testTensors, opts...)
			if ents, _ := os.ReadDir(dir); len(ents) != 1 {
				t.Fatalf("the export left %v", ents)
			}
			f, err := safetensors.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			var want []string
			for _, n := range slices.Sorted(maps.Keys(testTensors)) {
				want = append(want, c.prefix+n)
			}
			if got := f.Names(); !slices.Equal(got, want) {
				t.Fatalf("names %v, want %v", got, want)
			}
			if md := f.Metadata(); len(md) != 1 || md["format"] != "pt" {
				t.Errorf("metadata %v, want only format pt", md)
			}
			for n, d := range testTensors {
				x, err := f.Tensor(c.prefix + n)
				if err != nil {
					t.Fatal(err)
				}
				var got any
				if d.dtype == comm.Float64 {
					got, err = x.Float64s()
				} else {
					got, err = x.Float32s()
				}
				if err != nil {
					t.Fatal(err)
				}
				if err := bitsEqual(got, d.full()); err != nil {
					t.Errorf("%s: %v", n, err)
				}
				if !slices.Equal(x.Shape, d.shape) {
					t.Errorf("%s: shape %v, want %v", n, x.Shape, d.shape)
				}
			}
			m, err := fileManifest("test", path, c.prefix)
			if err != nil {
				t.Fatal(err)
			}
			rec := &recorder{}
			simulate(t, c.to.shape, c.to.axes, func(ctx context.Context, msh *mesh.Mesh) error {
				specs, err := specsOn(msh, testTensors, c.to.lay)
				if err != nil {
					return err
				}
				st, err := Import(ctx, path, specs, append(opts, withHook(rec.hook))...)
				if err != nil {
					return err
				}
				for _, n := range slices.Sorted(maps.Keys(testTensors)) {
					full, err := st.Tensors[n].Full(ctx)
					if err != nil {
						return err
					}
					if err := bitsEqual(full, testTensors[n].full()); err != nil {
						return fmt.Errorf("%s: %v", n, err)
					}
				}
				// Each rank read its blocks' bytes, rounded out to 1 MiB
				// blocks: here every tensor is smaller, so at most the
				// tensors it holds a part of, and nothing of the others.
				read := rec.ranges("read")[msh.World().Rank()]
				var need [][2]int64
				for n, s := range specs {
					_, size, _ := s.Box(msh.Rank())
					if prod(size) > 0 {
						tm := m.Tensors[n]
						need = append(need, [2]int64{tm.Chunks[0].Begin, tm.Chunks[0].End})
					}
				}
				if got, want := read[filepath.Base(path)], mergeRanges(need); !slices.Equal(got, want) {
					return fmt.Errorf("rank %d read %v, want %v", msh.Rank(), got, want)
				}
				return nil
			})
		})
	}
}

// TestImportRefuses: a file of another model is refused before any tensor
// is built, naming the tensor.
func TestImportRefuses(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "m.safetensors")
	defs := map[string]tdef{
		"w": {shape: []int{4, 3}, dtype: comm.Float32, seed: 1},
		"b": {shape: []int{3}, dtype: comm.Float64, seed: 2},
	}
	exportOn(t, path, tp2, defs)
	bad := filepath.Join(dir, "bad.safetensors")
	if err := os.WriteFile(bad, []byte("\x10\x00\x00\x00\x00\x00\x00\x00{not json}      "), 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		path string
		defs map[string]tdef
		opts []Option
		want error
		says string
	}{
		{"missing", path, map[string]tdef{"w": defs["w"], "b": defs["b"], "z": defs["b"]}, nil, ErrInvalid, `no tensor "z"`},
		{"extra", path, map[string]tdef{"w": defs["w"]}, nil, ErrInvalid, `tensor(s) "b" that no rank loads`},
		{"shape", path, map[string]tdef{"w": {shape: []int{3, 4}, dtype: comm.Float32}, "b": defs["b"]}, nil, ErrInvalid, `tensor "w": the checkpoint's shape is [4 3]`},
		{"dtype", path, map[string]tdef{"w": defs["w"], "b": {shape: []int{3}, dtype: comm.Float32}}, nil, ErrInvalid, `tensor "b": the checkpoint's dtype is F64`},
		{"prefix", path, defs, []Option{WithPrefix("model.")}, ErrInvalid, `no tensor "b"`},
		{"not safetensors", bad, defs, nil, ErrCorrupt, "bad.safetensors"},
		{"a Save option", path, defs, []Option{WithKeep(1)}, ErrInvalid, "WithKeep is not an option of Import"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			err := simulateErr([]int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				specs, err := specsOn(m, c.defs, allReplicated(1))
				if err != nil {
					return err
				}
				_, err = Import(ctx, c.path, specs, c.opts...)
				if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
					return fmt.Errorf("got %v, want %v saying %q", err, c.want, c.says)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// numpyCheck reads a safetensors file with numpy alone: the 8-byte header
// length, the JSON header, then each tensor's bytes by its data_offsets,
// compared bit for bit with the expected values (decimal strings that
// round-trip), name by name; and no tensor more or less.
const numpyCheck = `
import json, struct, sys
import numpy as np
path, want_path = sys.argv[1], sys.argv[2]
want = json.load(open(want_path))
data = open(path, "rb").read()
(n,) = struct.unpack("<Q", data[:8])
header = json.loads(data[8:8 + n])
header.pop("__metadata__", None)
assert sorted(header) == sorted(want), (sorted(header), sorted(want))
for name, info in header.items():
    w = want[name]
    dt = {"F32": np.float32, "F64": np.float64}[info["dtype"]]
    assert info["dtype"] == w["dtype"] and info["shape"] == w["shape"], (name, info, w)
    b, e = info["data_offsets"]
    got = np.frombuffer(data[8 + n + b:8 + n + e], dtype=np.dtype(dt).newbyteorder("<")).reshape(w["shape"])
    exp = np.array([float(v) for v in w["values"]], dtype=dt).reshape(w["shape"])
    assert got.tobytes() == exp.tobytes(), name
print("numpy: %d tensors equal" % len(header))
`

// TestExportNumpy: numpy, reading the exported file by hand (no
// safetensors package), finds every tensor equal. It needs python3 with
// numpy (Debian's python3-numpy, which .ci/run installs).
func TestExportNumpy(t *testing.T) {
	// The python3 on PATH may be another installation than Debian's,
	// which .ci/run gives numpy: try both.
	var py string
	for _, c := range []string{"python3", "/usr/bin/python3"} {
		if p, err := exec.LookPath(c); err == nil && exec.Command(p, "-c", "import numpy").Run() == nil {
			py = p
			break
		}
	}
	if py == "" {
		if os.Getenv("LOOM_NUMPY_REQUIRE") == "1" {
			t.Fatal("no python3 with numpy (Debian: python3-numpy), and LOOM_NUMPY_REQUIRE=1")
		}
		t.Skip("no python3 with numpy is installed (Debian: python3-numpy)")
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "model.safetensors")
	exportOn(t, path, dp3tp2, testTensors)
	want := map[string]any{}
	for n, d := range testTensors {
		var vals []string
		switch v := d.full().(type) {
		case []float32:
			for _, x := range v {
				vals = append(vals, strconv.FormatFloat(float64(x), 'g', -1, 32))
			}
		case []float64:
			for _, x := range v {
				vals = append(vals, strconv.FormatFloat(x, 'g', -1, 64))
			}
		}
		want[n] = map[string]any{"dtype": dtypeName(d.dtype), "shape": append([]int{}, d.shape...), "values": append([]string{}, vals...)}
	}
	wb, _ := json.Marshal(want)
	wantPath := filepath.Join(dir, "want.json")
	if err := os.WriteFile(wantPath, wb, 0o644); err != nil {
		t.Fatal(err)
	}
	script := filepath.Join(dir, "check.py")
	if err := os.WriteFile(script, []byte(numpyCheck), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(py, script, path, wantPath).CombinedOutput()
	if err != nil {
		t.Fatalf("numpy's check failed: %v\n%s", err, out)
	}
	if want := fmt.Sprintf("numpy: %d tensors equal", len(testTensors)); !strings.Contains(string(out), want) {
		t.Fatalf("numpy said %q, want %q", out, want)
	}
	t.Log(strings.TrimSpace(string(out)))
}

// TestExportRefuses: Export takes no Save-only or Load option.
func TestExportRefuses(t *testing.T) {
	for _, o := range []Option{WithKeep(1), WithDevice(nil), WithStep(3)} {
		err := Export(context.Background(), filepath.Join(t.TempDir(), "x"), State{}, o)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "not an option of Export") {
			t.Errorf("got %v, want ErrInvalid: not an option of Export", err)
		}
	}
}

// TestExportSlabs: with WithMemoryLimit(8), the assembling rank writes
// each tensor one row at a time (its rows are 8 to 20 bytes), and the
// file holds every tensor exactly; by default a small tensor is one write.
func TestExportSlabs(t *testing.T) {
	for _, c := range []struct {
		name   string
		opts   []Option
		most   int64 // the largest data write
		writes int   // data writes of w [7, 5]
	}{{"bound 8", []Option{WithMemoryLimit(8)}, 20, 7}, {"default", nil, 7 * 5 * 4, 1}} {
		path := filepath.Join(t.TempDir(), "model.safetensors")
		rec := &recorder{}
		exportOn(t, path, dp2tp2, testTensors, append(c.opts, withHook(rec.hook))...)
		if err := fileHolds(path, testTensors); err != nil {
			t.Fatal(err)
		}
		f, err := safetensors.Open(path)
		if err != nil {
			t.Fatal(err)
		}
		info, err := f.Info("w")
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		var most, base int64
		wWrites := 0
		for _, ev := range rec.events {
			if ev.Op != "write" || baseName(ev.Path) != "model.safetensors.tmp" {
				continue
			}
			if ev.Off == 0 {
				base = ev.N // the header, written first
				continue
			}
			most = max(most, ev.N)
			if b := base + info.Offset; ev.Off >= b && ev.Off < b+info.Size {
				wWrites++
			}
		}
		if most != c.most {
			t.Errorf("%s: the largest data write is %d bytes, want %d", c.name, most, c.most)
		}
		if wWrites != c.writes {
			t.Errorf("%s: %d writes of w, want %d", c.name, wWrites, c.writes)
		}
	}
}
