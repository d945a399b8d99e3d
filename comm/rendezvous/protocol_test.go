package rendezvous

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestRequestRoundTrip(t *testing.T) {
	reqs := []request{
		{op: opPing, id: 1, value: []byte(Magic)},
		{op: opSet, id: 2, key: "k", value: []byte("value")},
		{op: opSet, id: 3, key: "", value: []byte{}},
		{op: opGet, id: 4, key: "some/key", timeout: 1500 * time.Millisecond},
		{op: opWait, id: 5, keys: []string{"a", "", "ccc"}, timeout: time.Second},
		{op: opAdd, id: 6, key: "n", delta: -42},
		{op: opDelete, id: 7, key: "gone"},
		{op: opCancel, id: 8, target: 5},
	}
	for _, want := range reqs {
		frame := encodeRequest(want)
		if got := len(frame) - 4; got != requestSize(want) {
			t.Errorf("%s: requestSize %d, encoded %d", opName(want.op), requestSize(want), got)
		}
		body, err := readFrame(bytes.NewReader(frame), DefaultMaxFrame)
		if err != nil {
			t.Fatalf("%s: readFrame: %v", opName(want.op), err)
		}
		got, err := decodeRequest(body)
		if err != nil {
			t.Fatalf("%s: decode: %v", opName(want.op), err)
		}
		if len(want.value) == 0 && len(got.value) == 0 {
			got.value, want.value = nil, nil
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("round trip:\n got %+v\nwant %+v", got, want)
		}
	}
}

func TestReadFrameLimits(t *testing.T) {
	hdr := func(n uint32) []byte { return binary.BigEndian.AppendUint32(nil, n) }
	if _, err := readFrame(bytes.NewReader(hdr(0)), 100); !errors.Is(err, ErrProtocol) {
		t.Errorf("empty frame: %v, want ErrProtocol", err)
	}
	if _, err := readFrame(bytes.NewReader(hdr(101)), 100); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("oversize frame: %v, want ErrFrameTooLarge", err)
	}
	if _, err := readFrame(bytes.NewReader(append(hdr(10), 1, 2)), 100); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("short body: %v, want ErrUnexpectedEOF", err)
	}
	if _, err := readFrame(bytes.NewReader([]byte{0, 0}), 100); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("short header: %v, want ErrUnexpectedEOF", err)
	}
	// A header claiming 60 MiB followed by 10 bytes must fail without
	// allocating anything near 60 MiB.
	lying := append(hdr(60<<20), make([]byte, 10)...)
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := 0; i < 10; i++ {
		if _, err := readFrame(bytes.NewReader(lying), DefaultMaxFrame); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("lying header: %v, want ErrUnexpectedEOF", err)
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / 10; per > 1<<20 {
		t.Errorf("lying header allocated %d bytes per read, want < 1 MiB", per)
	}
	// A large frame that really arrives is read whole.
	big := bytes.Repeat([]byte("x"), 3*readChunk+5)
	got, err := readFrame(bytes.NewReader(append(hdr(uint32(len(big))), big...)), DefaultMaxFrame)
	if err != nil || !bytes.Equal(got, big) {
		t.Errorf("large frame: %d bytes, %v", len(got), err)
	}
}

func TestDecodeRequestErrors(t *testing.T) {
	head := func(op byte) []byte {
		b := []byte{op}
		b = binary.BigEndian.AppendUint64(b, 9)
		return binary.BigEndian.AppendUint32(b, 0)
	}
	cases := []struct {
		name string
		body []byte
		want string
	}{
		{"short header", []byte{opGet, 0, 0}, "truncated"},
		{"unknown op", head(99), "unknown command 99"},
		{"get without key", head(opGet), "truncated"},
		{"key longer than frame", append(head(opGet), 0, 0, 0, 50, 'a'), "truncated key"},
		{"wait count too large", append(head(opWait), 0xff, 0xff, 0xff, 0xff), "cannot fit"},
		{"add short delta", append(head(opAdd), 0, 0, 0, 1, 'k', 1, 2), "truncated delta"},
		{"get trailing bytes", append(head(opGet), 0, 0, 0, 1, 'k', 7), "trailing"},
	}
	for _, c := range cases {
		req, err := decodeRequest(c.body)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
		if len(c.body) >= reqHeader && req.id != 9 {
			t.Errorf("%s: id %d, want 9 kept for the error reply", c.name, req.id)
		}
	}
}
