package safetensors

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"sort"
	"unicode/utf8"
)

// MaxHeaderSize is the largest header Read accepts, in bytes (the limit of
// the reference implementation).
const MaxHeaderSize = 100_000_000

// ChecksumKey is the "__metadata__" key under which loom stores per-tensor
// SHA-256 checksums; see the package documentation.
const ChecksumKey = "loom.sha256"

// metadataKey is the reserved header key of the metadata object.
const metadataKey = "__metadata__"

// Info describes one tensor of a file without its data.
type Info struct {
	// DType is the element type.
	DType DType
	// Shape is the tensor's shape; empty for a scalar.
	Shape []int
	// Offset is where the tensor's bytes begin, relative to the start of
	// the data section.
	Offset int64
	// Size is the number of data bytes.
	Size int64
}

// File is an opened safetensors file whose header has been parsed and
// validated. Tensor data stays in the underlying reader until a tensor is
// requested. A File is safe for concurrent use if its reader is.
type File struct {
	r       io.ReaderAt
	closer  io.Closer
	path    string
	base    int64 // file offset of the data section
	infos   map[string]Info
	names   []string
	meta    map[string]string
	sums    map[string][sha256.Size]byte // nil when the file has no checksums
	dataLen int64
}

// Open opens and validates the safetensors file at path. The caller must
// Close the File.
func Open(path string) (*File, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	// fh is read only: closing it after a failure loses nothing, and err
	// says what failed.
	st, err := fh.Stat()
	if err != nil {
		_ = fh.Close()
		return nil, err
	}
	f, err := Read(fh, st.Size())
	if err != nil {
		_ = fh.Close()
		return nil, withPath(err, path)
	}
	f.closer = fh
	f.path = path
	return f, nil
}

// Read parses and validates the safetensors file held by r, which is size
// bytes long. It reads the header and the file's last byte (to detect a
// truncated file); tensor data is read on demand by Tensor and Verify.
func Read(r io.ReaderAt, size int64) (*File, error) {
	if size < 8 {
		return nil, formatErr("", fmt.Sprintf("truncated file: %d bytes, need at least 8 for the header length", max(size, 0)), nil)
	}
	var lenBuf [8]byte
	if err := readFull(r, lenBuf[:], 0); err != nil {
		return nil, formatErr("", "truncated file: cannot read the header length", err)
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	switch {
	case n > MaxHeaderSize:
		return nil, formatErr("", fmt.Sprintf("header too large: %d bytes (limit %d)", n, MaxHeaderSize), nil)
	case n > uint64(size-8):
		return nil, formatErr("", fmt.Sprintf("truncated file: header length %d exceeds the %d bytes after the length field", n, size-8), nil)
	case n == 0:
		return nil, formatErr("", "empty header", nil)
	}
	hdr := make([]byte, n)
	if err := readFull(r, hdr, 8); err != nil {
		return nil, formatErr("", "truncated file: cannot read the header", err)
	}
	f := &File{r: r, base: 8 + int64(n), dataLen: size - 8 - int64(n)}
	if err := f.parseHeader(hdr); err != nil {
		return nil, err
	}
	if f.dataLen > 0 {
		var last [1]byte
		if err := readFull(r, last[:], size-1); err != nil {
			return nil, formatErr("", fmt.Sprintf("truncated file: cannot read byte %d of the stated %d", size-1, size), err)
		}
	}
	return f, nil
}

// readFull reads len(p) bytes at off, accepting io.EOF with a full read.
func readFull(r io.ReaderAt, p []byte, off int64) error {
	n, err := r.ReadAt(p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return err
}

// field is one key/value pair of a JSON object, in file order.
type field struct {
	key string
	val json.RawMessage
}

// duplicateKeyError reports a key that occurs twice in one JSON object.
type duplicateKeyError struct{ key string }

func (e duplicateKeyError) Error() string { return fmt.Sprintf("duplicate key %q", e.key) }

// objectFields decodes data, which must hold one JSON object followed by
// nothing but whitespace, into its fields. A repeated key is a
// duplicateKeyError.
func objectFields(data []byte) ([]field, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		return nil, errors.New("not a JSON object")
	}
	seen := make(map[string]bool)
	var out []field
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, ok := tok.(string)
		if !ok {
			return nil, errors.New("object key is not a string")
		}
		if seen[key] {
			return nil, duplicateKeyError{key}
		}
		seen[key] = true
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, err
		}
		out = append(out, field{key, raw})
	}
	if _, err := dec.Token(); err != nil {
		return nil, err
	}
	if rest := bytes.TrimLeft(data[dec.InputOffset():], " \t\r\n"); len(rest) != 0 {
		return nil, fmt.Errorf("unexpected data after the JSON object at byte %d", len(data)-len(rest))
	}
	return out, nil
}

