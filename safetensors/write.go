package safetensors

import (
	"bufio"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Write writes tensors and metadata to w in safetensors format: tensors in
// name order, back to back, with a header padded with spaces so that the
// data section starts at a multiple of 8. The metadata gains the ChecksumKey
// entry (any value the caller passes under that key is replaced), so Write
// always emits a "__metadata__" object. Tensors are validated first, with
// Tensor.Validate and for duplicate names, and nothing is written when one
// is invalid.
func Write(w io.Writer, tensors []Tensor, metadata map[string]string) error {
	hdr, order, err := encodeHeader(tensors, metadata)
	if err != nil {
		return err
	}
	var lenBuf [8]byte
	binary.LittleEndian.PutUint64(lenBuf[:], uint64(len(hdr)))
	if _, err := w.Write(lenBuf[:]); err != nil {
		return err
	}
	if _, err := w.Write(hdr); err != nil {
		return err
	}
	for _, i := range order {
		if len(tensors[i].Data) == 0 {
			continue
		}
		if _, err := w.Write(tensors[i].Data); err != nil {
			return err
		}
	}
	return nil
}

// encodeHeader validates the input and returns the padded header and the
// tensor indices in name order.
func encodeHeader(tensors []Tensor, metadata map[string]string) ([]byte, []int, error) {
	order := make([]int, len(tensors))
	for i, t := range tensors {
		if err := t.Validate(); err != nil {
			return nil, nil, err
		}
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int { return strings.Compare(tensors[a].Name, tensors[b].Name) })
	for k := 1; k < len(order); k++ {
		if tensors[order[k]].Name == tensors[order[k-1]].Name {
			return nil, nil, invalidErr(tensors[order[k]].Name, "duplicate tensor name")
		}
	}
	meta := make(map[string]string, len(metadata)+1)
	for k, v := range metadata {
		if !utf8.ValidString(k) || !utf8.ValidString(v) {
			return nil, nil, invalidErr("", fmt.Sprintf("metadata entry %q is not valid UTF-8", k))
		}
		meta[k] = v
	}
	var sums []byte
	sums = append(sums, '{')
	for k, i := range order {
		if k > 0 {
			sums = append(sums, ',')
		}
		sum := sha256.Sum256(tensors[i].Data)
		sums = appendQuoted(sums, tensors[i].Name)
		sums = append(sums, ':', '"')
		sums = hex.AppendEncode(sums, sum[:])
		sums = append(sums, '"')
	}
	sums = append(sums, '}')
	meta[ChecksumKey] = string(sums)

	keys := make([]string, 0, len(meta))
	for k := range meta {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	h := []byte(`{"__metadata__":{`)
	for k, key := range keys {
		if k > 0 {
			h = append(h, ',')
		}
		h = appendQuoted(h, key)
		h = append(h, ':')
		h = appendQuoted(h, meta[key])
	}
	h = append(h, '}')
	var off int
	for _, i := range order {
		t := tensors[i]
		h = append(h, ',')
		h = appendQuoted(h, t.Name)
		h = append(h, `:{"dtype":`...)
		h = appendQuoted(h, string(t.DType))
		h = append(h, `,"shape":[`...)
		for k, d := range t.Shape {
			if k > 0 {
				h = append(h, ',')
			}
			h = strconv.AppendInt(h, int64(d), 10)
		}
		h = append(h, `],"data_offsets":[`...)
		h = strconv.AppendInt(h, int64(off), 10)
		h = append(h, ',')
		off += len(t.Data)
		h = strconv.AppendInt(h, int64(off), 10)
		h = append(h, "]}"...)
	}
	h = append(h, '}')
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	if len(h) > MaxHeaderSize {
		return nil, nil, invalidErr("", fmt.Sprintf("header of %d bytes exceeds the %d-byte limit", len(h), MaxHeaderSize))
	}
	return h, order, nil
}

// appendQuoted appends s, which must be valid UTF-8, as a JSON string. Only
// '"', '\\' and control characters are escaped.
func appendQuoted(b []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c == '\n':
			b = append(b, '\\', 'n')
		case c == '\r':
			b = append(b, '\\', 'r')
		case c == '\t':
			b = append(b, '\\', 't')
		case c < 0x20:
			b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

// WriteFile writes tensors and metadata to path atomically: it writes a
// staging file in the same folder (named "."+base+".tmp-"+digits), syncs it,
// and renames it over path, then syncs the folder. On any error the staging
// file is removed and an existing file at path is left untouched. The new
// file has mode 0644. Staging files of earlier writes to path whose writer
// died mid-write (a SIGKILL, a crash) are removed; those of live concurrent
// writers are not (see the package documentation).
func WriteFile(path string, tensors []Tensor, metadata map[string]string) error {
	// Validate before touching the file system.
	if _, _, err := encodeHeader(tensors, metadata); err != nil {
		return withPath(err, path)
	}
	return atomicWrite(path, func(w io.Writer) error { return Write(w, tensors, metadata) })
}

// atomicWrite runs write on a buffered, locked staging file beside path and
// renames the file to path when write, the flush and the sync succeed.
func atomicWrite(path string, write func(io.Writer) error) (err error) {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	tmp, err := createStaging(dir, base)
	if err != nil {
		return fmt.Errorf("safetensors: %s: %w", path, err)
	}
	// Before this write fills the disk, free what interrupted writes left.
	removeStale(dir, base, filepath.Base(tmp.Name()))
	defer func() {
		if err != nil {
			// Abandoning the staging file is tidying; err is the failure.
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
			err = fmt.Errorf("safetensors: %s: %w", path, err)
		}
	}()
	bw := bufio.NewWriterSize(tmp, 1<<20)
	if err := write(bw); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return err
	}
	if !canLock {
		// Without locks, close first: some systems cannot rename an open
		// file.
		if err := tmp.Close(); err != nil {
			return err
		}
		return renameInto(tmp.Name(), path, dir)
	}
	// Rename while still holding the lock, so that no other writer's
	// removeStale takes the finished file for an abandoned one.
	if err := renameInto(tmp.Name(), path, dir); err != nil {
		return err
	}
	// The data is synced and in place, so Close, which only releases the
	// lock now, cannot lose anything: reporting its error would call a
	// finished write failed.
	_ = tmp.Close()
	return nil
}

// renameInto renames the staging file to path and makes it durable.
func renameInto(staging, path, dir string) error {
	if err := os.Rename(staging, path); err != nil {
		return err
	}
	syncDir(dir)
	return nil
}

// syncDir makes a rename in dir durable. It is best effort: the rename has
// already happened, and some file systems cannot sync a folder.
func syncDir(dir string) {
	d, err := os.Open(dir)
	if err != nil {
		return
	}
	_ = d.Sync()  // an error leaves nothing to undo: the file itself was synced
	_ = d.Close() // read only: closing loses nothing
}
