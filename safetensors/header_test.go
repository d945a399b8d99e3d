package safetensors

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// largeHeaderFile returns a file of n one-byte U8 tensors, listed in the
// header in reverse name order with offsets in name order, so that Read has
// to sort both ways, and its header length.
func largeHeaderFile(n int) ([]byte, int) {
	name := func(h []byte, i int) []byte {
		h = append(h, `"model.layers.w`...)
		h = strconv.AppendInt(h, int64(1_000_000_000+i), 10)
		return append(h, '"')
	}
	h := []byte(`{"__metadata__":{"format":"pt"}`)
	for i := n - 1; i >= 0; i-- {
		h = append(h, ',')
		h = name(h, i)
		h = append(h, `:{"dtype":"U8","shape":[1],"data_offsets":[`...)
		h = strconv.AppendInt(h, int64(i), 10)
		h = append(h, ',')
		h = strconv.AppendInt(h, int64(i+1), 10)
		h = append(h, "]}"...)
	}
	h = append(h, '}')
	return rawFile(string(h), make([]byte, n)), len(h)
}

// allocated returns the bytes f allocates on the heap (in all goroutines:
// the caller must be the only one allocating).
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// TestReadLargeHeaderBoundedMemory checks that parsing a header of 200,000
// entries allocates a small multiple of the header's size (it allocated 40
// times the header, 620 MB for 16 MB, before the header had its own
// scanner).
func TestReadLargeHeaderBoundedMemory(t *testing.T) {
	n := 200_000
	if testing.Short() {
		n = 50_000
	}
	b, hdrLen := largeHeaderFile(n)
	var f *File
	var err error
	start := time.Now()
	alloc := allocated(func() { f, err = readBytes(b) })
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(f.Names()); got != n {
		t.Fatalf("%d tensors, want %d", got, n)
	}
	t.Logf("%d entries, %d-byte header: %v, %d bytes allocated (%.1f× the header)", n, hdrLen, elapsed, alloc, float64(alloc)/float64(hdrLen))
	if limit := uint64(6 * hdrLen); alloc > limit {
		t.Errorf("Read allocated %d bytes for a %d-byte header, want at most %d (6×)", alloc, hdrLen, limit)
	}
}

// BenchmarkReadLargeHeader opens a file whose header holds one million
// entries (about 80 MB).
func BenchmarkReadLargeHeader(b *testing.B) {
	file, hdrLen := largeHeaderFile(1_000_000)
	b.SetBytes(int64(hdrLen))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := readBytes(file); err != nil {
			b.Fatal(err)
		}
	}
}

// liar is a 10-byte reader that claims to be 1 GiB long: its header
// length field says 94,000,000 bytes, and only "{}" follows.
type liar struct{}

func (liar) ReadAt(p []byte, off int64) (int, error) {
	b := append(binary.LittleEndian.AppendUint64(nil, 94_000_000), "{}"...)
	if off >= int64(len(b)) {
		return 0, errors.New("liar: nothing there")
	}
	n := copy(p, b[off:])
	if n < len(p) {
		return n, errors.New("liar: nothing there")
	}
	return n, nil
}

// TestReadTrustsOnlyBytesRead checks that a stated size and header length
// larger than what the reader holds do not make Read allocate them: it
// allocated 94 MB for this 10-byte reader.
func TestReadTrustsOnlyBytesRead(t *testing.T) {
	var err error
	alloc := allocated(func() { _, err = Read(liar{}, 1<<30) })
	wantErr(t, err, ErrFormat, "truncated file")
	if alloc > 1<<20 {
		t.Errorf("Read of a 10-byte reader allocated %d bytes, want under 1 MiB", alloc)
	}
}