// stringObject decodes a JSON object whose values are all strings.
func stringObject(data []byte) (map[string]string, error) {
	fields, err := objectFields(data)
	if err != nil {
		return nil, err
	}
	m := make(map[string]string, len(fields))
	for _, fl := range fields {
		if len(fl.val) == 0 || fl.val[0] != '"' {
			return nil, fmt.Errorf("value of %q is not a string", fl.key)
		}
		var s string
		if err := json.Unmarshal(fl.val, &s); err != nil {
			return nil, fmt.Errorf("value of %q: %w", fl.key, err)
		}
		m[fl.key] = s
	}
	return m, nil
}

// uints decodes a JSON array of non-negative integers.
func uints(raw json.RawMessage) ([]uint64, error) {
	if len(raw) == 0 || raw[0] != '[' {
		return nil, errors.New("not an array")
	}
	var v []uint64
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, errors.New("not an array of non-negative integers")
	}
	return v, nil
}

// parseHeader fills f from the header bytes and validates the layout.
func (f *File) parseHeader(hdr []byte) error {
	if !utf8.Valid(hdr) {
		return formatErr("", "header is not valid UTF-8", nil)
	}
	if hdr[0] != '{' {
		return formatErr("", "header does not start with '{'", nil)
	}
	fields, err := objectFields(hdr)
	if err != nil {
		var dup duplicateKeyError
		if errors.As(err, &dup) {
			return formatErr(dup.key, "duplicate tensor name", nil)
		}
		return formatErr("", "header is not a valid JSON object", err)
	}
	f.infos = make(map[string]Info, len(fields))
	for _, fl := range fields {
		if fl.key == metadataKey {
			if string(fl.val) == "null" {
				continue
			}
			m, err := stringObject(fl.val)
			if err != nil {
				var dup duplicateKeyError
				if errors.As(err, &dup) {
					return formatErr("", fmt.Sprintf("duplicate metadata key %q", dup.key), nil)
				}
				return formatErr("", "__metadata__ must be an object of string values", err)
			}
			f.meta = m
			continue
		}
		info, err := f.parseEntry(fl.key, fl.val)
		if err != nil {
			return err
		}
		f.infos[fl.key] = info
		f.names = append(f.names, fl.key)
	}
	sort.Strings(f.names)
	if err := f.checkLayout(); err != nil {
		return err
	}
	return f.parseChecksums()
}

