package rendezvous

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"
)

// ServerOption is an optional setting of Listen and Serve.
type ServerOption func(*serverConfig)

// serverConfig holds a Server's settings, defaults filled in.
type serverConfig struct {
	maxFrame     int
	maxPending   int
	writeTimeout time.Duration
	frameTimeout time.Duration
}

func newServerConfig(opts []ServerOption) serverConfig {
	c := serverConfig{maxFrame: DefaultMaxFrame, maxPending: 4096, writeTimeout: 30 * time.Second, frameTimeout: 30 * time.Second}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	return c
}

// WithServerMaxFrame sets the largest frame body the server accepts, in
// bytes (default DefaultMaxFrame). An n of zero or less keeps the default.
func WithServerMaxFrame(n int) ServerOption {
	return func(c *serverConfig) {
		if n > 0 {
			c.maxFrame = n
		}
	}
}

// WithMaxPending bounds the blocking requests (get, wait) in flight on one
// connection (default 4096); more are answered with an error. An n of zero
// or less keeps the default.
func WithMaxPending(n int) ServerOption {
	return func(c *serverConfig) {
		if n > 0 {
			c.maxPending = n
		}
	}
}

// WithWriteTimeout bounds writing one response: a client that does not read
// for this long is disconnected (default 30 s). A d of zero or less keeps
// the default.
func WithWriteTimeout(d time.Duration) ServerOption {
	return func(c *serverConfig) {
		if d > 0 {
			c.writeTimeout = d
		}
	}
}

// WithFrameTimeout bounds reading one request once its first byte has
// arrived: a client that sends part of a frame and stalls for this long
// is disconnected (default 30 s). An idle connection, between frames, is
// never timed out. A d of zero or less keeps the default.
func WithFrameTimeout(d time.Duration) ServerOption {
	return func(c *serverConfig) {
		if d > 0 {
			c.frameTimeout = d
		}
	}
}

// Server is a rendezvous store serving clients over TCP. It serves every
// connection concurrently until Close is called or the context given to
// Listen or Serve is done. A Server's methods are safe for concurrent use.
type Server struct {
	ln     net.Listener
	opts   serverConfig
	ctx    context.Context
	cancel context.CancelFunc
	stop   func() bool // stops the parent-context watcher; guarded by mu

	mu sync.Mutex // guards st and stop
	st *store

	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error // the listener's, set before done is closed
	done      chan struct{}
}

// Listen listens on the TCP address addr ("127.0.0.1:0" picks a free port)
// and serves in the background until Close is called or ctx is done.
func Listen(ctx context.Context, addr string, opts ...ServerOption) (*Server, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("rendezvous: listen on %s: %w", addr, err)
	}
	return Serve(ctx, ln, opts...), nil
}

// Serve serves on ln in the background until Close is called or ctx is
// done. The Server owns ln and closes it.
func Serve(ctx context.Context, ln net.Listener, opts ...ServerOption) *Server {
	s := &Server{
		ln:   ln,
		opts: newServerConfig(opts),
		st:   newStore(),
		done: make(chan struct{}),
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.wg.Add(1)
	go s.acceptLoop()
	// Registered last: if ctx is already done, Close runs at once, and it
	// must find the accept loop counted.
	s.mu.Lock()
	// Close's error (the listener's) is returned again by the owner's Close.
	s.stop = context.AfterFunc(ctx, func() { _ = s.Close() })
	s.mu.Unlock()
	return s
}

// Addr returns the address the server listens on, as "host:port".
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Done returns a channel closed once the server has stopped and every
// connection goroutine has ended.
func (s *Server) Done() <-chan struct{} { return s.done }

// Close stops the server: it closes the listener and every connection, so
// clients' pending calls fail promptly with ErrConnLost, and waits for the
// server's goroutines to end. Close is idempotent; every call returns the
// error, if any, of closing the listener.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		stop := s.stop
		s.mu.Unlock()
		if stop != nil {
			stop()
		}
		s.cancel()
		s.closeErr = s.ln.Close()
		s.wg.Wait()
		close(s.done)
	})
	<-s.done
	if s.closeErr != nil {
		return fmt.Errorf("rendezvous: Close: %w", s.closeErr)
	}
	return nil
}

func (s *Server) lock()   { s.mu.Lock() }
func (s *Server) unlock() { s.mu.Unlock() }

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	backoff := 5 * time.Millisecond
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient failure (for example out of file descriptors):
			// back off, bounded, and try again until closed.
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-s.ctx.Done():
				t.Stop()
				return
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		s.wg.Add(1)
		go s.serveConn(c)
	}
}

// sconn is the server side of one connection.
type sconn struct {
	s   *Server
	c   net.Conn
	wmu sync.Mutex

	mu      sync.Mutex // guards pending
	pending map[uint64]context.CancelFunc
}

