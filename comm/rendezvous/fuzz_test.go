package rendezvous

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
	"time"
)

// allocated returns the heap bytes f allocates (in all goroutines: the
// caller must be the only one allocating).
func allocated(f func()) uint64 {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	f()
	runtime.ReadMemStats(&after)
	return after.TotalAlloc - before.TotalAlloc
}

// frameSeeds are the interesting frames: one of each request, a response,
// lying and empty length headers, truncated and trailing fields.
func frameSeeds() [][]byte {
	head := func(op byte) []byte {
		b := binary.BigEndian.AppendUint32(nil, 0)
		b = append(b, op)
		b = binary.BigEndian.AppendUint64(b, 9)
		return binary.BigEndian.AppendUint32(b, 0)
	}
	frame := func(b []byte) []byte {
		binary.BigEndian.PutUint32(b, uint32(len(b)-4))
		return b
	}
	return [][]byte{
		encodeRequest(request{op: opPing, id: 1, value: []byte(Magic)}),
		encodeRequest(request{op: opSet, id: 1, key: "k", value: []byte("v")}),
		encodeRequest(request{op: opGet, id: 7, key: "k", timeout: time.Millisecond}),
		encodeRequest(request{op: opWait, id: 2, keys: []string{"a", "b"}, timeout: time.Second}),
		encodeRequest(request{op: opAdd, id: 3, key: "c", delta: -5}),
		encodeRequest(request{op: opDelete, id: 4, key: "c"}),
		encodeRequest(request{op: opCancel, id: 4, target: 3}),
		encodeResponse(statusOK, 5, []byte("payload")),
		encodeResponse(statusTimeout, 6, nil),
		frame(append(head(opWait), 0xff, 0xff, 0xff, 0xff)), // 4 billion keys in 4 bytes
		frame(append(head(opGet), 0, 0, 1, 0, 'k')),         // key longer than the frame
		frame(append(head(opGet), 0, 0, 0, 1, 'k', 'x')),    // trailing byte
		frame(append(head(99), 1, 2, 3)),                    // unknown op
		frame([]byte{0, 0, 0, 0, opSet, 1}),                 // header cut short
		{0x03, 0xff, 0xff, 0xff, opSet},                     // 64 MiB promised, 1 byte sent
		{0xff, 0xff, 0xff, 0xff, 1},                         // 4 GiB promised
		{0, 0, 0, 0},                                        // empty frame
		append(encodeRequest(request{op: opPing, id: 1, value: []byte(Magic)}), encodeRequest(request{op: opAdd, id: 2, key: "n", delta: 1})...),
	}
}

// FuzzDecodeFrame feeds arbitrary bytes to the frame reader and the
// request and response decoders, frame after frame: they must never
// panic, allocate little more than the bytes that arrived (even when a
// length header promises up to DefaultMaxFrame), fail only with errors
// wrapping ErrProtocol or ErrFrameTooLarge (or io.ErrUnexpectedEOF and
// io.EOF when the bytes run out), and what decodes must encode back to the
// same bytes.
func FuzzDecodeFrame(f *testing.F) {
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		for frames := 0; ; frames++ {
			var body []byte
			var err error
			if alloc, limit := allocated(func() { body, err = readFrame(r, DefaultMaxFrame) }), 2*uint64(len(data))+2*readChunk+4096; alloc > limit {
				t.Fatalf("readFrame of %d bytes allocated %d bytes, want at most %d", len(data), alloc, limit)
			}
			if err != nil {
				if frames == 0 && errors.Is(err, io.EOF) && len(data) > 0 {
					t.Fatalf("readFrame: io.EOF after %d bytes, want io.ErrUnexpectedEOF", len(data))
				}
				if !errors.Is(err, ErrProtocol) && !errors.Is(err, ErrFrameTooLarge) && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
					t.Fatalf("readFrame: %v: not a protocol, size or end-of-input error", err)
				}
				return
			}
			if len(body) == 0 {
				t.Fatal("readFrame returned an empty body")
			}
			if resp, err := decodeResponse(body); err != nil {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("decodeResponse: %v does not wrap ErrProtocol", err)
				}
			} else if again := encodeResponse(resp.status, resp.id, resp.payload); !bytes.Equal(again[4:], body) {
				t.Fatalf("re-encoding changed the response:\n in %x\nout %x", body, again[4:])
			}
			req, err := decodeRequest(body)
			if err != nil {
				var uo *unknownOpError
				if !errors.Is(err, ErrProtocol) && !errors.As(err, &uo) {
					t.Fatalf("decodeRequest: %v is neither a protocol error nor an unknown op", err)
				}
				continue
			}
			if again := encodeRequest(req); !bytes.Equal(again[4:], body) {
				t.Fatalf("re-encoding changed the request:\n in %x\nout %x", body, again[4:])
			}
			if n := requestSize(req); n != len(body) {
				t.Fatalf("requestSize %d for a %d-byte request", n, len(body))
			}
		}
	})
}