// parseEntry validates one tensor entry on its own.
func (f *File) parseEntry(name string, raw json.RawMessage) (Info, error) {
	fields, err := objectFields(raw)
	if err != nil {
		return Info{}, formatErr(name, "entry must be an object with dtype, shape and data_offsets", err)
	}
	var dtRaw, shapeRaw, offRaw json.RawMessage
	for _, fl := range fields {
		switch fl.key {
		case "dtype":
			dtRaw = fl.val
		case "shape":
			shapeRaw = fl.val
		case "data_offsets":
			offRaw = fl.val
		}
	}
	switch {
	case dtRaw == nil:
		return Info{}, formatErr(name, "missing dtype", nil)
	case shapeRaw == nil:
		return Info{}, formatErr(name, "missing shape", nil)
	case offRaw == nil:
		return Info{}, formatErr(name, "missing data_offsets", nil)
	}
	var dts string
	if dtRaw[0] != '"' || json.Unmarshal(dtRaw, &dts) != nil {
		return Info{}, formatErr(name, fmt.Sprintf("dtype %s is not a string", dtRaw), nil)
	}
	dt := DType(dts)
	if !dt.Valid() {
		return Info{}, formatErr(name, fmt.Sprintf("unknown dtype %q", dts), nil)
	}
	dims, err := uints(shapeRaw)
	if err != nil {
		return Info{}, formatErr(name, fmt.Sprintf("shape %s: %v", shapeRaw, err), nil)
	}
	shape := make([]int, len(dims))
	for i, d := range dims {
		if d > math.MaxInt64 {
			return Info{}, formatErr(name, fmt.Sprintf("shape %s: dimension %d is too large", shapeRaw, d), nil)
		}
		shape[i] = int(d)
	}
	offs, err := uints(offRaw)
	if err == nil && len(offs) != 2 {
		err = fmt.Errorf("has %d elements, want 2 ([begin, end])", len(offs))
	}
	if err != nil {
		return Info{}, formatErr(name, fmt.Sprintf("data_offsets %s: %v", offRaw, err), nil)
	}
	begin, end := offs[0], offs[1]
	switch {
	case end < begin:
		return Info{}, formatErr(name, fmt.Sprintf("data_offsets [%d, %d]: end before begin", begin, end), nil)
	case end > uint64(f.dataLen):
		return Info{}, formatErr(name, fmt.Sprintf("data_offsets [%d, %d] out of bounds: the data section has %d bytes", begin, end, f.dataLen), nil)
	}
	want, err := byteSize(dt, shape)
	if err != nil {
		return Info{}, formatErr(name, err.Error(), nil)
	}
	if uint64(want) != end-begin {
		return Info{}, formatErr(name, fmt.Sprintf("%s %v needs %d bytes but data_offsets [%d, %d] span %d", dt, shape, want, begin, end, end-begin), nil)
	}
	return Info{DType: dt, Shape: shape, Offset: int64(begin), Size: int64(end - begin)}, nil
}

// checkLayout checks that the tensors cover the data section exactly: in
// offset order each begins where the previous one ended, the first at 0 and
// the last ending at the end of the file.
func (f *File) checkLayout() error {
	order := slices.Clone(f.names)
	sort.SliceStable(order, func(i, j int) bool {
		a, b := f.infos[order[i]], f.infos[order[j]]
		if a.Offset != b.Offset {
			return a.Offset < b.Offset
		}
		return a.Size < b.Size
	})
	var pos int64
	prev := ""
	for _, name := range order {
		in := f.infos[name]
		switch {
		case in.Offset < pos:
			return formatErr(name, fmt.Sprintf("data_offsets [%d, %d] overlap tensor %q, which ends at %d", in.Offset, in.Offset+in.Size, prev, pos), nil)
		case in.Offset > pos && prev == "":
			return formatErr(name, fmt.Sprintf("gap in the data section: the first tensor begins at %d, not 0", in.Offset), nil)
		case in.Offset > pos:
			return formatErr(name, fmt.Sprintf("gap in the data section: bytes [%d, %d) after tensor %q belong to no tensor", pos, in.Offset, prev), nil)
		}
		if in.Size > 0 || prev == "" {
			prev = name
		}
		pos = in.Offset + in.Size
	}
	if pos != f.dataLen {
		return formatErr("", fmt.Sprintf("data section has %d bytes but the tensors cover only [0, %d)", f.dataLen, pos), nil)
	}
	return nil
}