func (s *Server) serveConn(c net.Conn) {
	defer s.wg.Done()
	ctx, cancel := context.WithCancel(s.ctx)
	// Closing a connection is how it is ended, here and below; an error
	// closing one that is already broken or closed tells nothing.
	stop := context.AfterFunc(ctx, func() { _ = c.Close() })
	sc := &sconn{s: s, c: c, pending: make(map[uint64]context.CancelFunc)}
	var waiters sync.WaitGroup
	defer func() {
		stop()
		cancel()
		_ = c.Close()
		waiters.Wait()
	}()
	br := bufio.NewReader(c)
	for {
		body, err := sc.nextFrame(br)
		if err != nil {
			if errors.Is(err, ErrFrameTooLarge) || errors.Is(err, ErrProtocol) {
				sc.reply(statusError, 0, []byte(err.Error()))
			}
			return
		}
		req, err := decodeRequest(body)
		if err != nil {
			var uo *unknownOpError
			if errors.As(err, &uo) {
				sc.reply(statusError, req.id, []byte(err.Error()))
				continue
			}
			sc.reply(statusError, req.id, []byte(fmt.Sprintf("malformed %s request: %v", opName(req.op), err)))
			return
		}
		switch req.op {
		case opGet, opWait:
			sc.startBlocking(ctx, &waiters, req)
		default:
			sc.handle(req)
		}
	}
}

// nextFrame waits, without a deadline, for the next frame's first byte,
// then reads the whole frame within the frame timeout.
func (sc *sconn) nextFrame(br *bufio.Reader) ([]byte, error) {
	if _, err := br.Peek(1); err != nil {
		return nil, err
	}
	// SetReadDeadline fails only on a closed connection, where the read
	// fails too.
	_ = sc.c.SetReadDeadline(time.Now().Add(sc.s.opts.frameTimeout))
	body, err := readFrame(br, sc.s.opts.maxFrame)
	_ = sc.c.SetReadDeadline(time.Time{})
	return body, err
}

// reply writes one response; a failed write closes the connection.
func (sc *sconn) reply(status byte, id uint64, payload []byte) {
	frame := encodeResponse(status, id, payload)
	sc.wmu.Lock()
	defer sc.wmu.Unlock()
	// SetWriteDeadline fails only on a closed connection, where Write fails
	// too; the client sees the connection drop, which is all it can learn.
	_ = sc.c.SetWriteDeadline(time.Now().Add(sc.s.opts.writeTimeout))
	if _, err := sc.c.Write(frame); err != nil {
		_ = sc.c.Close()
	}
}

// handle serves a non-blocking request.
func (sc *sconn) handle(req request) {
	s := sc.s
	switch req.op {
	case opPing:
		if string(req.value) != Magic {
			sc.reply(statusError, req.id, []byte(fmt.Sprintf("protocol mismatch: client speaks %q, server %q", req.value, Magic)))
			return
		}
		sc.reply(statusOK, req.id, []byte(Magic))
	case opSet:
		s.lock()
		s.st.set(req.key, req.value)
		s.unlock()
		sc.reply(statusOK, req.id, nil)
	case opAdd:
		s.lock()
		v, err := s.st.add(req.key, req.delta)
		s.unlock()
		if err != nil {
			sc.reply(statusError, req.id, []byte(err.Error()))
			return
		}
		sc.reply(statusOK, req.id, binary.BigEndian.AppendUint64(nil, uint64(v)))
	case opDelete:
		s.lock()
		ok := s.st.del(req.key)
		s.unlock()
		var b byte
		if ok {
			b = 1
		}
		sc.reply(statusOK, req.id, []byte{b})
	case opCancel:
		sc.mu.Lock()
		cancel := sc.pending[req.target]
		sc.mu.Unlock()
		if cancel != nil {
			cancel()
		}
	}
}

// startBlocking serves get or wait in its own goroutine so the connection
// keeps reading (and can receive a cancel).
func (sc *sconn) startBlocking(ctx context.Context, wg *sync.WaitGroup, req request) {
	keys := req.keys
	if req.op == opGet {
		keys = []string{req.key}
	}
	// Fast path: everything present already.
	sc.s.lock()
	_, miss := sc.s.st.missing(keys)
	var v []byte
	if !miss && req.op == opGet {
		v = sc.s.st.data[req.key]
	}
	sc.s.unlock()
	if !miss {
		if req.op == opWait {
			v = nil
		}
		sc.reply(statusOK, req.id, v)
		return
	}

	sc.mu.Lock()
	if len(sc.pending) >= sc.s.opts.maxPending {
		sc.mu.Unlock()
		sc.reply(statusError, req.id, []byte(fmt.Sprintf("too many pending requests on this connection (limit %d)", sc.s.opts.maxPending)))
		return
	}
	if _, dup := sc.pending[req.id]; dup || req.id == 0 {
		sc.mu.Unlock()
		sc.reply(statusError, req.id, []byte(fmt.Sprintf("request id %d is zero or already pending", req.id)))
		return
	}
	var rctx context.Context
	var cancel context.CancelFunc
	if req.timeout > 0 {
		rctx, cancel = context.WithTimeout(ctx, req.timeout)
	} else {
		rctx, cancel = context.WithCancel(ctx)
	}
	sc.pending[req.id] = cancel
	sc.mu.Unlock()

	wg.Add(1)
	go func() {
		defer wg.Done()
		defer func() {
			sc.mu.Lock()
			delete(sc.pending, req.id)
			sc.mu.Unlock()
			cancel()
		}()
		v, err := sc.s.st.waitFor(rctx, sc.s.lock, sc.s.unlock, keys)
		switch {
		case err == nil:
			if req.op == opWait {
				v = nil
			}
			sc.reply(statusOK, req.id, v)
		case ctx.Err() != nil:
			// The connection or server is closing: nobody to answer.
		case errors.Is(err, context.DeadlineExceeded):
			sc.reply(statusTimeout, req.id, nil)
		default:
			sc.reply(statusError, req.id, []byte("canceled"))
		}
	}()
}
