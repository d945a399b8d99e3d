package rendezvous

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// ClientOption is an optional setting of Dial and DialEnv.
type ClientOption func(*clientConfig)

// clientConfig holds a Client's settings, defaults filled in.
type clientConfig struct {
	timeout       time.Duration // <= 0: no bound other than the context
	dialTimeout   time.Duration
	retryInterval time.Duration
	maxFrame      int
}

func newClientConfig(opts []ClientOption) clientConfig {
	c := clientConfig{
		timeout:       5 * time.Minute,
		dialTimeout:   30 * time.Second,
		retryInterval: 50 * time.Millisecond,
		maxFrame:      DefaultMaxFrame,
	}
	for _, o := range opts {
		if o != nil {
			o(&c)
		}
	}
	return c
}

// WithTimeout bounds every call, on top of its context (default 5 min). A d
// of zero or less leaves the context as the only bound.
func WithTimeout(d time.Duration) ClientOption {
	return func(c *clientConfig) { c.timeout = d }
}

// WithDialTimeout bounds Dial, all retries included, and each single
// connection attempt a later call makes after a break (default 30 s). A d of
// zero or less keeps the default.
func WithDialTimeout(d time.Duration) ClientOption {
	return func(c *clientConfig) {
		if d > 0 {
			c.dialTimeout = d
		}
	}
}

// WithRetryInterval sets the first pause between Dial's attempts; it doubles
// up to 1 s (default 50 ms). A d of zero or less keeps the default.
func WithRetryInterval(d time.Duration) ClientOption {
	return func(c *clientConfig) {
		if d > 0 {
			c.retryInterval = d
		}
	}
}

// WithClientMaxFrame sets the largest frame the client sends or accepts, in
// bytes (default DefaultMaxFrame). An n of zero or less keeps the default.
func WithClientMaxFrame(n int) ClientOption {
	return func(c *clientConfig) {
		if n > 0 {
			c.maxFrame = n
		}
	}
}

// serverTimeoutMargin is added to the time limit a blocking request carries.
const serverTimeoutMargin = 100 * time.Millisecond

// Client talks to one Server over one TCP connection, multiplexing
// concurrent calls. Its methods are safe for concurrent use. See the
// package documentation for what happens when the connection breaks.
type Client struct {
	addr string
	opts clientConfig

	dialSem chan struct{} // serializes reconnection; a context can abandon the wait
	mu      sync.Mutex    // guards sess and closed
	sess    *session
	closed  bool
}

// session is one connection and the calls pending on it.
type session struct {
	conn     net.Conn
	maxFrame int
	wsem     chan struct{} // write lock that a context can abandon
	nextID   atomic.Uint64

	mu         sync.Mutex // guards pending and err
	pending    map[uint64]chan response
	err        error
	done       chan struct{} // closed when the session failed; err is set
	readerDone chan struct{}
}

// Dial connects to the server at addr, retrying failed attempts (refused
// connections while the server starts, for instance) until ctx is done or
// the dial timeout (WithDialTimeout) passes, and checks that the server
// speaks this protocol.
func Dial(ctx context.Context, addr string, opts ...ClientOption) (*Client, error) {
	c := &Client{addr: addr, opts: newClientConfig(opts), dialSem: make(chan struct{}, 1)}
	dctx, cancel := context.WithTimeoutCause(ctx, c.opts.dialTimeout,
		&timeoutError{what: fmt.Sprintf("dial timeout %v", c.opts.dialTimeout)})
	defer cancel()
	pause := c.opts.retryInterval
	attempts := 0
	for {
		attempts++
		s, err := c.connect(dctx)
		if err == nil {
			c.sess = s
			return c, nil
		}
		var se *ServerError
		if errors.As(err, &se) || errors.Is(err, ErrProtocol) || errors.Is(err, ErrFrameTooLarge) {
			// The server answered but rejected us: retrying cannot help.
			return nil, &Error{Op: "dial", Addr: addr, Err: err}
		}
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-dctx.Done():
			t.Stop()
			return nil, &Error{Op: "dial", Addr: addr,
				Err: fmt.Errorf("%w after %d attempts; last: %v", ctxError(dctx), attempts, err)}
		}
		pause = min(2*pause, time.Second)
	}
}

