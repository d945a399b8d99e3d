package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func checkpoint() []Tensor {
	return []Tensor{
		FromFloat32s("layer.0.weight", []int{4, 8}, make([]float32, 32)),
		FromFloat32s("layer.0.bias", []int{8}, []float32{1, 2, 3, 4, 5, 6, 7, 8}),
		FromInt64s("step", nil, []int64{42}),
	}
}

func TestChecksumCorruptionDetected(t *testing.T) {
	good := encodeAll(t, checkpoint(), map[string]string{"epoch": "1"})
	hdrLen := int(binary.LittleEndian.Uint64(good))
	f, err := readBytes(good)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range f.Names() {
		in, _ := f.Info(name)
		for _, pos := range []int64{0, in.Size - 1} {
			t.Run(fmt.Sprintf("%s@%d", name, pos), func(t *testing.T) {
				bad := slices.Clone(good)
				bad[8+int64(hdrLen)+in.Offset+pos] ^= 0x01
				g, err := readBytes(bad)
				if err != nil {
					t.Fatalf("Read checks data lazily, but failed: %v", err)
				}
				_, err = g.Tensor(name)
				wantErr(t, err, ErrChecksum, fmt.Sprintf("tensor %q", name), "checksum mismatch")
				var e *Error
				if errors.As(err, &e) && e.Tensor != name {
					t.Errorf("error names %q, want %q", e.Tensor, name)
				}
				wantErr(t, g.Verify(), ErrChecksum, name)
				for _, other := range g.Names() {
					if other == name {
						continue
					}
					if _, err := g.Tensor(other); err != nil {
						t.Errorf("intact tensor %q: %v", other, err)
					}
				}
			})
		}
	}
}

func TestChecksumEntryCorruptionDetected(t *testing.T) {
	good := encodeAll(t, checkpoint(), nil)
	f, _ := readBytes(good)
	in, _ := f.Info("layer.0.bias")
	b, _ := f.Tensor("layer.0.bias")
	sum := sha256Hex(b.Data)
	if !bytes.Contains(good, []byte(sum)) || in.Size == 0 {
		t.Fatalf("checksum %s of layer.0.bias not in the header", sum)
	}
	// Change one hex digit of the stored sum: same header length.
	repl := []byte(sum)
	if repl[10] == 'a' {
		repl[10] = 'b'
	} else {
		repl[10] = 'a'
	}
	bad := bytes.Replace(good, []byte(sum), repl, 1)
	g, err := readBytes(bad)
	if err != nil {
		t.Fatal(err)
	}
	_, err = g.Tensor("layer.0.bias")
	wantErr(t, err, ErrChecksum, "layer.0.bias", string(repl))
	wantErr(t, g.Verify(), ErrChecksum, "layer.0.bias")
	if _, err := g.Tensor("step"); err != nil {
		t.Errorf("step: %v", err)
	}
	// Swapping two equal-sized tensors' offsets is caught as well.
	h := FromFloat32s("a", []int{1}, []float32{1})
	k := FromFloat32s("b", []int{1}, []float32{2})
	swapped := encodeAll(t, []Tensor{h, k}, nil)
	swapped = bytes.Replace(swapped, []byte(`"data_offsets":[0,4]`), []byte(`"data_offsets":[X,X]`), 1)
	swapped = bytes.Replace(swapped, []byte(`"data_offsets":[4,8]`), []byte(`"data_offsets":[0,4]`), 1)
	swapped = bytes.Replace(swapped, []byte(`"data_offsets":[X,X]`), []byte(`"data_offsets":[4,8]`), 1)
	s, err := readBytes(swapped)
	if err != nil {
		t.Fatal(err)
	}
	wantErr(t, s.Verify(), ErrChecksum, `"a"`)
}

func TestChecksumsVerifyOnOpen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ckpt.safetensors")
	if err := WriteFile(path, checkpoint(), nil); err != nil {
		t.Fatal(err)
	}
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if !f.HasChecksums() {
		t.Fatal("written file has no checksums")
	}
	if err := f.Verify(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	raw, _ := os.ReadFile(path)
	raw[len(raw)-1] ^= 0x80 // last byte of "step"
	writeRaw(t, path, raw)
	f, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	err = f.Verify()
	wantErr(t, err, ErrChecksum, path, `tensor "step"`)
}

func TestVerifyReportsTruncationAfterOpen(t *testing.T) {
	b := encodeAll(t, checkpoint(), nil)
	r := &mutableReader{b: b}
	f, err := Read(r, int64(len(b)))
	if err != nil {
		t.Fatal(err)
	}
	r.b = b[:len(b)-20] // the file shrinks after Read
	wantErr(t, f.Verify(), ErrFormat, "cannot read tensor data")
	_, err = f.Tensor("layer.0.weight")
	wantErr(t, err, ErrFormat, "cannot read tensor data")
}

