package tcp

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// protocolVersion changes whenever the frame format does.
const protocolVersion = 2

// handshakeMagic opens every connection, so that a stray client is
// rejected at once.
const handshakeMagic = 0x6c6f6f6d74637031 // "loomtcp1"

// Option configures New.
type Option func(*config)

type config struct {
	opts    comm.Options
	optsSet bool
	listen  string
	job     string
}

// WithOptions sets the communicator options. Without it, comm.OptionsFromEnv
// supplies them.
func WithOptions(o comm.Options) Option {
	return func(c *config) { c.opts, c.optsSet = o, true }
}

// WithListen sets the address this rank listens on ("host:port"; port 0
// picks a free one). The default is an ephemeral port on the interface
// through which this host reaches the store.
func WithListen(addr string) Option {
	return func(c *config) { c.listen = addr }
}

// WithJobID names the job, so that the keys of two jobs sharing a store do
// not collide and a peer of another job fails the handshake. The default is
// "loom".
func WithJobID(id string) Option {
	return func(c *config) { c.job = id }
}

// New joins the world communicator of size ranks as rank, through store:
// it listens, publishes its address under the job's key, connects to every
// peer and checks each one in a handshake. Every rank calls it with the same
// size and job. ctx bounds the setup only. Bad arguments are errors
// matching comm.ErrInvalid; a peer of another job, rank, size or protocol
// version is an error matching ErrHandshake.
func New(ctx context.Context, store *rendezvous.Client, rank, size int, opts ...Option) (*Comm, error) {
	cfg := config{job: "loom"}
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if err := numcheck.Count(comm.ErrInvalid, "size", size); err != nil {
		return nil, fmt.Errorf("tcp: New: %w", err)
	}
	if rank < 0 || rank >= size {
		return nil, fmt.Errorf("tcp: New: %w: rank %d outside [0, %d)", comm.ErrInvalid, rank, size)
	}
	if size > 1 && store == nil {
		return nil, fmt.Errorf("tcp: New: %w: nil store", comm.ErrInvalid)
	}
	if !cfg.optsSet {
		o, err := comm.OptionsFromEnv()
		if err != nil {
			return nil, fmt.Errorf("tcp: %w", err)
		}
		cfg.opts = o
	}
	cfg.opts = cfg.opts.WithDefaults()
	t := newTransport(rank, size)
	if size > 1 {
		if err := connect(ctx, t, store, cfg); err != nil {
			// No writer runs yet to carry goodbyes (close would wait
			// closeGrace for each): drop the connections, which the
			// peers see as this rank's failure.
			t.shut()
			return nil, err
		}
		t.start()
	}
	members := make([]int, size)
	for i := range members {
		members[i] = i
	}
	c := newComm(t, cfg, 0, "world", members, rank)
	return c, nil
}

func jobHash(job string) uint64 {
	h := fnv.New64a()
	io.WriteString(h, job)
	return h.Sum64()
}

// connect builds the mesh: rank r dials every higher rank and accepts every
// lower one.
func connect(ctx context.Context, t *transport, store *rendezvous.Client, cfg config) error {
	listen := cfg.listen
	if listen == "" {
		host, err := localHost(ctx, store.Addr())
		if err != nil {
			return err
		}
		listen = net.JoinHostPort(host, "0")
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", listen)
	if err != nil {
		return fmt.Errorf("tcp: listen on %s: %w", listen, err)
	}
	defer ln.Close()
	key := func(r int) string { return "tcp/" + cfg.job + "/addr/" + strconv.Itoa(r) }
	// The address goes with the world size, so that ranks that disagree
	// on it find out before waiting for ranks the other never expects.
	if err := store.Set(ctx, key(t.rank), []byte(strconv.Itoa(t.size)+" "+ln.Addr().String())); err != nil {
		return fmt.Errorf("tcp: publish address: %w", err)
	}
	hs := handshake{job: jobHash(cfg.job), rank: t.rank, size: t.size}
	// Every rank's address before any connection: a rank that never
	// comes is then named by every rank, rather than hidden behind a
	// peer whose accept timed out first.
	addrs := make([]string, t.size)
	for r := range t.size {
		if r == t.rank {
			continue
		}
		a, err := store.Get(ctx, key(r))
		if err != nil {
			return fmt.Errorf("tcp: address of rank %d: %w", r, err)
		}
		size, addr, _ := strings.Cut(string(a), " ")
		if size != strconv.Itoa(t.size) {
			return fmt.Errorf("%w: rank %d at %s has size %s, this rank %d", ErrHandshake, r, addr, size, t.size)
		}
		addrs[r] = addr
	}

	// Dial and accept at once; the first failure ends both, and is the
	// one reported (a refused handshake, not the wait it caused).
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 2)
	go func() { errc <- accept(ctx, t, ln, hs) }()
	go func() {
		for r := t.rank + 1; r < t.size; r++ {
			if err := dial(ctx, t, addrs[r], r, hs); err != nil {
				errc <- err
				return
			}
		}
		errc <- nil
	}()
	first := <-errc
	if first != nil {
		cancel()
		ln.Close()
		<-errc
		return first
	}
	return <-errc
}

