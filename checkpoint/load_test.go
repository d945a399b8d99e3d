package checkpoint

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// loadOn loads path onto l's mesh with targets from defs (all by default)
// and returns rank 0's error after checking that every rank failed alike.
func loadOn(t *testing.T, path string, l meshLayout, defs map[string]tdef, opts ...Option) error {
	t.Helper()
	errs := make([]error, prod(l.shape))
	simulate(t, l.shape, l.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, defs, l.lay)
		if err != nil {
			return err
		}
		_, errs[m.Rank()] = Load(ctx, path, specs, opts...)
		return nil
	})
	for r, err := range errs {
		if (err == nil) != (errs[0] == nil) {
			t.Errorf("rank %d: %v; rank 0: %v", r, err, errs[0])
		}
	}
	return errs[0]
}

// TestFlippedByte flips one byte in every chunk in turn: Load fails with
// ErrCorrupt naming the file and the tensor, on every layout that reads
// that byte.
func TestFlippedByte(t *testing.T) {
	root := t.TempDir()
	path := saveOn(t, root, dp2tp2, testTensors, WithBlockSize(8))
	m, err := readManifest("test", path)
	if err != nil {
		t.Fatal(err)
	}
	for name, tm := range m.Tensors {
		for _, c := range tm.Chunks {
			file := filepath.Join(path, c.File)
			orig, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			at := c.End - 1 // the chunk's last byte
			bad := bytes.Clone(orig)
			bad[at] ^= 0x10
			if err := os.WriteFile(file, bad, 0o644); err != nil {
				t.Fatal(err)
			}
			err = loadOn(t, path, oneRank, testTensors)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), file) || !strings.Contains(err.Error(), fmt.Sprintf("tensor %q", name)) {
				t.Errorf("byte %d of %s (tensor %s) flipped: %v, want ErrCorrupt naming the file and tensor", at, c.File, name, err)
			}
			if err := os.WriteFile(file, orig, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := loadOn(t, path, oneRank, testTensors); err != nil {
		t.Fatalf("restored checkpoint: %v", err)
	}
}

// TestLoadRefuses: a checkpoint of another model, a damaged manifest or
// data file, a Partial target, a folder without a manifest: refused with
// an error naming what, on every rank.
func TestLoadRefuses(t *testing.T) {
	with := func(name string, d tdef) map[string]tdef {
		out := map[string]tdef{}
		for k, v := range testTensors {
			out[k] = v
		}
		out[name] = d
		return out
	}
	without := func(name string) map[string]tdef {
		out := with(name, tdef{})
		delete(out, name)
		return out
	}
	type damage func(t *testing.T, dir string)
	editManifest := func(f func([]byte) []byte) damage {
		return func(t *testing.T, dir string) {
			p := filepath.Join(dir, manifestName)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, f(b), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	cases := []struct {
		name   string
		defs   map[string]tdef
		lay    meshLayout
		damage damage
		want   error
		says   string
	}{
		{"missing tensor", with("extra", tdef{shape: []int{2}, dtype: comm.Float32}), oneRank, nil, ErrInvalid, `no tensor "extra"`},
		{"extra tensor", without("w"), oneRank, nil, ErrInvalid, `tensor(s) "w" that no rank loads`},
		{"wrong shape", with("w", tdef{shape: []int{5, 7}, dtype: comm.Float32}), oneRank, nil, ErrInvalid, `tensor "w": the checkpoint's shape is [7 5], the target's [5 7]`},
		{"wrong dtype", with("b", tdef{shape: []int{5}, dtype: comm.Float32}), oneRank, nil, ErrInvalid, `tensor "b": the checkpoint's dtype is F64, the target's F32`},
		{"partial target", testTensors, meshLayout{"partial", []int{2}, []string{"dp"}, func(m *mesh.Mesh, n string, d tdef) ([]placement.Placement, []placement.SpecOption) {
			return []placement.Placement{placement.Partial(comm.Sum)}, nil
		}}, nil, ErrInvalid, "target placements [P(sum)]"},
		{"truncated manifest", testTensors, tp3, editManifest(func(b []byte) []byte { return b[:len(b)/2] }), ErrCorrupt, "not a manifest"},
		{"altered manifest", testTensors, tp3, editManifest(func(b []byte) []byte { return bytes.Replace(b, []byte(`"shape":[7,5]`), []byte(`"shape":[7,6]`), 1) }), ErrCorrupt, "SHA-256 does not match"},
		{"no manifest", testTensors, tp3, func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, manifestName)) }, ErrNotFound, "has no manifest"},
		{"truncated data", testTensors, tp3, func(t *testing.T, dir string) {
			p := filepath.Join(dir, fileName(1))
			st, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(p, st.Size()-1); err != nil {
				t.Fatal(err)
			}
		}, ErrCorrupt, "truncated or replaced"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := saveOn(t, t.TempDir(), dp2tp2, testTensors)
			if c.damage != nil {
				c.damage(t, path)
			}
			err := loadOn(t, path, c.lay, c.defs)
			if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
				t.Errorf("got %v, want %v saying %q", err, c.want, c.says)
			}
		})
	}
}