// Addr returns the server address the client connects to.
func (c *Client) Addr() string { return c.addr }

// Close closes the connection; pending calls fail with ErrClosed, and so
// does every later call. Close is idempotent and returns nil.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	s := c.sess
	c.sess = nil
	c.mu.Unlock()
	if s != nil {
		s.fail(ErrClosed)
		<-s.readerDone
	}
	return nil
}

// connect makes one connection attempt and pings the server.
func (c *Client) connect(ctx context.Context) (*session, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", c.addr)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctxError(ctx)
		}
		return nil, err
	}
	s := &session{
		conn:       conn,
		maxFrame:   c.opts.maxFrame,
		wsem:       make(chan struct{}, 1),
		pending:    make(map[uint64]chan response),
		done:       make(chan struct{}),
		readerDone: make(chan struct{}),
	}
	go s.readLoop()
	resp, err := s.roundTrip(ctx, request{op: opPing, value: []byte(Magic)})
	if err == nil {
		switch {
		case resp.status == statusError:
			err = &ServerError{Msg: string(resp.payload)}
		case resp.status != statusOK || string(resp.payload) != Magic:
			err = fmt.Errorf("%w: bad handshake reply %q", ErrProtocol, resp.payload)
		}
	}
	if err != nil {
		s.fail(err)
		<-s.readerDone
		// The first failure is the cause. A reader that met garbage has
		// failed the session and closed the connection, and the ping's
		// write may then fail with a closed-connection error that says
		// nothing (and that Dial would retry).
		s.mu.Lock()
		err = s.err
		s.mu.Unlock()
		return nil, err
	}
	return s, nil
}

// session returns the live session, making one connection attempt when the
// previous one broke.
func (c *Client) session(ctx context.Context) (*session, error) {
	c.mu.Lock()
	s, closed := c.sess, c.closed
	c.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if s != nil && !s.failed() {
		return s, nil
	}
	// Reconnect, one caller at a time, abandoning the wait if ctx ends.
	select {
	case c.dialSem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctxError(ctx)
	}
	defer func() { <-c.dialSem }()
	c.mu.Lock()
	s, closed = c.sess, c.closed
	c.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if s != nil && !s.failed() {
		return s, nil
	}
	dctx, cancel := context.WithTimeout(ctx, c.opts.dialTimeout)
	defer cancel()
	ns, err := c.connect(dctx)
	if err != nil {
		return nil, fmt.Errorf("%w; reconnecting failed: %v", ErrConnLost, err)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		ns.fail(ErrClosed)
		<-ns.readerDone
		return nil, ErrClosed
	}
	c.sess = ns
	c.mu.Unlock()
	return ns, nil
}

func (s *session) failed() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

// fail ends the session with err (the first error wins): it closes the
// connection and releases every pending call.
func (s *session) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return
	}
	s.err = err
	close(s.done)
	// err is what callers see; closing only stops the reader, and a close
	// error on a failed connection says nothing more.
	_ = s.conn.Close()
}

func (s *session) readLoop() {
	defer close(s.readerDone)
	br := bufio.NewReader(s.conn)
	for {
		body, err := readFrame(br, s.maxFrame)
		if err != nil {
			if errors.Is(err, ErrProtocol) || errors.Is(err, ErrFrameTooLarge) {
				s.fail(fmt.Errorf("%w: %w", ErrConnLost, err))
			} else {
				s.fail(fmt.Errorf("%w: %v", ErrConnLost, err))
			}
			return
		}
		r, err := decodeResponse(body)
		if err != nil {
			s.fail(err)
			return
		}
		if r.id == 0 {
			// The server rejected something it could not attribute to a
			// request, and closes the connection.
			s.fail(fmt.Errorf("%w: server: %s", ErrProtocol, r.payload))
			return
		}
		s.mu.Lock()
		ch := s.pending[r.id]
		delete(s.pending, r.id)
		s.mu.Unlock()
		if ch != nil {
			ch <- r // buffered; never blocks
		}
	}
}

