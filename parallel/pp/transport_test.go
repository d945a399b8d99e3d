package pp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// TestTransportShapes: tensors of shapes the receiver does not know in
// advance arrive with their spec (shape, dtype, placements on the stage's
// mesh) and data; a header the receiver cannot take is refused with
// ErrMismatch naming the peer and tag.
// It runs on comm/local's ranks and on comm/tcp's (real TCP connections
// over loopback).
func TestTransportShapes(t *testing.T) {
	for _, backend := range []string{"local", "tcp"} {
		t.Run(backend, func(t *testing.T) {
			if err := runOn(t, backend, 2, transportRank); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// runOn runs fn on p ranks of a fresh world of backend: "local" or "tcp"
// (each rank with its own rendezvous client and TCP connections, as
// separate processes would have them).
func runOn(t *testing.T, backend string, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if backend == "local" {
		return local.Run(ctx, p, fn)
	}
	srv, err := rendezvous.Listen(ctx, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := range p {
		wg.Go(func() {
			cl, err := rendezvous.Dial(ctx, srv.Addr())
			if err != nil {
				errs[r] = err
				return
			}
			defer cl.Close()
			c, err := tcp.New(ctx, cl, r, p, tcp.WithListen("127.0.0.1:0"))
			if err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
				return
			}
			defer c.Close()
			errs[r] = fn(ctx, c)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// transportRank is one rank of TestTransportShapes.
func transportRank(ctx context.Context, c comm.Communicator) error {
	shapes := [][]int{{2, 3}, {5}, {1, 2, 4}, {3, 0}}
	m, err := mesh.New(c, []int{2, 1}, []string{"pp", "dp"})
	if err != nil {
		return err
	}
	tr, err := NewTransport(ctx, m, "pp")
	if err != nil {
		return err
	}
	if tr.Rank() == 0 {
		for i, sh := range shapes {
			n := 1
			for _, d := range sh {
				n *= d
			}
			pl := []placement.Placement{placement.Replicate()}
			if i == 2 {
				pl = []placement.Placement{placement.Partial(comm.Sum)}
			}
			s, err := placement.NewSpec(tr.Mesh(), sh, comm.Float32, pl)
			if err != nil {
				return err
			}
			d := make([]float32, n)
			for j := range d {
				d[j] = float32(i*100 + j)
			}
			dt, err := placement.NewLocal(s, d)
			if err != nil {
				return err
			}
			if err := tr.Send(ctx, dt, 1, i); err != nil {
				return err
			}
		}
		// A header that is not one.
		if err := comm.Send(ctx, tr.c, comm.Host(make([]int64, headerLen)), 1, 2*len(shapes)); err != nil {
			return err
		}
		return tr.Flush(ctx)
	}
	// Post them all lazily in reverse order: tags, not order, match.
	var ps []*Pending
	for i := len(shapes) - 1; i >= 0; i-- {
		p, err := tr.Post(ctx, 0, i)
		if err != nil {
			return err
		}
		ps = append([]*Pending{p}, ps...)
	}
	for i, p := range ps {
		dt, err := p.Wait(ctx)
		if err != nil {
			return err
		}
		if !slices.Equal(dt.Spec().Shape(), shapes[i]) {
			return fmt.Errorf("tensor %d: shape %v, sent %v", i, dt.Spec().Shape(), shapes[i])
		}
		if i == 2 && !dt.Spec().Placements()[0].IsPartial() {
			return fmt.Errorf("tensor 2: placements %v, sent Partial(sum)", dt.Spec().Placements())
		}
		d := dt.LocalData().([]float32)
		for j, v := range d {
			if v != float32(i*100+j) {
				return fmt.Errorf("tensor %d[%d] = %v", i, j, v)
			}
		}
	}
	p, err := tr.Post(ctx, 0, len(shapes))
	if err != nil {
		return err
	}
	if _, err := p.Wait(ctx); !errors.Is(err, ErrMismatch) {
		return fmt.Errorf("a bad header: %v, want ErrMismatch", err)
	}
	return nil
}
