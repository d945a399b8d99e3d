package train

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// TokenFormat is how a token file stores its tokens.
type TokenFormat int

const (
	// FormatAuto decides from the file: llm.c's header magic gives
	// FormatLLMC, else a name ending in .bin gives FormatUint16, else
	// FormatBytes.
	FormatAuto TokenFormat = iota
	// FormatBytes is a text (or any) file read as one token per byte, for
	// a vocabulary of 256 such as the tiny GPT's.
	FormatBytes
	// FormatUint16 is nanoGPT's train.bin/val.bin: raw little-endian
	// uint16 tokens, no header.
	FormatUint16
	// FormatLLMC is llm.c's token file: a header of 256 little-endian
	// int32 (magic 20240520, version 1, the token count) and then the
	// count's little-endian uint16 tokens.
	FormatLLMC
)

// String names the format as the errors do.
func (f TokenFormat) String() string {
	switch f {
	case FormatAuto:
		return "auto"
	case FormatBytes:
		return "bytes"
	case FormatUint16:
		return "uint16"
	case FormatLLMC:
		return "llm.c"
	}
	return fmt.Sprintf("TokenFormat(%d)", int(f))
}

// llm.c's data loader header (dev/data/data_common.py write_datafile).
const (
	llmcMagic      = 20240520
	llmcVersion    = 1
	llmcHeaderSize = 256 * 4
)

// scanChunk is the bytes OpenTokens reads at a time to check every token:
// the file is never held in memory whole.
const scanChunk = 1 << 20

// ErrTokenFile marks a token file that OpenTokens refuses (a bad header,
// a truncated body, a token outside the vocabulary); errors.Is matches
// it with ErrInvalid and loom.ErrInvalid too.
var ErrTokenFile = loom.NewSentinel("train: bad token file", ErrInvalid, loom.ErrInvalid)

// TokenFile is an open token file: its tokens are read where they lie
// with positioned reads (pread), so a file of many GB costs no memory
// beyond the rows being read and the operating system's page cache; it is
// not memory-mapped, which keeps it portable and its reads checked. Read
// is safe for concurrent use (in-process ranks may share one TokenFile).
type TokenFile struct {
	path   string
	f      *os.File
	format TokenFormat
	base   int64 // byte offset of token 0
	width  int   // bytes per token: 1 or 2
	n      int   // tokens
	vocab  int
}

// TokenOption configures OpenTokens.
type TokenOption func(*tokenConfig)

type tokenConfig struct{ format TokenFormat }

// WithFormat reads the file as format f instead of detecting it
// (FormatAuto, the default).
func WithFormat(f TokenFormat) TokenOption { return func(c *tokenConfig) { c.format = f } }