// write sends one whole frame. A write that fails or is cut short by ctx
// breaks the framing, so it ends the session.
func (s *session) write(ctx context.Context, frame []byte) error {
	select {
	case s.wsem <- struct{}{}:
	case <-s.done:
		return s.err
	case <-ctx.Done():
		return ctxError(ctx)
	}
	defer func() { <-s.wsem }()
	// SetWriteDeadline fails only on a closed connection, and then the
	// Write below fails and reports it.
	if dl, ok := ctx.Deadline(); ok {
		_ = s.conn.SetWriteDeadline(dl)
	} else {
		_ = s.conn.SetWriteDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { _ = s.conn.SetWriteDeadline(time.Unix(1, 0)) })
	_, err := s.conn.Write(frame)
	stop()
	if err != nil {
		if ctx.Err() != nil {
			// Other calls on this connection see a lost connection; this
			// one reports its own context.
			s.fail(fmt.Errorf("%w: a request's write was interrupted by its context", ErrConnLost))
			return fmt.Errorf("%w (write interrupted; connection closed)", ctxError(ctx))
		}
		err = fmt.Errorf("%w: %v", ErrConnLost, err)
		s.fail(err)
		return err
	}
	return nil
}

// roundTrip sends req and waits for its response, the session's end or ctx.
func (s *session) roundTrip(ctx context.Context, req request) (response, error) {
	req.id = s.nextID.Add(1)
	if dl, ok := ctx.Deadline(); ok {
		// The server's bound is a backstop: a little longer than ours, so
		// the caller normally sees its own deadline (and the cancel frame
		// sent then releases the server's side at once).
		req.timeout = max(time.Until(dl), time.Millisecond) + serverTimeoutMargin
	}
	ch := make(chan response, 1)
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		return response{}, err
	}
	s.pending[req.id] = ch
	s.mu.Unlock()
	if err := s.write(ctx, encodeRequest(req)); err != nil {
		s.forget(req.id)
		return response{}, err
	}
	select {
	case r := <-ch:
		return r, nil
	case <-s.done:
		select {
		case r := <-ch: // answered just before the break
			return r, nil
		default:
		}
		return response{}, s.err
	case <-ctx.Done():
		s.forget(req.id)
		if req.op == opGet || req.op == opWait {
			s.cancelRemote(req.id)
		}
		return response{}, ctxError(ctx)
	}
}

func (s *session) forget(id uint64) {
	s.mu.Lock()
	delete(s.pending, id)
	s.mu.Unlock()
}

// cancelRemote tells the server to drop a blocking request, best effort and
// bounded in time; the request's own timeout ends it on the server anyway.
func (s *session) cancelRemote(id uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	// A failed write fails the session, and with it the request to cancel.
	_ = s.write(ctx, encodeRequest(request{op: opCancel, id: s.nextID.Add(1), target: id}))
}

// do runs one call: it applies the client timeout, checks the size, gets a
// session, and turns the response's status into an error.
func (c *Client) do(ctx context.Context, op, key string, req request) (response, error) {
	wrap := func(err error) error { return &Error{Op: op, Key: key, Addr: c.addr, Err: err} }
	if ctx == nil {
		ctx = context.Background()
	}
	if n := requestSize(req); n > c.opts.maxFrame {
		return response{}, wrap(fmt.Errorf("%w: request of %d bytes, limit %d", ErrFrameTooLarge, n, c.opts.maxFrame))
	}
	if c.opts.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, c.opts.timeout, clientTimeout(c.opts.timeout))
		defer cancel()
	}
	if ctx.Err() != nil {
		return response{}, wrap(ctxError(ctx))
	}
	s, err := c.session(ctx)
	if err != nil {
		return response{}, wrap(err)
	}
	r, err := s.roundTrip(ctx, req)
	if err != nil {
		return response{}, wrap(err)
	}
	switch r.status {
	case statusError:
		return response{}, wrap(&ServerError{Msg: string(r.payload)})
	case statusTimeout:
		if ctx.Err() != nil {
			return response{}, wrap(ctxError(ctx))
		}
		return response{}, wrap(&timeoutError{what: "deadline passed on the server"})
	}
	return r, nil
}