// parseChecksums reads the ChecksumKey metadata entry, when present.
func (f *File) parseChecksums() error {
	s, ok := f.meta[ChecksumKey]
	if !ok {
		return nil
	}
	m, err := stringObject([]byte(s))
	if err != nil {
		return formatErr("", fmt.Sprintf("metadata %q must be a JSON object of hex SHA-256 strings", ChecksumKey), err)
	}
	f.sums = make(map[string][sha256.Size]byte, len(m))
	for name, h := range m {
		var sum [sha256.Size]byte
		b, err := hex.DecodeString(h)
		if err != nil || len(b) != sha256.Size {
			return formatErr(name, fmt.Sprintf("checksum %q is not a hex SHA-256", h), nil)
		}
		copy(sum[:], b)
		if _, ok := f.infos[name]; !ok {
			return formatErr(name, "checksum listed for a tensor the file does not hold", nil)
		}
		f.sums[name] = sum
	}
	for _, name := range f.names {
		if _, ok := f.sums[name]; !ok {
			return formatErr(name, fmt.Sprintf("tensor has no checksum in %q", ChecksumKey), nil)
		}
	}
	return nil
}

// Close closes the file opened by Open. It does nothing for a File made by
// Read.
func (f *File) Close() error {
	if f.closer == nil {
		return nil
	}
	c := f.closer
	f.closer = nil
	return c.Close()
}

// Names returns the tensor names in sorted order.
func (f *File) Names() []string { return slices.Clone(f.names) }

// Metadata returns a copy of the header's "__metadata__" object, including
// the ChecksumKey entry when present; it is empty (not nil) when the file
// has none.
func (f *File) Metadata() map[string]string {
	m := make(map[string]string, len(f.meta))
	for k, v := range f.meta {
		m[k] = v
	}
	return m
}

// HasChecksums reports whether the file carries loom's per-tensor checksums.
func (f *File) HasChecksums() bool { return f.sums != nil }

// Info returns the dtype, shape and byte range of the named tensor.
func (f *File) Info(name string) (Info, error) {
	in, ok := f.infos[name]
	if !ok {
		return Info{}, &Error{Path: f.path, Tensor: name, Kind: ErrNotFound, Msg: "no such tensor"}
	}
	in.Shape = slices.Clone(in.Shape)
	return in, nil
}

// Tensor reads the named tensor's data. When the file carries checksums the
// data is verified, and a mismatch is an error wrapping ErrChecksum.
func (f *File) Tensor(name string) (Tensor, error) {
	in, err := f.Info(name)
	if err != nil {
		return Tensor{}, err
	}
	data := make([]byte, in.Size)
	if err := readFull(f.r, data, f.base+in.Offset); err != nil {
		return Tensor{}, &Error{Path: f.path, Tensor: name, Kind: ErrFormat, Msg: "cannot read tensor data", Err: err}
	}
	if want, ok := f.sums[name]; ok {
		if err := f.compare(name, sha256.Sum256(data), want); err != nil {
			return Tensor{}, err
		}
	}
	return Tensor{Name: name, DType: in.DType, Shape: in.Shape, Data: data}, nil
}

func (f *File) compare(name string, got, want [sha256.Size]byte) error {
	if got == want {
		return nil
	}
	return &Error{Path: f.path, Tensor: name, Kind: ErrChecksum,
		Msg: fmt.Sprintf("checksum mismatch: data has SHA-256 %x, %s records %x", got, ChecksumKey, want)}
}

// Verify reads every tensor and checks it against its stored checksum,
// streaming the data so that memory use stays small. It returns the first
// mismatch, or nil when all match or the file has no checksums.
func (f *File) Verify() error {
	if f.sums == nil {
		return nil
	}
	for _, name := range f.names {
		in := f.infos[name]
		h := sha256.New()
		n, err := io.Copy(h, io.NewSectionReader(f.r, f.base+in.Offset, in.Size))
		if err == nil && n != in.Size {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			return &Error{Path: f.path, Tensor: name, Kind: ErrFormat, Msg: "cannot read tensor data", Err: err}
		}
		var got [sha256.Size]byte
		h.Sum(got[:0])
		if err := f.compare(name, got, f.sums[name]); err != nil {
			return err
		}
	}
	return nil
}