// OpenTokens opens the token file at path for a model of vocab tokens
// (at least 1; a byte file's tokens are below 256 whatever vocab says,
// so vocab below 256 checks them too). It detects the format (see
// FormatAuto), checks the header and the length, and reads the whole file
// once, in chunks of 1 MiB, to check that every token is below vocab.
// A refused file is an error wrapping ErrTokenFile that names the file
// and the byte offset of the fault; a bad argument wraps ErrInvalid.
// Close the file when done.
func OpenTokens(path string, vocab int, opts ...TokenOption) (*TokenFile, error) {
	const op = "train: OpenTokens"
	c := tokenConfig{}
	for _, o := range opts {
		o(&c)
	}
	if err := numcheck.Count(ErrInvalid, "vocabulary", vocab); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if c.format < FormatAuto || c.format > FormatLLMC {
		return nil, fmt.Errorf("%s: %w: format %v", op, ErrInvalid, c.format)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	t, err := openTokens(f, path, vocab, c.format)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return t, nil
}

func openTokens(f *os.File, path string, vocab int, format TokenFormat) (*TokenFile, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	size := st.Size()
	bad := func(off int64, format string, args ...any) error {
		return fmt.Errorf("%w: %s: byte offset %d: %s", ErrTokenFile, path, off, fmt.Sprintf(format, args...))
	}
	var hdr [llmcHeaderSize]byte
	nh, err := f.ReadAt(hdr[:], 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	word := func(i int) int32 { return int32(binary.LittleEndian.Uint32(hdr[4*i:])) }
	if format == FormatAuto {
		switch {
		case nh >= 4 && word(0) == llmcMagic:
			format = FormatLLMC
		case strings.EqualFold(filepath.Ext(path), ".bin"):
			format = FormatUint16
		default:
			format = FormatBytes
		}
	}
	t := &TokenFile{path: path, f: f, format: format, vocab: vocab, width: 2}
	switch format {
	case FormatBytes:
		t.width, t.n = 1, int(size)
	case FormatUint16:
		if size%2 != 0 {
			return nil, bad(size-1, "%d bytes is not a whole number of uint16 tokens (truncated?)", size)
		}
		t.n = int(size / 2)
	case FormatLLMC:
		if nh < llmcHeaderSize {
			return nil, bad(int64(nh), "the file ends inside llm.c's %d-byte header", llmcHeaderSize)
		}
		if m := word(0); m != llmcMagic {
			return nil, bad(0, "magic %d; llm.c's token files start with %d", m, llmcMagic)
		}
		if v := word(1); v != llmcVersion {
			return nil, bad(4, "llm.c version %d; only version %d (uint16 tokens) is read", v, llmcVersion)
		}
		n := int64(word(2))
		if n < 0 || llmcHeaderSize+2*n != size {
			return nil, bad(8, "the header counts %d tokens (%d bytes with the header) but the file has %d bytes (truncated?)", n, llmcHeaderSize+2*n, size)
		}
		t.base, t.n = llmcHeaderSize, int(n)
	}
	if t.n < 1 {
		return nil, bad(t.base, "no tokens")
	}
	if err := t.scan(); err != nil {
		return nil, err
	}
	return t, nil
}

// scan checks every token against the vocabulary, a chunk at a time,
// on the raw bytes (decoding to int64 first halves its speed).
func (t *TokenFile) scan() error {
	if t.vocab >= 1<<(8*t.width) {
		return nil // every value of the width is a token
	}
	buf := make([]byte, scanChunk)
	total := int64(t.n) * int64(t.width)
	for pos := int64(0); pos < total; pos += scanChunk {
		b := buf[:min(scanChunk, total-pos)]
		off := t.base + pos
		if _, err := t.f.ReadAt(b, off); err != nil {
			return fmt.Errorf("%s: byte offset %d: %w", t.path, off, err)
		}
		for i := 0; i < len(b); i += t.width {
			v := int(b[i])
			if t.width == 2 {
				v |= int(b[i+1]) << 8
			}
			if v >= t.vocab {
				return fmt.Errorf("%w: %s: byte offset %d: token %d is not below the vocabulary of %d", ErrTokenFile, t.path, off+int64(i), v, t.vocab)
			}
		}
	}
	return nil
}

// Path is the file's path as given to OpenTokens.
func (t *TokenFile) Path() string { return t.path }

// Format is the file's format (never FormatAuto).
func (t *TokenFile) Format() TokenFormat { return t.format }

// Len is the number of tokens.
func (t *TokenFile) Len() int { return t.n }

// Vocab is the vocabulary the tokens were checked against.
func (t *TokenFile) Vocab() int { return t.vocab }

// Read fills dst with the tokens [start, start+len(dst)). A range outside
// the file wraps ErrInvalid; a token at or above the vocabulary (the file
// changed since OpenTokens) wraps ErrTokenFile and names the offset.
func (t *TokenFile) Read(dst []int64, start int) error {
	if start < 0 || len(dst) > t.n-start {
		return fmt.Errorf("%w: TokenFile.Read: %s: tokens [%d, %d) of %d", ErrInvalid, t.path, start, start+len(dst), t.n)
	}
	if err := t.read(dst, start, make([]byte, len(dst)*t.width)); err != nil {
		return fmt.Errorf("train: TokenFile.Read: %w", err)
	}
	return nil
}

// read decodes tokens [start, start+len(dst)) through buf (at least
// len(dst)·width bytes) and checks them against the vocabulary.
func (t *TokenFile) read(dst []int64, start int, buf []byte) error {
	off := t.base + int64(start)*int64(t.width)
	buf = buf[:len(dst)*t.width]
	if _, err := t.f.ReadAt(buf, off); err != nil {
		return fmt.Errorf("%s: byte offset %d: %w", t.path, off, err)
	}
	for i := range dst {
		var v int64
		if t.width == 1 {
			v = int64(buf[i])
		} else {
			v = int64(binary.LittleEndian.Uint16(buf[2*i:]))
		}
		if v >= int64(t.vocab) {
			return fmt.Errorf("%w: %s: byte offset %d: token %d is not below the vocabulary of %d", ErrTokenFile, t.path, off+int64(i*t.width), v, t.vocab)
		}
		dst[i] = v
	}
	return nil
}

// Close closes the file.
func (t *TokenFile) Close() error { return t.f.Close() }