// TestReadRejectsInvalidStrings checks that JSON strings which do not
// encode valid Unicode are errors rather than silently turned into U+FFFD,
// wherever they occur in the header.
func TestReadRejectsInvalidStrings(t *testing.T) {
	entry := `{"dtype":"U8","shape":[0],"data_offsets":[0,0]}`
	tests := []struct{ name, header string }{
		{"lone high surrogate name", `{"\ud800":` + entry + `}`},
		{"lone low surrogate name", `{"\udc00":` + entry + `}`},
		{"high surrogate then letter", `{"a\ud83dx":` + entry + `}`},
		{"high surrogate then escape", `{"a\ud83d\u0041":` + entry + `}`},
		{"two high surrogates", `{"\ud83d\ud83d":` + entry + `}`},
		{"surrogate at end of string", `{"a\ud83d":` + entry + `}`},
		{"metadata key", `{"__metadata__":{"\ud800":"v"}}`},
		{"metadata value", `{"__metadata__":{"k":"\udfff"}}`},
		{"dtype", `{"a":{"dtype":"U8\ud800","shape":[0],"data_offsets":[0,0]}}`},
		{"unknown field", `{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":["\ud800"]}}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := readBytes(rawFile(tc.header, nil))
			wantErr(t, err, ErrFormat, "unpaired UTF-16 surrogate")
		})
	}
	// A proper pair is one character.
	f, err := readBytes(rawFile(`{"\ud83d\ude00":`+entry+`}`, nil))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Names(); len(got) != 1 || got[0] != "😀" {
		t.Errorf("Names() = %q, want [😀]", got)
	}
}

// TestNamesValidatedAlikeOnReadAndWrite checks that Read accepts exactly
// the tensor names Write accepts.
func TestNamesValidatedAlikeOnReadAndWrite(t *testing.T) {
	for _, name := range []string{"", "a", " ", "ü\n", "\x00", "日本", `"\`, "model.layers.0.weight", "__metadata__x"} {
		t.Run(strconv.Quote(name), func(t *testing.T) {
			writeErr := Tensor{Name: name, DType: U8, Shape: []int{0}}.Validate()
			header := `{` + string(appendQuoted(nil, name)) + `:{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}`
			_, readErr := readBytes(rawFile(header, nil))
			if (writeErr == nil) != (readErr == nil) {
				t.Fatalf("Validate: %v; Read: %v", writeErr, readErr)
			}
			if readErr != nil {
				wantErr(t, readErr, ErrFormat, "empty tensor name")
				wantErr(t, writeErr, ErrInvalid, "empty tensor name")
			}
		})
	}
}

// FuzzScanner checks the header's JSON scanner against encoding/json: it
// accepts a value only if encoding/json does, rejects one that
// encoding/json accepts only for an unpaired surrogate or deep nesting, and
// decodes strings to what encoding/json decodes them to.
func FuzzScanner(f *testing.F) {
	for _, s := range []string{
		`{}`, `[]`, `""`, `"a\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00"`, `"\ud800"`, `"\udc00\ud800"`,
		`{"a":[1,-0,0.5,1e9,1E-9,-1.5e+3,true,false,null,{"b":{}}]}`, ` { "a" : [ ] } `,
		`01`, `1.`, `.5`, `-`, `1e`, `+1`, `[1,]`, `{"a":1,}`, `{"a"}`, `"\x"`, "\"\x01\"", `tru`, `nul`,
		strings.Repeat("[", 129) + strings.Repeat("]", 129),
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !utf8.Valid(b) {
			return // Read rejects such headers before scanning
		}
		s := scanner{b: b}
		s.ws()
		err := s.skip(1)
		if err == nil {
			if s.ws(); s.i != len(b) {
				err = s.errAt(s.i, "trailing data")
			}
		}
		valid := json.Valid(b)
		switch {
		case err == nil && !valid:
			t.Fatalf("scanner accepts %q, encoding/json does not", b)
		case err != nil && valid && !strings.Contains(err.Error(), "surrogate") && !strings.Contains(err.Error(), "nested deeper"):
			t.Fatalf("scanner rejects %q, which encoding/json accepts: %v", b, err)
		}
		if err != nil || len(b) == 0 || b[0] != '"' {
			return
		}
		got, err := (&scanner{b: b}).str(nil)
		if err != nil {
			t.Fatalf("str(%q) fails after skip accepted it: %v", b, err)
		}
		var want string
		if err := json.Unmarshal(b, &want); err != nil || string(got) != want {
			t.Fatalf("str(%q) = %q, encoding/json decodes %q (%v)", b, got, want, err)
		}
	})
}