// localHost returns the address of the interface that reaches the store.
func localHost(ctx context.Context, storeAddr string) (string, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "udp", storeAddr)
	if err != nil {
		return "", fmt.Errorf("tcp: find the interface that reaches %s: %w", storeAddr, err)
	}
	defer c.Close()
	host, _, err := net.SplitHostPort(c.LocalAddr().String())
	if err != nil {
		return "", fmt.Errorf("tcp: local address: %w", err)
	}
	return host, nil
}

type handshake struct {
	job        uint64
	rank, size int
}

func (h handshake) encode() []byte {
	b := binary.LittleEndian.AppendUint64(nil, handshakeMagic)
	b = binary.LittleEndian.AppendUint32(b, protocolVersion)
	b = binary.LittleEndian.AppendUint64(b, h.job)
	b = binary.LittleEndian.AppendUint32(b, uint32(h.rank))
	return binary.LittleEndian.AppendUint32(b, uint32(h.size))
}

const handshakeBytes = 28

// check reads the peer's handshake and compares it with ours; want is the
// rank the peer must have, or -1 for any lower rank.
func (h handshake) check(conn net.Conn, want int) (int, error) {
	var b [handshakeBytes]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		return -1, fmt.Errorf("%w: read from %s: %w", ErrHandshake, conn.RemoteAddr(), err)
	}
	magic, ver := binary.LittleEndian.Uint64(b[:]), binary.LittleEndian.Uint32(b[8:])
	job := binary.LittleEndian.Uint64(b[12:])
	rank, size := int(binary.LittleEndian.Uint32(b[20:])), int(binary.LittleEndian.Uint32(b[24:]))
	switch {
	case magic != handshakeMagic:
		return -1, fmt.Errorf("%w: %s is not a loom tcp peer", ErrHandshake, conn.RemoteAddr())
	case ver != protocolVersion:
		return -1, fmt.Errorf("%w: %s speaks protocol %d, this rank %d", ErrHandshake, conn.RemoteAddr(), ver, protocolVersion)
	case job != h.job:
		return -1, fmt.Errorf("%w: %s belongs to another job", ErrHandshake, conn.RemoteAddr())
	case size != h.size:
		return -1, fmt.Errorf("%w: rank %d at %s has size %d, this rank %d", ErrHandshake, rank, conn.RemoteAddr(), size, h.size)
	case want >= 0 && rank != want:
		return -1, fmt.Errorf("%w: %s is rank %d, want %d", ErrHandshake, conn.RemoteAddr(), rank, want)
	case want < 0 && (rank < 0 || rank >= h.rank):
		return -1, fmt.Errorf("%w: %s claims rank %d, which should not dial rank %d", ErrHandshake, conn.RemoteAddr(), rank, h.rank)
	}
	return rank, nil
}

func dial(ctx context.Context, t *transport, addr string, r int, hs handshake) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("tcp: dial rank %d at %s: %w", r, addr, err)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()
	if _, err := conn.Write(hs.encode()); err != nil {
		conn.Close()
		return fmt.Errorf("tcp: handshake with rank %d: %w", r, err)
	}
	if _, err := hs.check(conn, r); err != nil {
		conn.Close()
		return err
	}
	conn.SetDeadline(time.Time{})
	tune(conn)
	t.peers[r] = &peer{rank: r, conn: conn}
	return nil
}

func accept(ctx context.Context, t *transport, ln net.Listener, hs handshake) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	for n := 0; n < t.rank; {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				err = ctx.Err()
			}
			return fmt.Errorf("tcp: accept (%d of %d lower ranks connected): %w", n, t.rank, err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		r, err := hs.check(conn, -1)
		if err == nil && t.peers[r] != nil {
			err = fmt.Errorf("%w: rank %d connected twice", ErrHandshake, r)
		}
		if err == nil {
			_, err = conn.Write(hs.encode())
		}
		if err != nil {
			conn.Close()
			return err
		}
		conn.SetDeadline(time.Time{})
		tune(conn)
		t.peers[r] = &peer{rank: r, conn: conn}
		n++
	}
	return nil
}

// tune disables Nagle's algorithm: small collectives are latency-bound and
// every frame is written whole.
func tune(conn net.Conn) {
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
}

func durationOf(ns int64) time.Duration { return time.Duration(ns) }
