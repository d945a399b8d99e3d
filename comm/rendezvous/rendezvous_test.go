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
	"strings"
	"sync"
	"testing"
	"time"
)

// checkLeaks fails the test if goroutines started during it are still
// running (after a bounded grace period) once its other cleanups ran.
// Call it first, so its cleanup runs last.
func checkLeaks(t *testing.T) {
	t.Helper()
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(3 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > before {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Errorf("goroutine leak: %d before, %d after\n%s", before, n, buf)
		}
	})
}

func startServer(t *testing.T, opts ...ServerOption) *Server {
	t.Helper()
	s, err := Listen(context.Background(), "127.0.0.1:0", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func dial(t *testing.T, addr string, opts ...ClientOption) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := Dial(ctx, addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// within runs f and fails the test if it takes longer than d.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	start := time.Now()
	f()
	if el := time.Since(start); el > d {
		t.Errorf("%s took %v, want under %v", what, el, d)
	}
}

func TestBasicOps(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	c := dial(t, s.Addr())
	ctx := testCtx(t)

	if err := c.Set(ctx, "a", []byte("1")); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, "empty", nil); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Get(ctx, "a"); err != nil || string(v) != "1" {
		t.Fatalf("get a = %q, %v", v, err)
	}
	if v, err := c.Get(ctx, "empty"); err != nil || len(v) != 0 {
		t.Fatalf("get empty = %q, %v", v, err)
	}
	if err := c.Wait(ctx, "a", "empty"); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, err := c.Delete(ctx, "a"); err != nil || !ok {
		t.Fatalf("delete a = %v, %v", ok, err)
	}
	if ok, err := c.Delete(ctx, "a"); err != nil || ok {
		t.Fatalf("second delete a = %v, %v", ok, err)
	}
	if n, err := c.Add(ctx, "n", 5); err != nil || n != 5 {
		t.Fatalf("add = %d, %v", n, err)
	}
	if n, err := c.Add(ctx, "n", -7); err != nil || n != -2 {
		t.Fatalf("add = %d, %v", n, err)
	}
	if v, err := c.Get(ctx, "n"); err != nil || string(v) != "-2" {
		t.Fatalf("get counter = %q, %v", v, err)
	}
	c.Set(ctx, "text", []byte("abc"))
	_, err := c.Add(ctx, "text", 1)
	var se *ServerError
	if !errors.As(err, &se) || !strings.Contains(err.Error(), `add "text"`) || !strings.Contains(err.Error(), s.Addr()) {
		t.Errorf("add on text: %v, want a server error naming op, key and address", err)
	}
	c.Set(ctx, "big", []byte("9223372036854775807"))
	if _, err := c.Add(ctx, "big", 1); err == nil || !strings.Contains(err.Error(), "overflow") {
		t.Errorf("add overflow: %v", err)
	}
	// The connection is still healthy after server-reported errors.
	if v, err := c.Get(ctx, "n"); err != nil || string(v) != "-2" {
		t.Fatalf("get after errors = %q, %v", v, err)
	}
	// A large value (bigger than the frame reader's chunk) round-trips.
	big := bytes.Repeat([]byte("0123456789"), 100_000)
	if err := c.Set(ctx, "large", big); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Get(ctx, "large"); err != nil || !bytes.Equal(v, big) {
		t.Fatalf("large value: %d bytes, %v", len(v), err)
	}
}

func TestConcurrentManyKeys(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	ctx := testCtx(t)
	const clients, perClient, keys = 4, 16, 40
	var wg sync.WaitGroup
	errs := make(chan error, clients*perClient)
	for ci := 0; ci < clients; ci++ {
		c := dial(t, s.Addr())
		for g := 0; g < perClient; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				w := ci*perClient + g
				for k := 0; k < keys; k++ {
					key := fmt.Sprintf("w%d/k%d", w, k)
					if err := c.Set(ctx, key, []byte(key)); err != nil {
						errs <- err
						return
					}
				}
				// Read keys written by another worker: blocks until they exist.
				other := (w + 1) % (clients * perClient)
				for k := 0; k < keys; k++ {
					key := fmt.Sprintf("w%d/k%d", other, k)
					v, err := c.Get(ctx, key)
					if err != nil {
						errs <- err
						return
					}
					if string(v) != key {
						errs <- fmt.Errorf("get %s = %q", key, v)
						return
					}
				}
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func TestGetBlocksUntilSet(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	reader := dial(t, s.Addr())
	writer := dial(t, s.Addr())
	ctx := testCtx(t)

	got := make(chan string, 2)
	errc := make(chan error, 2)
	go func() {
		v, err := reader.Get(ctx, "uid")
		got <- string(v)
		errc <- err
	}()
	go func() {
		errc <- reader.Wait(ctx, "uid", "other")
	}()
	select {
	case v := <-got:
		t.Fatalf("get returned %q before the key was set", v)
	case <-time.After(100 * time.Millisecond):
	}
	if err := writer.Set(ctx, "uid", []byte("nccl-id")); err != nil {
		t.Fatal(err)
	}
	select {
	case v := <-got:
		if v != "nccl-id" {
			t.Errorf("get = %q", v)
		}
		if err := <-errc; err != nil {
			t.Error(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("get not released by set")
	}
	// The wait needs both keys.
	select {
	case err := <-errc:
		t.Fatalf("wait returned with one of two keys: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if _, err := writer.Add(ctx, "other", 1); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-errc:
		if err != nil {
			t.Error(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("wait not released")
	}
}

func TestAddAtomic(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	ctx := testCtx(t)
	const clients, perClient, adds = 4, 8, 50
	total := clients * perClient * adds
	seen := make([]int, total+1)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for ci := 0; ci < clients; ci++ {
		c := dial(t, s.Addr())
		for g := 0; g < perClient; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < adds; i++ {
					v, err := c.Add(ctx, "counter", 1)
					if err != nil {
						t.Error(err)
						return
					}
					mu.Lock()
					if v >= 1 && v <= int64(total) {
						seen[v]++
					}
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	for v := 1; v <= total; v++ {
		if seen[v] != 1 {
			t.Fatalf("value %d returned %d times, want once", v, seen[v])
		}
	}
	c := dial(t, s.Addr())
	if v, err := c.Get(ctx, "counter"); err != nil || string(v) != fmt.Sprint(total) {
		t.Fatalf("final counter %q, %v; want %d", v, err, total)
	}
}

// serverWaits returns how many keys have blocked requests registered.
func serverWaits(s *Server) int {
	s.lock()
	defer s.unlock()
	return len(s.st.waits)
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not true after %v", what, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestTimeout(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	c := dial(t, s.Addr(), WithTimeout(150*time.Millisecond))
	var err error
	within(t, 2*time.Second, "get with a 150ms client timeout", func() {
		_, err = c.Get(context.Background(), "never")
	})
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want ErrTimeout and DeadlineExceeded", err)
	}
	var e *Error
	if !errors.As(err, &e) || e.Op != "get" || e.Key != "never" || e.Addr != s.Addr() {
		t.Errorf("err = %#v, want *Error naming get, never, %s", err, s.Addr())
	}
	if msg := err.Error(); !strings.Contains(msg, "client timeout 150ms") {
		t.Errorf("message %q does not say which timeout", msg)
	}
	// A context deadline shorter than the client timeout wins.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err = c.Wait(ctx, "x", "y")
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), `wait "x,y"`) {
		t.Errorf("wait: %v", err)
	}
	// The server dropped its waiters (cancel frame or carried deadline).
	waitUntil(t, 2*time.Second, "server waiters released", func() bool { return serverWaits(s) == 0 })
	// The connection is still usable.
	if err := c.Set(context.Background(), "k", nil); err != nil {
		t.Fatal(err)
	}
}

func TestContextCancel(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	c := dial(t, s.Addr(), WithTimeout(0)) // no client timeout: only cancel ends it
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := c.Get(ctx, "never")
		errc <- err
	}()
	waitUntil(t, 2*time.Second, "server waiter registered", func() bool { return serverWaits(s) == 1 })
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("get not released by cancel")
	}
	// The cancel frame reached the server, which dropped its waiter.
	waitUntil(t, 2*time.Second, "server waiter cancelled", func() bool { return serverWaits(s) == 0 })
	// An already cancelled context fails before sending.
	if err := c.Set(ctx, "k", nil); !errors.Is(err, context.Canceled) {
		t.Errorf("set with cancelled ctx: %v", err)
	}
}

func TestServerShutdownWhileWaiting(t *testing.T) {
	checkLeaks(t)
	s, err := Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := s.Addr()
	c1 := dial(t, addr, WithTimeout(0))
	c2 := dial(t, addr, WithTimeout(0))
	const waiters = 10
	errc := make(chan error, 2*waiters)
	for i := 0; i < waiters; i++ {
		go func() { _, err := c1.Get(context.Background(), fmt.Sprint("k", i)); errc <- err }()
		go func() { errc <- c2.Wait(context.Background(), "a", fmt.Sprint("b", i)) }()
	}
	waitUntil(t, 2*time.Second, "waiters registered", func() bool { return serverWaits(s) == waiters+1 })
	within(t, time.Second, "server close", func() { s.Close() })
	within(t, 2*time.Second, "waiters failing", func() {
		for i := 0; i < 2*waiters; i++ {
			err := <-errc
			if !errors.Is(err, ErrConnLost) || !strings.Contains(err.Error(), addr) {
				t.Errorf("err = %v, want ErrConnLost naming %s", err, addr)
			}
		}
	})
	select {
	case <-s.Done():
	default:
		t.Error("Done not closed after Close")
	}
	// Later calls fail promptly: one reconnection attempt, refused.
	within(t, 2*time.Second, "call after shutdown", func() {
		if err := c1.Set(context.Background(), "k", nil); !errors.Is(err, ErrConnLost) {
			t.Errorf("set after shutdown: %v, want ErrConnLost", err)
		}
	})
}

func TestServerContextDone(t *testing.T) {
	checkLeaks(t)
	ctx, cancel := context.WithCancel(context.Background())
	s, err := Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, s.Addr(), WithTimeout(0))
	errc := make(chan error, 1)
	go func() { _, err := c.Get(context.Background(), "k"); errc <- err }()
	waitUntil(t, 2*time.Second, "waiter registered", func() bool { return serverWaits(s) == 1 })
	cancel()
	select {
	case <-s.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("server did not stop when its context ended")
	}
	select {
	case err := <-errc:
		if !errors.Is(err, ErrConnLost) {
			t.Errorf("err = %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("pending get did not fail")
	}
}

func TestClientClose(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	c, err := Dial(context.Background(), s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { _, err := c.Get(context.Background(), "k"); errc <- err }()
	waitUntil(t, 2*time.Second, "waiter registered", func() bool { return serverWaits(s) == 1 })
	c.Close()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrClosed) {
			t.Errorf("pending get after Close: %v", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("pending get not released by Close")
	}
	if err := c.Set(context.Background(), "k", nil); !errors.Is(err, ErrClosed) {
		t.Errorf("set after Close: %v", err)
	}
	c.Close()
	// The server notices the closed connection and drops the waiter.
	waitUntil(t, 2*time.Second, "server waiter dropped", func() bool { return serverWaits(s) == 0 })
}

func TestReconnect(t *testing.T) {
	checkLeaks(t)
	s1, err := Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := s1.Addr()
	c := dial(t, addr)
	ctx := testCtx(t)
	if err := c.Set(ctx, "old", []byte("1")); err != nil {
		t.Fatal(err)
	}
	s1.Close()
	// No server: the next call fails fast instead of waiting for one.
	within(t, 2*time.Second, "call without server", func() {
		if _, err := c.Get(ctx, "old"); !errors.Is(err, ErrConnLost) {
			t.Errorf("get without server: %v, want ErrConnLost", err)
		}
	})
	// A new server on the same address: the next call reconnects. The old
	// store is gone.
	s2, err := Listen(context.Background(), addr)
	if err != nil {
		t.Skipf("cannot listen again on %s: %v", addr, err)
	}
	defer s2.Close()
	if err := c.Set(ctx, "new", []byte("2")); err != nil {
		t.Fatalf("set after reconnect: %v", err)
	}
	if v, err := c.Get(ctx, "new"); err != nil || string(v) != "2" {
		t.Fatalf("get after reconnect = %q, %v", v, err)
	}
	short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if _, err := c.Get(short, "old"); !errors.Is(err, ErrTimeout) {
		t.Errorf("old key on new server: %v, want a timeout", err)
	}
	c.Close()
}

func TestDialRetries(t *testing.T) {
	checkLeaks(t)
	// Reserve a free port, free it, and start the server there later.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	type result struct {
		c   *Client
		err error
	}
	res := make(chan result, 1)
	go func() {
		c, err := Dial(context.Background(), addr, WithDialTimeout(5*time.Second), WithRetryInterval(10*time.Millisecond))
		res <- result{c, err}
	}()
	time.Sleep(150 * time.Millisecond)
	s, err := Listen(context.Background(), addr)
	if err != nil {
		r := <-res
		if r.c != nil {
			r.c.Close()
		}
		t.Skipf("port %s was taken meanwhile: %v", addr, err)
	}
	defer s.Close()
	r := <-res
	if r.err != nil {
		t.Fatalf("dial with retries: %v", r.err)
	}
	defer r.c.Close()
	if err := r.c.Set(context.Background(), "k", nil); err != nil {
		t.Fatal(err)
	}
}

func TestDialTimeout(t *testing.T) {
	checkLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	within(t, 2*time.Second, "dial with 200ms timeout", func() {
		_, err = Dial(context.Background(), addr, WithDialTimeout(200*time.Millisecond), WithRetryInterval(10*time.Millisecond))
	})
	var e *Error
	if !errors.Is(err, ErrTimeout) || !errors.As(err, &e) || e.Op != "dial" || e.Addr != addr {
		t.Errorf("err = %v, want a dial timeout naming %s", err, addr)
	}
	// A listener that accepts but never answers the handshake.
	ln, err = net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var held []net.Conn
	var hmu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			hmu.Lock()
			held = append(held, c)
			hmu.Unlock()
		}
	}()
	within(t, 2*time.Second, "dial to a silent server", func() {
		_, err = Dial(context.Background(), ln.Addr().String(), WithDialTimeout(200*time.Millisecond))
	})
	if !errors.Is(err, ErrTimeout) {
		t.Errorf("silent server: %v, want a timeout", err)
	}
	ln.Close()
	hmu.Lock()
	for _, c := range held {
		c.Close()
	}
	hmu.Unlock()
}

func TestBarrier(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	ctx := testCtx(t)
	const n = 6
	var wg sync.WaitGroup
	var mu sync.Mutex
	passed := 0
	for i := 0; i < n; i++ {
		c := dial(t, s.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			if i == n-1 {
				time.Sleep(50 * time.Millisecond)
				mu.Lock()
				if passed != 0 {
					t.Errorf("%d callers passed the barrier before the last arrived", passed)
				}
				mu.Unlock()
			}
			if err := c.Barrier(ctx, "b0", n); err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			passed++
			mu.Unlock()
		}()
	}
	wg.Wait()
	if passed != n {
		t.Fatalf("%d of %d passed", passed, n)
	}
	c := dial(t, s.Addr(), WithTimeout(100*time.Millisecond))
	if err := c.Barrier(ctx, "b0", n); err == nil || !strings.Contains(err.Error(), "single-use") {
		t.Errorf("reused barrier: %v", err)
	}
	if err := c.Barrier(ctx, "lonely", 2); !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), `barrier "lonely"`) {
		t.Errorf("incomplete barrier: %v, want a timeout naming it", err)
	}
	if err := c.Barrier(ctx, "bad", 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("n=0: %v", err)
	}
}

func TestOversizeRequestRejectedByClient(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	c := dial(t, s.Addr(), WithClientMaxFrame(1024))
	err := c.Set(context.Background(), "k", make([]byte, 2000))
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("err = %v, want ErrFrameTooLarge", err)
	}
	if err := c.Set(context.Background(), "k", make([]byte, 100)); err != nil {
		t.Errorf("small set after rejected one: %v", err)
	}
}

func TestMaxPending(t *testing.T) {
	checkLeaks(t)
	s := startServer(t, WithMaxPending(2))
	c := dial(t, s.Addr(), WithTimeout(0))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for i := 0; i < 2; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); c.Get(ctx, fmt.Sprint("p", i)) }()
	}
	waitUntil(t, 2*time.Second, "two waiters", func() bool { return serverWaits(s) == 2 })
	_, err := c.Get(context.Background(), "third")
	if err == nil || !strings.Contains(err.Error(), "too many pending") {
		t.Errorf("third get: %v", err)
	}
	cancel()
	wg.Wait()
}

