package rendezvous

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"time"
)

// DefaultMaxFrame is the largest frame body accepted by default (64 MiB).
const DefaultMaxFrame = 64 << 20

// Magic is the protocol's name and version, exchanged when a connection opens.
const Magic = "LOOMRDV1"

// Request ops.
const (
	opPing   byte = 1
	opSet    byte = 2
	opGet    byte = 3
	opWait   byte = 4
	opAdd    byte = 5
	opDelete byte = 6
	opCancel byte = 7
)

// Response statuses.
const (
	statusOK      byte = 0
	statusError   byte = 1
	statusTimeout byte = 2
)

const (
	reqHeader  = 1 + 8 + 4 // op, id, timeout_ms
	respHeader = 1 + 8     // status, id
	// readChunk is how much of a large frame is allocated before its bytes
	// arrive; larger bodies grow as data comes in.
	readChunk = 64 << 10
)

// request is a decoded request.
type request struct {
	op      byte
	id      uint64
	timeout time.Duration // 0: none
	key     string        // set, get, add, delete
	keys    []string      // wait
	value   []byte        // set, ping (magic)
	delta   int64         // add
	target  uint64        // cancel
}

// response is a decoded response.
type response struct {
	status  byte
	id      uint64
	payload []byte
}

func opName(op byte) string {
	switch op {
	case opPing:
		return "ping"
	case opSet:
		return "set"
	case opGet:
		return "get"
	case opWait:
		return "wait"
	case opAdd:
		return "add"
	case opDelete:
		return "delete"
	case opCancel:
		return "cancel"
	}
	return fmt.Sprintf("op(%d)", op)
}

// readFrame reads one frame and returns its body. The body's memory grows
// with the bytes actually received, so a lying length header cannot make it
// allocate more than about twice what the peer really sent.
func readFrame(r io.Reader, max int) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n == 0 {
		return nil, fmt.Errorf("%w: empty frame", ErrProtocol)
	}
	if uint64(n) > uint64(max) {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrFrameTooLarge, n, max)
	}
	if n <= readChunk {
		body := make([]byte, n)
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, unexpectedEOF(err)
		}
		return body, nil
	}
	var buf bytes.Buffer
	buf.Grow(readChunk)
	if _, err := io.CopyN(&buf, r, int64(n)); err != nil {
		return nil, unexpectedEOF(err)
	}
	return buf.Bytes(), nil
}

func unexpectedEOF(err error) error {
	if errors.Is(err, io.EOF) {
		return io.ErrUnexpectedEOF
	}
	return err
}

// decoder reads big-endian fields from a frame body; the first failure
// sticks and later reads return zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(what string) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: truncated %s", ErrProtocol, what)
	}
}

func (d *decoder) u8(what string) byte {
	if d.err != nil || len(d.b) < 1 {
		d.fail(what)
		return 0
	}
	v := d.b[0]
	d.b = d.b[1:]
	return v
}

func (d *decoder) u32(what string) uint32 {
	if d.err != nil || len(d.b) < 4 {
		d.fail(what)
		return 0
	}
	v := binary.BigEndian.Uint32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *decoder) u64(what string) uint64 {
	if d.err != nil || len(d.b) < 8 {
		d.fail(what)
		return 0
	}
	v := binary.BigEndian.Uint64(d.b)
	d.b = d.b[8:]
	return v
}

