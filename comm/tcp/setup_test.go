package tcp_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
)

// New rejects bad arguments before touching the network.
func TestNewInvalid(t *testing.T) {
	for _, tc := range []struct {
		name       string
		rank, size int
		store      bool
	}{
		{"size 0", 0, 0, true},
		{"rank negative", -1, 2, true},
		{"rank too large", 2, 2, true},
		{"no store", 0, 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var cl *rendezvous.Client
			if tc.store {
				var err error
				cl, err = rendezvous.Dial(context.Background(), store(t).Addr())
				if err != nil {
					t.Fatal(err)
				}
				defer cl.Close()
			}
			_, err := tcp.New(context.Background(), cl, tc.rank, tc.size)
			if !errors.Is(err, comm.ErrInvalid) {
				t.Errorf("New(rank %d, size %d): %v, want ErrInvalid", tc.rank, tc.size, err)
			}
		})
	}
}

// A peer that disagrees on the world size fails the handshake.
func TestHandshakeSizeMismatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr := store(t).Addr()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r, size := range []int{2, 3} {
		wg.Go(func() {
			cl, err := rendezvous.Dial(ctx, addr)
			if err != nil {
				errs[r] = err
				return
			}
			defer cl.Close()
			c, err := tcp.New(ctx, cl, r, size, tcp.WithJobID("sizes"), tcp.WithListen("127.0.0.1:0"))
			if err == nil {
				c.Close()
			}
			errs[r] = err
		})
	}
	wg.Wait()
	// Each reads the other's size with its address and refuses.
	if !errors.Is(errs[1], tcp.ErrHandshake) {
		t.Errorf("rank 1: %v, want ErrHandshake", errs[1])
	}
	if errs[0] == nil {
		t.Error("rank 0 joined a world whose peer disagrees on its size")
	}
}

// A setup that fails (a rank that never comes) returns when its context
// ends, on the ranks that connected to each other too: they do not wait
// to say goodbye on connections that carry nothing yet.
func TestSetupFailsInTime(t *testing.T) {
	const bound = 500 * time.Millisecond
	addr := store(t).Addr()
	start := time.Now()
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for r := range 2 { // of 3: rank 2 never comes
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			cl, err := rendezvous.Dial(ctx, addr)
			if err != nil {
				errs[r] = err
				return
			}
			defer cl.Close()
			c, err := tcp.New(ctx, cl, r, 3, tcp.WithJobID("missing"), tcp.WithListen("127.0.0.1:0"))
			if err == nil {
				c.Close()
			}
			errs[r] = err
		})
	}
	wg.Wait()
	if el := time.Since(start); el > 2*bound {
		t.Errorf("the failed setup took %v, more than twice its context's %v", el, bound)
	}
	for r, err := range errs {
		if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "rank 2") {
			t.Errorf("rank %d: %v; want a timeout waiting for rank 2", r, err)
		}
	}
}
