package checkpoint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/internal/checked"
)

// manifestName is the manifest's file in a checkpoint folder.
const manifestName = "manifest.json"

// format names the manifest's format and version.
const format = "loom.checkpoint/1"

// manifest is the checkpoint's index: every tensor's global shape, dtype
// and chunks, the files, the entries. It is written last, as
//
//	{"manifest":<body>,"sha256":"<hex of the body's bytes>"}
//
// so that an altered or truncated manifest is refused (ErrCorrupt).
type manifest struct {
	Format    string             `json:"format"`
	Step      int                `json:"step"`
	WorldSize int                `json:"world_size"`
	Checksum  string             `json:"checksum"`    // "crc32c"
	Block     int                `json:"block_bytes"` // the checksum block
	Files     []fileRecord       `json:"files"`
	Tensors   map[string]*tensor `json:"tensors"`
	Entries   map[string]entry   `json:"entries"`
}

// fileRecord is one rank's data file.
type fileRecord struct {
	Name  string `json:"name"`
	Rank  int    `json:"rank"`
	Bytes int64  `json:"bytes"`
}

// tensor is one saved tensor.
type tensor struct {
	DType   string  `json:"dtype"` // "F32" or "F64"
	Shape   []int   `json:"shape"`
	SavedAs savedAs `json:"saved_as"` // for information: the saver's layout
	Chunks  []chunk `json:"chunks"`
}

// savedAs describes the saver's mesh and placements (information only:
// loading plans from the chunks).
type savedAs struct {
	MeshAxes   []string   `json:"mesh_axes"`
	MeshShape  []int      `json:"mesh_shape"`
	MeshRanks  []int      `json:"mesh_ranks"`
	Placements []string   `json:"placements"`
	Order      [][]string `json:"order"`
}

// chunk is one block of a tensor, stored as one tensor of a data file.
type chunk struct {
	Offset []int    `json:"offset"`
	Size   []int    `json:"size"`
	File   string   `json:"file"`
	Key    string   `json:"key"`   // the tensor's name inside the file
	Begin  int64    `json:"begin"` // byte range in the file, end exclusive
	End    int64    `json:"end"`
	CRC32C []uint32 `json:"crc32c"` // one per block of the chunk's bytes
}

// encodeManifest returns the manifest file's bytes.
func encodeManifest(m *manifest) ([]byte, error) {
	body, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(body)
	var b bytes.Buffer
	b.WriteString(`{"manifest":`)
	b.Write(body)
	b.WriteString(`,"sha256":"`)
	b.WriteString(hex.EncodeToString(sum[:]))
	b.WriteString("\"}\n")
	return b.Bytes(), nil
}

// decodeManifest parses and checks a manifest file's bytes; path names it
// in errors, which wrap ErrCorrupt.
func decodeManifest(op, path string, data []byte) (*manifest, error) {
	var outer struct {
		Manifest json.RawMessage `json:"manifest"`
		SHA256   string          `json:"sha256"`
	}
	if err := json.Unmarshal(data, &outer); err != nil {
		return nil, corruptf(op, "%s: not a manifest (%v)", path, err)
	}
	if outer.Manifest == nil || outer.SHA256 == "" {
		return nil, corruptf(op, "%s: not a manifest (no body or no checksum)", path)
	}
	sum := sha256.Sum256(outer.Manifest)
	if hex.EncodeToString(sum[:]) != outer.SHA256 {
		return nil, corruptf(op, "%s: the manifest's SHA-256 does not match its body: it was altered or damaged", path)
	}
	m := new(manifest)
	dec := json.NewDecoder(bytes.NewReader(outer.Manifest))
	dec.DisallowUnknownFields()
	if err := dec.Decode(m); err != nil {
		return nil, corruptf(op, "%s: %v", path, err)
	}
	if err := m.check(); err != nil {
		return nil, corruptf(op, "%s: %v", path, err)
	}
	return m, nil
}

// dtypeSize returns the bytes of an element of a manifest dtype.
func dtypeSize(dt string) int {
	switch dt {
	case "F32":
		return 4
	case "F64":
		return 8
	}
	return 0
}

