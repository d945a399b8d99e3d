package safetensors

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"os"
	"strings"
	"testing"
)

// rawFile builds a file from a header string and a data section, with the
// header length taken from the header.
func rawFile(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	b = append(b, header...)
	return append(b, data...)
}

// readBytes parses b as a whole file.
func readBytes(b []byte) (*File, error) { return Read(bytes.NewReader(b), int64(len(b))) }

// encodeAll writes tensors and metadata to memory.
func encodeAll(t testing.TB, tensors []Tensor, meta map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Write(&buf, tensors, meta); err != nil {
		t.Fatalf("Write: %v", err)
	}
	return buf.Bytes()
}

// wantErr checks that err wraps kind and mentions every fragment.
func wantErr(t *testing.T, err, kind error, fragments ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %v mentioning %q", kind, fragments)
	}
	if !errors.Is(err, kind) {
		t.Errorf("error %q does not wrap %v", err, kind)
	}
	var e *Error
	if !errors.As(err, &e) {
		t.Errorf("error %q is a %T, not an *Error", err, err)
	}
	for _, f := range fragments {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error %q does not mention %q", err, f)
		}
	}
}

// filler returns n deterministic bytes.
func filler(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131) ^ seed
	}
	return b
}

func sha256Hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func writeRaw(t *testing.T, path string, b []byte) {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}
