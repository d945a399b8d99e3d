package safetensors

import (
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strings"
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

// entry is one tensor of a File.
type entry struct {
	name string
	info Info
}

// File is an opened safetensors file whose header has been parsed and
// validated. Tensor data stays in the underlying reader until a tensor is
// requested. A File is safe for concurrent use if its reader is.
type File struct {
	r       io.ReaderAt
	closer  io.Closer
	path    string
	base    int64   // file offset of the data section
	entries []entry // sorted by name
	meta    map[string]string
	sums    [][sha256.Size]byte // entries[i]'s checksum; nil when the file has none
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
// Memory is allocated only for bytes r has shown it holds (not for size or
// the stated header length alone), and parsing takes time and memory
// linear in the header's length.
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
	hdr, err := readHeader(r, int(n))
	if err != nil {
		return nil, formatErr("", fmt.Sprintf("truncated file: cannot read the %d-byte header", n), err)
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

// readHeader reads the n header bytes that follow the length field. It
// first reads the header's last byte, so that a reader holding less than
// the length field says fails before the header's memory is allocated.
func readHeader(r io.ReaderAt, n int) ([]byte, error) {
	var last [1]byte
	if err := readFull(r, last[:], 8+int64(n)-1); err != nil {
		return nil, err
	}
	hdr := make([]byte, n)
	if err := readFull(r, hdr, 8); err != nil {
		return nil, err
	}
	return hdr, nil
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

// checkName reports what makes name unusable as a tensor name, or "" when
// it is fine. Write (through Tensor.Validate) and Read both use it, so a
// file Read accepts can be written back.
func checkName(name string) string {
	switch {
	case name == "":
		return "empty tensor name"
	case !utf8.ValidString(name):
		return "name is not valid UTF-8"
	case name == metadataKey:
		return "name is reserved for metadata"
	}
	return ""
}

// parseHeader fills f from the header bytes and validates the layout.
func (f *File) parseHeader(hdr []byte) error {
	if !utf8.Valid(hdr) {
		return formatErr("", "header is not valid UTF-8", nil)
	}
	if hdr[0] != '{' {
		return formatErr("", "header does not start with '{'", nil)
	}
	p := headerParser{s: scanner{b: hdr}, dataLen: f.dataLen}
	if err := p.parse(); err != nil {
		var se *syntaxError
		if errors.As(err, &se) {
			return formatErr("", "header is not a valid JSON object", err)
		}
		return err
	}
	f.meta = p.meta
	f.entries = p.entries
	// One string holds every name, so that the names cost one allocation.
	all := string(p.names)
	begin := 0
	for k, end := range p.nameEnds {
		f.entries[k].name = all[begin:end]
		begin = end
	}
	for _, e := range f.entries {
		if msg := checkName(e.name); msg != "" {
			return formatErr(e.name, msg, nil)
		}
	}
	// Writers list tensors in name order, so this usually sorts nothing.
	byName := func(a, b entry) int { return strings.Compare(a.name, b.name) }
	if !slices.IsSortedFunc(f.entries, byName) {
		slices.SortFunc(f.entries, byName)
	}
	for k := 1; k < len(f.entries); k++ {
		if f.entries[k].name == f.entries[k-1].name {
			return formatErr(f.entries[k].name, "duplicate tensor name", nil)
		}
	}
	if err := f.checkLayout(); err != nil {
		return err
	}
	return f.parseChecksums(p.sumsText)
}

// headerParser holds the state of one header's parse.
type headerParser struct {
	s        scanner
	dataLen  int64
	names    []byte // every tensor name, back to back
	nameEnds []int  // where entries[i]'s name ends in names
	entries  []entry
	dims     []int // the block that shapes are cut from
	meta     map[string]string
	metaSeen bool
	sumsText []byte // the ChecksumKey metadata value; nil when there is none
	// Scratch buffers, one per use, so that nested scans do not clobber
	// each other.
	key, field, mkey, mval, dtype []byte
	nums                          []uint64
}

// parse reads the top-level object.
func (p *headerParser) parse() error {
	var err error
	p.key, err = p.s.object(p.key, func(key []byte) error {
		if string(key) == metadataKey {
			return p.metadata()
		}
		return p.entry(key)
	})
	if err != nil {
		return err
	}
	p.s.ws()
	if p.s.i != len(p.s.b) {
		return formatErr("", fmt.Sprintf("unexpected data after the JSON object at byte %d", p.s.i), nil)
	}
	return nil
}

// metadata reads the "__metadata__" value: null or an object of strings.
func (p *headerParser) metadata() error {
	if p.metaSeen {
		return formatErr(metadataKey, "duplicate key", nil)
	}
	p.metaSeen = true
	const what = "__metadata__ must be an object of string values"
	if p.s.peek() != '{' {
		raw, err := p.s.rawValue()
		switch {
		case err != nil:
			return err
		case string(raw) == "null":
			return nil
		}
		return formatErr("", what, fmt.Errorf("found %s", clip(raw)))
	}
	p.meta = make(map[string]string)
	var err error
	p.mkey, err = p.s.object(p.mkey, func(key []byte) error {
		if _, dup := p.meta[string(key)]; dup {
			return formatErr("", fmt.Sprintf("duplicate metadata key %q", key), nil)
		}
		if p.s.peek() != '"' {
			if _, err := p.s.rawValue(); err != nil {
				return err
			}
			return formatErr("", what, fmt.Errorf("value of %q is not a string", key))
		}
		var err error
		if p.mval, err = p.s.str(p.mval[:0]); err != nil {
			return err
		}
		if string(key) == ChecksumKey {
			p.sumsText = slices.Clone(p.mval)
		}
		p.meta[string(key)] = string(p.mval)
		return nil
	})
	return err
}

// entry reads one tensor's entry; name is its key. The entry's fields are
// collected first and checked in a fixed order afterwards, so that the
// first problem reported does not depend on the order of the fields.
func (p *headerParser) entry(name []byte) error {
	start := len(p.names)
	p.names = append(grow(p.names, len(name)), name...)
	p.nameEnds = append(grow(p.nameEnds, 1), len(p.names))
	tensor := func() string { return string(p.names[start:]) }
	if p.s.peek() != '{' {
		raw, err := p.s.rawValue()
		if err != nil {
			return err
		}
		return formatErr(tensor(), "entry must be an object with dtype, shape and data_offsets", fmt.Errorf("found %s", clip(raw)))
	}
	var dtRaw, shapeRaw, offRaw []byte
	var others map[string]bool // keys other than the three, to find duplicates
	var err error
	p.field, err = p.s.object(p.field, func(key []byte) error {
		var dst *[]byte
		switch string(key) {
		case "dtype":
			dst = &dtRaw
		case "shape":
			dst = &shapeRaw
		case "data_offsets":
			dst = &offRaw
		default:
			if others[string(key)] {
				return formatErr(tensor(), "entry must be an object with dtype, shape and data_offsets", fmt.Errorf("duplicate key %q", key))
			}
			if others == nil {
				others = make(map[string]bool)
			}
			others[string(key)] = true
			return p.s.skip(2)
		}
		if *dst != nil {
			return formatErr(tensor(), "entry must be an object with dtype, shape and data_offsets", fmt.Errorf("duplicate key %q", key))
		}
		raw, err := p.s.rawValue()
		*dst = raw
		return err
	})
	if err != nil {
		return err
	}
	info, err := p.check(dtRaw, shapeRaw, offRaw)
	if err != nil {
		return formatErr(tensor(), err.Error(), nil)
	}
	p.entries = append(grow(p.entries, 1), entry{info: info})
	return nil
}

// grow makes room for n more elements in s, doubling its capacity when it
// must grow (append grows large slices by only 1.25×, which for the
// per-tensor slices of a large header would allocate about 5 times their
// final size in all).
func grow[T any](s []T, n int) []T {
	if cap(s)-len(s) >= n {
		return s
	}
	t := make([]T, len(s), max(2*cap(s), len(s)+n, 16))
	copy(t, s)
	return t
}

// check validates an entry's fields, given as their JSON text (nil when
// missing).
func (p *headerParser) check(dtRaw, shapeRaw, offRaw []byte) (Info, error) {
	switch {
	case dtRaw == nil:
		return Info{}, errors.New("missing dtype")
	case shapeRaw == nil:
		return Info{}, errors.New("missing shape")
	case offRaw == nil:
		return Info{}, errors.New("missing data_offsets")
	}
	if dtRaw[0] != '"' {
		return Info{}, fmt.Errorf("dtype %s is not a string", clip(dtRaw))
	}
	var err error
	sub := scanner{b: dtRaw}
	if p.dtype, err = sub.str(p.dtype[:0]); err != nil {
		return Info{}, err // cannot happen: the value was scanned already
	}
	dt := dtypeOf(p.dtype)
	if dt == "" {
		return Info{}, fmt.Errorf("unknown dtype %q", p.dtype)
	}
	dims, err := p.uintList("shape", shapeRaw)
	if err != nil {
		return Info{}, err
	}
	for _, d := range dims {
		if d > math.MaxInt64 {
			return Info{}, fmt.Errorf("shape %s: dimension %d is too large", clip(shapeRaw), d)
		}
	}
	shape := p.shape(dims)
	offs, err := p.uintList("data_offsets", offRaw)
	if err == nil && len(offs) != 2 {
		err = fmt.Errorf("data_offsets %s: has %d elements, want 2 ([begin, end])", clip(offRaw), len(offs))
	}
	if err != nil {
		return Info{}, err
	}
	begin, end := offs[0], offs[1]
	switch {
	case end < begin:
		return Info{}, fmt.Errorf("data_offsets [%d, %d]: end before begin", begin, end)
	case end > uint64(p.dataLen):
		return Info{}, fmt.Errorf("data_offsets [%d, %d] out of bounds: the data section has %d bytes", begin, end, p.dataLen)
	}
	want, err := byteSize(dt, shape)
	if err != nil {
		return Info{}, err
	}
	if uint64(want) != end-begin {
		return Info{}, fmt.Errorf("%s %v needs %d bytes but data_offsets [%d, %d] span %d", dt, shape, want, begin, end, end-begin)
	}
	return Info{DType: dt, Shape: shape, Offset: int64(begin), Size: int64(end - begin)}, nil
}

// uintList parses raw, the text of field, as an array of non-negative
// integers, into a scratch slice that the next call reuses.
func (p *headerParser) uintList(field string, raw []byte) ([]uint64, error) {
	sub := scanner{b: raw}
	var ok bool
	if p.nums, ok = sub.uints(p.nums[:0]); ok {
		return p.nums, nil
	}
	if raw[0] != '[' {
		return nil, fmt.Errorf("%s %s: not an array", field, clip(raw))
	}
	return nil, fmt.Errorf("%s %s: not an array of non-negative integers", field, clip(raw))
}

// shapeBlock is how many dimensions shapes take from one allocation.
const shapeBlock = 4096

// shape copies dims into the current block of p.dims and returns them as a
// shape whose capacity ends at its length, so that appending to it cannot
// reach a neighbour's dimensions.
func (p *headerParser) shape(dims []uint64) []int {
	if p.dims == nil || cap(p.dims)-len(p.dims) < len(dims) {
		p.dims = make([]int, 0, max(shapeBlock, len(dims)))
	}
	n := len(p.dims)
	for _, d := range dims {
		p.dims = append(p.dims, int(d))
	}
	return p.dims[n:len(p.dims):len(p.dims)]
}

// dtypeOf returns the DType spelled b, or "" for none.
func dtypeOf(b []byte) DType {
	switch string(b) {
	case string(BOOL):
		return BOOL
	case string(U8):
		return U8
	case string(I8):
		return I8
	case string(F8E5M2):
		return F8E5M2
	case string(F8E4M3):
		return F8E4M3
	case string(F8E8M0):
		return F8E8M0
	case string(I16):
		return I16
	case string(U16):
		return U16
	case string(F16):
		return F16
	case string(BF16):
		return BF16
	case string(I32):
		return I32
	case string(U32):
		return U32
	case string(F32):
		return F32
	case string(C64):
		return C64
	case string(F64):
		return F64
	case string(I64):
		return I64
	case string(U64):
		return U64
	}
	return ""
}

// clip returns a JSON value's text for an error message, cut at 64 bytes.
func clip(raw []byte) string {
	const limit = 64
	if len(raw) <= limit {
		return string(raw)
	}
	cut := limit
	for cut > 0 && !utf8.RuneStart(raw[cut]) {
		cut--
	}
	return string(raw[:cut]) + "…"
}

// checkLayout checks that the tensors cover the data section exactly: in
// offset order each begins where the previous one ended, the first at 0 and
// the last ending at the end of the file.
func (f *File) checkLayout() error {
	byPos := func(a, b *entry) int {
		if c := cmp.Compare(a.info.Offset, b.info.Offset); c != 0 {
			return c
		}
		return cmp.Compare(a.info.Size, b.info.Size)
	}
	at := func(k int) *entry { return &f.entries[k] }
	for k := 1; k < len(f.entries); k++ {
		if byPos(at(k-1), at(k)) > 0 {
			// Offsets are not in name order (loom writes them so): sort an
			// index, stably, so that ties keep name order.
			order := make([]int32, len(f.entries))
			for i := range order {
				order[i] = int32(i)
			}
			slices.SortStableFunc(order, func(a, b int32) int { return byPos(&f.entries[a], &f.entries[b]) })
			at = func(k int) *entry { return &f.entries[order[k]] }
			break
		}
	}
	var pos int64
	prev := ""
	for k := range f.entries {
		e := at(k)
		in := e.info
		switch {
		case in.Offset < pos:
			return formatErr(e.name, fmt.Sprintf("data_offsets [%d, %d] overlap tensor %q, which ends at %d", in.Offset, in.Offset+in.Size, prev, pos), nil)
		case in.Offset > pos && prev == "":
			return formatErr(e.name, fmt.Sprintf("gap in the data section: the first tensor begins at %d, not 0", in.Offset), nil)
		case in.Offset > pos:
			return formatErr(e.name, fmt.Sprintf("gap in the data section: bytes [%d, %d) after tensor %q belong to no tensor", pos, in.Offset, prev), nil)
		}
		if in.Size > 0 || prev == "" {
			prev = e.name
		}
		pos = in.Offset + in.Size
	}
	if pos != f.dataLen {
		return formatErr("", fmt.Sprintf("data section has %d bytes but the tensors cover only [0, %d)", f.dataLen, pos), nil)
	}
	return nil
}

// parseChecksums reads text, the ChecksumKey metadata value (nil when the
// file has none): a JSON object mapping every tensor name to its hex
// SHA-256.
func (f *File) parseChecksums(text []byte) error {
	if text == nil {
		return nil
	}
	what := fmt.Sprintf("metadata %q must be a JSON object of hex SHA-256 strings", ChecksumKey)
	f.sums = make([][sha256.Size]byte, len(f.entries))
	have := make([]bool, len(f.entries))
	s := scanner{b: text}
	s.ws()
	next := 0 // loom lists the sums in name order: try the next entry first
	var val []byte
	_, err := s.object(nil, func(key []byte) error {
		if s.peek() != '"' {
			if _, err := s.rawValue(); err != nil {
				return err
			}
			return formatErr("", what, fmt.Errorf("value of %q is not a string", key))
		}
		var err error
		if val, err = s.str(val[:0]); err != nil {
			return err
		}
		var sum [sha256.Size]byte
		if len(val) != 2*sha256.Size {
			return formatErr(string(key), fmt.Sprintf("checksum %q is not a hex SHA-256", val), nil)
		}
		if _, err := hex.Decode(sum[:], val); err != nil {
			return formatErr(string(key), fmt.Sprintf("checksum %q is not a hex SHA-256", val), nil)
		}
		k := next
		if k >= len(f.entries) || f.entries[k].name != string(key) {
			var found bool
			if k, found = f.find(string(key)); !found {
				return formatErr(string(key), "checksum listed for a tensor the file does not hold", nil)
			}
		}
		if have[k] {
			return formatErr("", what, fmt.Errorf("duplicate key %q", key))
		}
		have[k], f.sums[k], next = true, sum, k+1
		return nil
	})
	if err == nil {
		if s.ws(); s.i != len(s.b) {
			err = s.errAt(s.i, "unexpected data after the object")
		}
	}
	if err != nil {
		var se *syntaxError
		if errors.As(err, &se) {
			return formatErr("", what, err)
		}
		return err
	}
	for k, ok := range have {
		if !ok {
			return formatErr(f.entries[k].name, fmt.Sprintf("tensor has no checksum in %q", ChecksumKey), nil)
		}
	}
	return nil
}

// find returns the index of the named tensor in f.entries.
func (f *File) find(name string) (int, bool) {
	return slices.BinarySearchFunc(f.entries, name, func(e entry, name string) int { return strings.Compare(e.name, name) })
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
func (f *File) Names() []string {
	names := make([]string, len(f.entries))
	for k, e := range f.entries {
		names[k] = e.name
	}
	return names
}

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
	k, ok := f.find(name)
	if !ok {
		return Info{}, &Error{Path: f.path, Tensor: name, Kind: ErrNotFound, Msg: "no such tensor"}
	}
	in := f.entries[k].info
	in.Shape = slices.Clone(in.Shape)
	return in, nil
}

// Tensor reads the named tensor's data. When the file carries checksums the
// data is verified, and a mismatch is an error wrapping ErrChecksum.
func (f *File) Tensor(name string) (Tensor, error) {
	k, ok := f.find(name)
	if !ok {
		return Tensor{}, &Error{Path: f.path, Tensor: name, Kind: ErrNotFound, Msg: "no such tensor"}
	}
	in := f.entries[k].info
	data := make([]byte, in.Size)
	if err := readFull(f.r, data, f.base+in.Offset); err != nil {
		return Tensor{}, &Error{Path: f.path, Tensor: name, Kind: ErrFormat, Msg: "cannot read tensor data", Err: err}
	}
	if f.sums != nil {
		if err := f.compare(name, sha256.Sum256(data), f.sums[k]); err != nil {
			return Tensor{}, err
		}
	}
	return Tensor{Name: name, DType: in.DType, Shape: slices.Clone(in.Shape), Data: data}, nil
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
	for k, e := range f.entries {
		name, in := e.name, e.info
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
		if err := f.compare(name, got, f.sums[k]); err != nil {
			return err
		}
	}
	return nil
}
