package tcp_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
)

// jobs numbers the worlds of a test binary, so that worlds sharing a store
// never read each other's addresses.
var jobs atomic.Uint64

// world runs fn on p ranks of a fresh tcp world over loopback, each rank
// with its own store client, as separate processes would have: real TCP
// connections, in one test process.
func world(ctx context.Context, t testing.TB, p int, fn func(ctx context.Context, c *tcp.Comm) error, opts ...tcp.Option) error {
	srv := store(t)
	job := fmt.Sprintf("job%d", jobs.Add(1))
	errs := make([]error, p)
	comms := make([]*tcp.Comm, p)
	var wg sync.WaitGroup
	for r := range p {
		wg.Go(func() {
			cl, err := rendezvous.Dial(ctx, srv.Addr())
			if err != nil {
				errs[r] = err
				return
			}
			defer cl.Close()
			all := append([]tcp.Option{tcp.WithJobID(job), tcp.WithListen("127.0.0.1:0")}, opts...)
			c, err := tcp.New(ctx, cl, r, p, all...)
			if err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				return
			}
			comms[r] = c
			errs[r] = fn(ctx, c)
		})
	}
	wg.Wait()
	for _, c := range comms {
		if c != nil {
			c.Close()
		}
	}
	return errors.Join(errs...)
}

var (
	storeOnce sync.Once
	storeSrv  *rendezvous.Server
	storeErr  error
)

// store is one rendezvous server for the whole test binary.
func store(t testing.TB) *rendezvous.Server {
	storeOnce.Do(func() { storeSrv, storeErr = rendezvous.Listen(context.Background(), "127.0.0.1:0") })
	if storeErr != nil {
		t.Fatal(storeErr)
	}
	return storeSrv
}

// TestConformance runs the backend-independent conformance suite over
// loopback TCP for 1 to 5 ranks: every collective, size (odd, uneven,
// empty), dtype, reduce op, root and algorithm against a serial reference.
func TestConformance(t *testing.T) {
	opts, err := comm.OptionsFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	opts.RecorderSize = 64
	launch := func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		return world(ctx, t, p, func(ctx context.Context, c *tcp.Comm) error { return fn(ctx, c) }, tcp.WithOptions(opts))
	}
	commtest.Run(t, launch, commtest.Config{
		Ranks:      []int{1, 2, 3, 4, 5},
		Algorithms: tcp.Algorithms,
		Short:      testing.Short(),
	})
}