// Set stores value under key, replacing any earlier value, and wakes every
// call waiting for key.
func (c *Client) Set(ctx context.Context, key string, value []byte) error {
	_, err := c.do(ctx, "set", key, request{op: opSet, key: key, value: value})
	return err
}

// Get returns the value of key, blocking until some client sets it or the
// context or the client timeout ends.
func (c *Client) Get(ctx context.Context, key string) ([]byte, error) {
	r, err := c.do(ctx, "get", key, request{op: opGet, key: key})
	if err != nil {
		return nil, err
	}
	return r.payload, nil
}

// Wait blocks until every one of keys exists (all at the same moment), or
// the context or the client timeout ends. Wait with no keys returns at once.
func (c *Client) Wait(ctx context.Context, keys ...string) error {
	if len(keys) == 0 {
		return nil
	}
	_, err := c.do(ctx, "wait", joinKeys(keys), request{op: opWait, keys: keys})
	return err
}

// Add adds delta to the counter at key, atomically, and returns the new
// value. A missing key counts as 0. Counters are stored as decimal text, so
// Get returns e.g. "3"; Add on a value that is not a decimal integer, or
// that would overflow int64, is an error. Add wakes waiters of key.
func (c *Client) Add(ctx context.Context, key string, delta int64) (int64, error) {
	r, err := c.do(ctx, "add", key, request{op: opAdd, key: key, delta: delta})
	if err != nil {
		return 0, err
	}
	if len(r.payload) != 8 {
		return 0, &Error{Op: "add", Key: key, Addr: c.addr,
			Err: fmt.Errorf("%w: add reply of %d bytes", ErrProtocol, len(r.payload))}
	}
	return int64(binary.BigEndian.Uint64(r.payload)), nil
}

// Delete removes key and reports whether it existed.
func (c *Client) Delete(ctx context.Context, key string) (bool, error) {
	r, err := c.do(ctx, "delete", key, request{op: opDelete, key: key})
	if err != nil {
		return false, err
	}
	return len(r.payload) == 1 && r.payload[0] == 1, nil
}

// Barrier blocks until n callers (in any processes) have called Barrier with
// the same name, or the context or the client timeout ends. Each name is
// for one use: it uses the keys "barrier/<name>/count" and
// "barrier/<name>/done", and a name that has already been passed returns at
// once for the first n callers and fails for the (n+1)-th. Use a new name
// (e.g. with a counter) for every barrier.
func (c *Client) Barrier(ctx context.Context, name string, n int) error {
	if n < 1 {
		return &Error{Op: "barrier", Key: name, Addr: c.addr, Err: fmt.Errorf("%w: n = %d, want >= 1", ErrInvalid, n)}
	}
	if c.opts.timeout > 0 {
		// One bound for the whole barrier, not one per step.
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, c.opts.timeout, clientTimeout(c.opts.timeout))
		defer cancel()
	}
	countKey := "barrier/" + name + "/count"
	doneKey := "barrier/" + name + "/done"
	v, err := c.Add(ctx, countKey, 1)
	if err != nil {
		return barrierErr(name, n, err)
	}
	switch {
	case v > int64(n):
		return &Error{Op: "barrier", Key: name, Addr: c.addr,
			Err: fmt.Errorf("%w: %d callers arrived at a barrier for %d (barrier names are single-use)", ErrInvalid, v, n)}
	case v == int64(n):
		if err := c.Set(ctx, doneKey, []byte("1")); err != nil {
			return barrierErr(name, n, err)
		}
	}
	if err := c.Wait(ctx, doneKey); err != nil {
		return barrierErr(name, n, err)
	}
	return nil
}

func barrierErr(name string, n int, err error) error {
	var e *Error
	if errors.As(err, &e) {
		return &Error{Op: "barrier", Key: name, Addr: e.Addr,
			Err: fmt.Errorf("%d callers expected: %s %q: %w", n, e.Op, e.Key, e.Err)}
	}
	return err
}

// joinKeys names the keys of a wait in errors, shortened when long.
func joinKeys(keys []string) string {
	const maxShown = 8
	if len(keys) <= maxShown {
		return strings.Join(keys, ",")
	}
	return strings.Join(keys[:maxShown], ",") + fmt.Sprintf(",... (%d keys)", len(keys))
}