type mutableReader struct{ b []byte }

func (r *mutableReader) ReadAt(p []byte, off int64) (int, error) {
	return shortReader{r.b}.ReadAt(p, off)
}

func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

func TestWriteFileAtomicReplace(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "model.safetensors")
	for step := range 3 {
		ts := []Tensor{FromInt64s("step", nil, []int64{int64(step)})}
		if err := WriteFile(path, ts, nil); err != nil {
			t.Fatal(err)
		}
		if got := dirEntries(t, dir); !slices.Equal(got, []string{"model.safetensors"}) {
			t.Fatalf("after write %d the folder holds %q", step, got)
		}
		f, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		s, _ := f.Tensor("step")
		v, _ := s.Int64s()
		f.Close()
		if !slices.Equal(v, []int64{int64(step)}) {
			t.Errorf("step %d: read %v", step, v)
		}
		if st, _ := os.Stat(path); st.Mode().Perm() != 0o644 {
			t.Errorf("mode %v, want 0644", st.Mode().Perm())
		}
	}
}

func TestWriteFileFailuresLeaveTargetIntact(t *testing.T) {
	old := encodeAll(t, checkpoint(), map[string]string{"v": "old"})
	tests := []struct {
		name  string
		write func(path string) error
		kind  error // nil: any error
	}{
		{"invalid tensor", func(p string) error {
			return WriteFile(p, []Tensor{{Name: "x", DType: F32, Shape: []int{3}, Data: make([]byte, 5)}}, nil)
		}, ErrInvalid},
		{"duplicate names", func(p string) error {
			return WriteFile(p, append(checkpoint(), checkpoint()[0]), nil)
		}, ErrInvalid},
		{"writer fails midway", func(p string) error {
			return atomicWrite(p, func(w io.Writer) error {
				if _, err := w.Write(bytes.Repeat([]byte("partial"), 300000)); err != nil {
					return err
				}
				// Mid-write the bytes go to a temporary file beside the
				// target, never into the target.
				if got, _ := os.ReadFile(p); !bytes.Equal(got, old) {
					return errors.New("TEST FAILURE: target modified during the write")
				}
				tmps, _ := filepath.Glob(filepath.Join(filepath.Dir(p), ".model.safetensors.tmp-*"))
				if len(tmps) != 1 {
					return fmt.Errorf("TEST FAILURE: %d temporary files during the write", len(tmps))
				}
				if st, err := os.Stat(tmps[0]); err != nil || st.Size() == 0 {
					return fmt.Errorf("TEST FAILURE: temporary file holds nothing after 2 MB: %v", err)
				}
				return errors.New("disk on fire")
			})
		}, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "model.safetensors")
			writeRaw(t, path, old)
			err := tc.write(path)
			if err == nil {
				t.Fatal("write succeeded")
			}
			if strings.Contains(err.Error(), "TEST FAILURE") {
				t.Fatal(err)
			}
			if tc.kind != nil && !errors.Is(err, tc.kind) {
				t.Errorf("error %q does not wrap %v", err, tc.kind)
			}
			if !strings.Contains(err.Error(), path) {
				t.Errorf("error %q does not name %s", err, path)
			}
			got, _ := os.ReadFile(path)
			if !bytes.Equal(got, old) {
				t.Errorf("target changed by a failed write")
			}
			if names := dirEntries(t, dir); !slices.Equal(names, []string{"model.safetensors"}) {
				t.Errorf("folder holds %q after a failed write", names)
			}
		})
	}
}

func TestWriteFileRenameFailureCleansUp(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "model.safetensors")
	// A non-empty folder at the target: the rename must fail.
	if err := os.MkdirAll(filepath.Join(target, "keep"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(target, checkpoint(), nil); err == nil {
		t.Fatal("WriteFile over a folder succeeded")
	}
	if names := dirEntries(t, dir); !slices.Equal(names, []string{"model.safetensors"}) {
		t.Errorf("folder holds %q: temp file left behind", names)
	}
	if names := dirEntries(t, target); !slices.Equal(names, []string{"keep"}) {
		t.Errorf("target folder changed: %q", names)
	}
}

func TestWriteFileMissingFolder(t *testing.T) {
	dir := t.TempDir()
	err := WriteFile(filepath.Join(dir, "nope", "m.safetensors"), checkpoint(), nil)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("WriteFile into a missing folder: %v", err)
	}
	if names := dirEntries(t, dir); len(names) != 0 {
		t.Errorf("folder holds %q", names)
	}
}

func TestWriteFileRelativePath(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	if err := WriteFile("m.safetensors", checkpoint(), nil); err != nil {
		t.Fatal(err)
	}
	if names := dirEntries(t, "."); !slices.Equal(names, []string{"m.safetensors"}) {
		t.Errorf("folder holds %q", names)
	}
}