// check validates a parsed manifest: known format, plain file names, and
// for every tensor chunks inside the shape that tile it exactly, with byte
// ranges of the right length inside their files and one checksum per
// block.
func (m *manifest) check() error {
	if m.Format != format {
		return fmt.Errorf("format %q, want %q", m.Format, format)
	}
	if m.Checksum != "crc32c" || m.Block < 1 {
		return fmt.Errorf("checksum %q in blocks of %d bytes, want crc32c in blocks of at least 1", m.Checksum, m.Block)
	}
	sizes := map[string]int64{}
	for _, f := range m.Files {
		if f.Name == "" || f.Name != filepath.Base(f.Name) || strings.HasPrefix(f.Name, ".") {
			return fmt.Errorf("file name %q is not a plain name in the checkpoint folder", f.Name)
		}
		if _, dup := sizes[f.Name]; dup {
			return fmt.Errorf("file %q listed twice", f.Name)
		}
		sizes[f.Name] = f.Bytes
	}
	for _, name := range slices.Sorted(maps.Keys(m.Tensors)) {
		t := m.Tensors[name]
		if err := t.check(m.Block, sizes); err != nil {
			return fmt.Errorf("tensor %q: %v", name, err)
		}
	}
	for name, e := range m.Entries {
		if _, err := e.decode(); err != nil {
			return fmt.Errorf("entry %q: %v", name, err)
		}
	}
	return nil
}

func (t *tensor) check(block int, sizes map[string]int64) error {
	es := dtypeSize(t.DType)
	if es == 0 {
		return fmt.Errorf("dtype %q, want F32 or F64", t.DType)
	}
	for _, d := range t.Shape {
		if d < 0 {
			return fmt.Errorf("shape %v has a negative dim", t.Shape)
		}
	}
	total, ok := checked.Product(append(slices.Clone(t.Shape), es))
	if !ok {
		return fmt.Errorf("shape %v overflows", t.Shape)
	}
	covered := 0
	for i, c := range t.Chunks {
		if len(c.Offset) != len(t.Shape) || len(c.Size) != len(t.Shape) {
			return fmt.Errorf("chunk %d: offset %v and size %v for a %d-d tensor", i, c.Offset, c.Size, len(t.Shape))
		}
		for d := range t.Shape {
			if c.Offset[d] < 0 || c.Size[d] < 1 || c.Size[d] > t.Shape[d]-c.Offset[d] {
				return fmt.Errorf("chunk %d: offset %v size %v outside the shape %v", i, c.Offset, c.Size, t.Shape)
			}
		}
		n := prod(c.Size) * es // inside the shape, so no overflow
		fsize, ok := sizes[c.File]
		if !ok {
			return fmt.Errorf("chunk %d: file %q is not among the checkpoint's files", i, c.File)
		}
		if c.Begin < 0 || c.End-c.Begin != int64(n) || c.End > fsize {
			return fmt.Errorf("chunk %d: bytes [%d, %d) of %s (%d bytes) for %d bytes of data", i, c.Begin, c.End, c.File, fsize, n)
		}
		if want := (n + block - 1) / block; len(c.CRC32C) != want {
			return fmt.Errorf("chunk %d: %d checksums for %d blocks", i, len(c.CRC32C), want)
		}
		for j := range i {
			if overlap(c, t.Chunks[j]) {
				return fmt.Errorf("chunks %d and %d overlap", j, i)
			}
		}
		covered += n
	}
	if covered != total {
		return fmt.Errorf("chunks cover %d of its %d bytes", covered, total)
	}
	return nil
}

// overlap reports whether two chunks' boxes intersect.
func overlap(a, b chunk) bool {
	for d := range a.Offset {
		if max(a.Offset[d], b.Offset[d]) >= min(a.Offset[d]+a.Size[d], b.Offset[d]+b.Size[d]) {
			return false
		}
	}
	return true
}

// prod is the product of dims (1 for none).
func prod(dims []int) int {
	n := 1
	for _, d := range dims {
		n *= d
	}
	return n
}