// pipeListener hands the server connections made with net.Pipe.
type pipeListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newPipeListener() *pipeListener {
	return &pipeListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *pipeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *pipeListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *pipeListener) Addr() net.Addr { return pipeAddr{} }

type pipeAddr struct{}

func (pipeAddr) Network() string { return "pipe" }
func (pipeAddr) String() string  { return "pipe" }

// FuzzServerConn sends arbitrary bytes to a server as one client's
// connection, then a ping. The server must not panic, must answer only
// with well-formed responses, must answer the ping unless it hung up on
// bytes it could not parse, and must stop promptly when closed, whatever
// the requests left pending.
func FuzzServerConn(f *testing.F) {
	for _, s := range frameSeeds() {
		f.Add(s)
	}
	const pingID = 1 << 62
	f.Fuzz(func(t *testing.T, data []byte) {
		ln := newPipeListener()
		srv := Serve(context.Background(), ln, WithServerMaxFrame(1<<12), WithMaxPending(4), WithWriteTimeout(time.Second))
		client, server := net.Pipe()
		ln.conns <- server

		type result struct {
			pinged bool
			err    error
		}
		replies := make(chan result, 1)
		go func() {
			var res result
			br := bufio.NewReader(client)
			for {
				body, err := readFrame(br, 1<<20)
				if err != nil {
					replies <- res // the server hung up, or the test closed the pipe
					return
				}
				r, err := decodeResponse(body)
				if err != nil {
					res.err = fmt.Errorf("server sent a malformed response %x: %v", body, err)
					replies <- res
					return
				}
				if r.id == pingID && r.status == statusOK && string(r.payload) == Magic {
					res.pinged = true
					replies <- res
					return
				}
			}
		}()
		// The writes fail once the server has hung up, which is allowed.
		_, errData := client.Write(data)
		whole, clean := frames(data)
		if !whole {
			// The server waits for the rest of the last frame, which a
			// ping would only feed: hang up and check what came back.
			client.Close()
		} else {
			_, errPing := client.Write(encodeRequest(request{op: opPing, id: pingID, value: []byte(Magic)}))
			errData = errors.Join(errData, errPing)
		}
		var res result
		select {
		case res = <-replies:
		case <-time.After(5 * time.Second):
			t.Fatalf("no answer to a ping after %x, and no hang-up", data)
		}
		client.Close()
		if res.err != nil {
			t.Fatal(res.err)
		}
		if whole && clean && errData == nil && !res.pinged {
			t.Fatalf("the server read %x, all well-formed frames, and a ping, but did not answer the ping", data)
		}
		closed := make(chan error, 1)
		go func() { closed <- srv.Close() }()
		select {
		case err := <-closed:
			if err != nil {
				t.Fatal(err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Server.Close did not return within 5 s")
		}
	})
}

// frames reports whether data is a whole number of frames within the
// fuzzed server's size limit, and whether each is also a request the
// server keeps reading after (well formed, or of an unknown op).
func frames(data []byte) (whole, clean bool) {
	r := bytes.NewReader(data)
	clean = true
	for r.Len() > 0 {
		body, err := readFrame(r, 1<<12)
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return false, false
		}
		if err != nil {
			// The server answers a bad length header and hangs up.
			return true, false
		}
		var uo *unknownOpError
		if _, err := decodeRequest(body); err != nil && !errors.As(err, &uo) {
			clean = false
		}
	}
	return true, clean
}