func (d *decoder) str(what string) string {
	n := d.u32(what + " length")
	if d.err != nil {
		return ""
	}
	if uint64(n) > uint64(len(d.b)) {
		d.fail(what)
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

func (d *decoder) rest() []byte {
	v := d.b
	d.b = nil
	return v
}

func (d *decoder) end() {
	if d.err == nil && len(d.b) != 0 {
		d.err = fmt.Errorf("%w: %d trailing bytes", ErrProtocol, len(d.b))
	}
}

// unknownOpError reports a request whose op is not known. The frame itself
// was well formed, so the connection can go on.
type unknownOpError struct {
	op byte
}

func (e *unknownOpError) Error() string { return fmt.Sprintf("unknown command %d", e.op) }

// decodeRequest decodes a request body. On error the returned request
// carries the id when the header could be read (0 otherwise).
func decodeRequest(body []byte) (request, error) {
	d := decoder{b: body}
	var req request
	req.op = d.u8("op")
	req.id = d.u64("request id")
	ms := d.u32("timeout")
	if d.err != nil {
		return request{}, d.err
	}
	req.timeout = time.Duration(ms) * time.Millisecond
	switch req.op {
	case opPing:
		req.value = d.rest()
	case opSet:
		req.key = d.str("key")
		req.value = d.rest()
	case opGet, opDelete:
		req.key = d.str("key")
	case opWait:
		n := d.u32("key count")
		// Every key takes at least 4 bytes, which bounds n by the frame.
		if d.err == nil && uint64(n) > uint64(len(d.b)/4) {
			d.err = fmt.Errorf("%w: %d keys cannot fit in %d bytes", ErrProtocol, n, len(d.b))
		}
		if d.err == nil {
			req.keys = make([]string, 0, n)
			for i := uint32(0); i < n && d.err == nil; i++ {
				req.keys = append(req.keys, d.str("key"))
			}
		}
	case opAdd:
		req.key = d.str("key")
		req.delta = int64(d.u64("delta"))
	case opCancel:
		req.target = d.u64("target id")
	default:
		return req, &unknownOpError{op: req.op}
	}
	d.end()
	if d.err != nil {
		return request{id: req.id, op: req.op}, d.err
	}
	return req, nil
}

// appendU32 and friends build frames.
func appendU32(b []byte, v uint32) []byte { return binary.BigEndian.AppendUint32(b, v) }
func appendU64(b []byte, v uint64) []byte { return binary.BigEndian.AppendUint64(b, v) }
func appendStr(b []byte, s string) []byte { return append(appendU32(b, uint32(len(s))), s...) }

// encodeRequest returns the whole frame (length prefix included) of req.
func encodeRequest(req request) []byte {
	size := 4 + reqHeader + 4 + len(req.key) + len(req.value) + 8
	for _, k := range req.keys {
		size += 4 + len(k)
	}
	b := make([]byte, 4, size)
	b = append(b, req.op)
	b = appendU64(b, req.id)
	ms := req.timeout.Milliseconds()
	if req.timeout > 0 && ms == 0 {
		ms = 1
	}
	if ms > 0xFFFFFFFF {
		ms = 0xFFFFFFFF
	}
	if ms < 0 {
		ms = 0
	}
	b = appendU32(b, uint32(ms))
	switch req.op {
	case opPing:
		b = append(b, req.value...)
	case opSet:
		b = appendStr(b, req.key)
		b = append(b, req.value...)
	case opGet, opDelete:
		b = appendStr(b, req.key)
	case opWait:
		b = appendU32(b, uint32(len(req.keys)))
		for _, k := range req.keys {
			b = appendStr(b, k)
		}
	case opAdd:
		b = appendStr(b, req.key)
		b = appendU64(b, uint64(req.delta))
	case opCancel:
		b = appendU64(b, req.target)
	}
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

// encodeResponse returns the whole frame of a response.
func encodeResponse(status byte, id uint64, payload []byte) []byte {
	b := make([]byte, 4, 4+respHeader+len(payload))
	b = append(b, status)
	b = appendU64(b, id)
	b = append(b, payload...)
	binary.BigEndian.PutUint32(b, uint32(len(b)-4))
	return b
}

// decodeResponse decodes a response body.
func decodeResponse(body []byte) (response, error) {
	d := decoder{b: body}
	var r response
	r.status = d.u8("status")
	r.id = d.u64("response id")
	if d.err != nil {
		return response{}, d.err
	}
	if r.status > statusTimeout {
		return response{}, fmt.Errorf("%w: unknown status %d", ErrProtocol, r.status)
	}
	r.payload = d.rest()
	return r, nil
}

// requestSize is the body size encodeRequest produces for req, used to
// reject oversize requests before sending them.
func requestSize(req request) int {
	n := reqHeader
	switch req.op {
	case opPing:
		n += len(req.value)
	case opSet:
		n += 4 + len(req.key) + len(req.value)
	case opGet, opDelete:
		n += 4 + len(req.key)
	case opWait:
		n += 4
		for _, k := range req.keys {
			n += 4 + len(k)
		}
	case opAdd:
		n += 4 + len(req.key) + 8
	case opCancel:
		n += 8
	}
	return n
}