// rawConn is a raw TCP connection to the server for malformed-input tests.
type rawConn struct {
	t  *testing.T
	c  net.Conn
	br *bufio.Reader
}

func rawDial(t *testing.T, addr string) *rawConn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	return &rawConn{t: t, c: c, br: bufio.NewReader(c)}
}

func (r *rawConn) send(b []byte) {
	r.t.Helper()
	if _, err := r.c.Write(b); err != nil {
		r.t.Fatalf("write: %v", err)
	}
}

// reply reads one response.
func (r *rawConn) reply() response {
	r.t.Helper()
	body, err := readFrame(r.br, DefaultMaxFrame)
	if err != nil {
		r.t.Fatalf("reading reply: %v", err)
	}
	resp, err := decodeResponse(body)
	if err != nil {
		r.t.Fatalf("decoding reply: %v", err)
	}
	return resp
}

// closed checks that the server closed the connection.
func (r *rawConn) closed() {
	r.t.Helper()
	if _, err := r.br.ReadByte(); err != io.EOF {
		r.t.Errorf("connection not closed by server: %v", err)
	}
}

func TestMalformedFrames(t *testing.T) {
	checkLeaks(t)
	s := startServer(t)
	frame := func(body []byte) []byte {
		return append(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body...)
	}
	head := func(op byte, id uint64) []byte {
		b := binary.BigEndian.AppendUint64([]byte{op}, id)
		return binary.BigEndian.AppendUint32(b, 0)
	}

	t.Run("oversize", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send(binary.BigEndian.AppendUint32(nil, DefaultMaxFrame+1))
		resp := r.reply()
		if resp.status != statusError || resp.id != 0 || !strings.Contains(string(resp.payload), "too large") {
			t.Errorf("reply %+v %q", resp, resp.payload)
		}
		r.closed()
	})
	t.Run("http", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send([]byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
		if resp := r.reply(); resp.status != statusError {
			t.Errorf("reply %+v", resp)
		}
		r.closed()
	})
	t.Run("empty frame", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send([]byte{0, 0, 0, 0})
		if resp := r.reply(); resp.status != statusError {
			t.Errorf("reply %+v", resp)
		}
		r.closed()
	})
	t.Run("unknown command", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send(frame(head(200, 77)))
		resp := r.reply()
		if resp.status != statusError || resp.id != 77 || !strings.Contains(string(resp.payload), "unknown command 200") {
			t.Errorf("reply %+v %q", resp, resp.payload)
		}
		// The connection stays usable.
		r.send(encodeRequest(request{op: opSet, id: 78, key: "k", value: []byte("v")}))
		if resp := r.reply(); resp.status != statusOK || resp.id != 78 {
			t.Errorf("set after unknown command: %+v", resp)
		}
	})
	t.Run("malformed", func(t *testing.T) {
		bodies := map[string][]byte{
			"short header":   {opGet, 1},
			"key too long":   append(head(opGet, 5), 0, 0, 1, 0, 'k'),
			"wait count":     append(head(opWait, 5), 0x7f, 0xff, 0xff, 0xff, 0, 0, 0, 0),
			"trailing bytes": append(head(opDelete, 5), 0, 0, 0, 1, 'k', 'x'),
		}
		for name, body := range bodies {
			r := rawDial(t, s.Addr())
			r.send(frame(body))
			if resp := r.reply(); resp.status != statusError || !strings.Contains(string(resp.payload), "malformed") {
				t.Errorf("%s: reply %+v %q", name, resp, resp.payload)
			}
			r.closed()
		}
	})
	t.Run("bad magic", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send(encodeRequest(request{op: opPing, id: 1, value: []byte("NOTLOOM1")}))
		if resp := r.reply(); resp.status != statusError || !strings.Contains(string(resp.payload), "protocol mismatch") {
			t.Errorf("reply %+v %q", resp, resp.payload)
		}
	})
	t.Run("lying length then hang up", func(t *testing.T) {
		for i := 0; i < 20; i++ {
			r := rawDial(t, s.Addr())
			r.send(append(binary.BigEndian.AppendUint32(nil, 60<<20), "abc"...))
			r.c.Close()
		}
	})
	t.Run("truncated frame then hang up", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		r.send([]byte{0, 0})
		r.c.Close()
	})
	// After all of that the server still serves well-behaved clients.
	c := dial(t, s.Addr())
	if err := c.Set(context.Background(), "still", []byte("ok")); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Get(context.Background(), "still"); err != nil || string(v) != "ok" {
		t.Fatalf("get = %q, %v", v, err)
	}
}

