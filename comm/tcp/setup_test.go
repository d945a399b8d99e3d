package tcp_test

import (
	"context"
	"errors"
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
	// Rank 0 dials rank 1, which checks the handshake first and refuses.
	if !errors.Is(errs[1], tcp.ErrHandshake) {
		t.Errorf("rank 1: %v, want ErrHandshake", errs[1])
	}
	if errs[0] == nil {
		t.Error("rank 0 joined a world whose peer disagrees on its size")
	}
}
