package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
	"github.com/b7ea7098/loom/launch"
)

// The TCP backend: one rank per process over TCP (comm/tcp, pure Go),
// started by loomrun or torchrun, the ranks meeting at the rendezvous
// server at MASTER_ADDR:MASTER_PORT, e.g.
//
//	go build -o /tmp/loombench ./cmd/loombench
//	loomrun -n 4 /tmp/loombench -backend tcp -b 1M -e 64M -f 64
//
// The world is joined once, at the first measurement, and serves every
// later one; the last closes it. Its algorithms can be forced (-algo) as
// on the local backend.
func init() { backends["tcp"] = tcpBackend(os.Getenv) }

// tcpBackend returns the TCP backend of the process whose environment
// getenv reads.
func tcpBackend(getenv func(string) string) backend {
	w := &tcpWorld{getenv: getenv}
	return backend{run: w.run, algorithms: tcp.Algorithms, world: w.size, finish: w.close}
}

// tcpWorld is this process's rank of the job's TCP world, joined at the
// first run.
type tcpWorld struct {
	getenv func(string) string
	mu     sync.Mutex
	job    *launch.Job
	c      *tcp.Comm
	err    error // the join's error, returned by every later run
}

// size returns the job's size and this process's rank from the
// environment loomrun or torchrun sets (launch.Detect's checks).
func (w *tcpWorld) size() (int, int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.job == nil {
		ws := strings.TrimSpace(w.getenv("WORLD_SIZE"))
		n, err := strconv.Atoi(ws)
		if err != nil || n < 1 {
			return 0, 0, fmt.Errorf("-backend tcp: WORLD_SIZE=%q: start loombench with loomrun -n N or torchrun", ws)
		}
		job, err := launch.Detect(w.getenv, launch.TCP, n)
		if err != nil {
			return 0, 0, fmt.Errorf("-backend tcp: %w", err)
		}
		w.job = job
	}
	return w.job.WorldSize, w.job.Rank, nil
}

// run joins the world at the first call (bounded by opts.Timeout) and
// runs fn on it.
func (w *tcpWorld) run(ctx context.Context, p int, opts comm.Options, fn func(context.Context, comm.Communicator) error) error {
	size, _, err := w.size()
	if err != nil {
		return err
	}
	if size != p {
		return fmt.Errorf("-backend tcp: the job has %d processes, not %d", size, p)
	}
	w.mu.Lock()
	if w.c == nil && w.err == nil {
		w.c, w.err = joinTCP(ctx, w.job, opts)
	}
	c, err := w.c, w.err
	w.mu.Unlock()
	if err != nil {
		return err
	}
	return fn(ctx, c)
}

// joinTCP connects this process's rank to the others through the
// rendezvous server, which serves the setup only.
func joinTCP(ctx context.Context, job *launch.Job, opts comm.Options) (*tcp.Comm, error) {
	opts = opts.WithDefaults()
	setup, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	store, err := rendezvous.Dial(setup, job.Addr)
	if err != nil {
		return nil, fmt.Errorf("-backend tcp: rank %d: rendezvous server %s: %w", job.Rank, job.Addr, err)
	}
	c, err := tcp.New(setup, store, job.Rank, job.WorldSize, tcp.WithOptions(opts), tcp.WithJobID("loombench"))
	if cerr := store.Close(); err == nil && cerr != nil {
		c.Close()
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("-backend tcp: rank %d: joining the %d ranks: %w", job.Rank, job.WorldSize, err)
	}
	return c, nil
}

// close closes the world, if it was joined.
func (w *tcpWorld) close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.c == nil {
		return nil
	}
	err := w.c.Close()
	w.c, w.err = nil, errors.New("-backend tcp: the world is closed")
	return err
}