// A client that stalls inside a frame is disconnected after the frame
// timeout, while one idle between frames for longer keeps its connection.
func TestStalledFrameDisconnected(t *testing.T) {
	checkLeaks(t)
	const timeout = 100 * time.Millisecond
	s := startServer(t, WithFrameTimeout(timeout))
	cases := []struct {
		name    string
		partial []byte
	}{
		{"inside the length", []byte{0, 0}},
		{"inside the body", append(binary.BigEndian.AppendUint32(nil, 32), opSet, 0, 0)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := rawDial(t, s.Addr())
			start := time.Now()
			r.send(c.partial)
			r.closed()
			if d := time.Since(start); d < timeout || d > timeout+3*time.Second {
				t.Errorf("closed after %v, want about %v", d, timeout)
			}
		})
	}
	t.Run("idle between frames", func(t *testing.T) {
		r := rawDial(t, s.Addr())
		time.Sleep(3 * timeout)
		r.send(encodeRequest(request{op: opSet, id: 9, key: "k", value: []byte("v")}))
		if resp := r.reply(); resp.status != statusOK || resp.id != 9 {
			t.Errorf("set after idling: %+v", resp)
		}
		time.Sleep(3 * timeout)
		r.send(encodeRequest(request{op: opSet, id: 10, key: "k", value: []byte("w")}))
		if resp := r.reply(); resp.status != statusOK || resp.id != 10 {
			t.Errorf("second set after idling: %+v", resp)
		}
	})
}

// A client facing a server that sends garbage fails its calls promptly.
func TestClientRejectsGarbageServer(t *testing.T) {
	checkLeaks(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.Write([]byte{0xff, 0xff, 0xff, 0xff, 0, 0, 0})
		io.Copy(io.Discard, c)
	}()
	within(t, 500*time.Millisecond, "dial to a garbage server (no retries)", func() {
		_, err = Dial(context.Background(), ln.Addr().String(), WithDialTimeout(5*time.Second))
	})
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("dial to a garbage server: %v, want ErrFrameTooLarge", err)
	}
}

func TestListenWithDoneContext(t *testing.T) {
	checkLeaks(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	s, err := Listen(context.Background(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s = Serve(ctx, ln)
	select {
	case <-s.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("server with a done context did not stop")
	}
	s.Close()
}
