package pp

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// TestTransportSequenceSharded: an activation whose sequence dim is
// sharded over a cp axis (context parallelism) arrives with the sender's
// spec, load balanced (placement.ShardBalanced) or plain, so the receiver
// reads its rows as the same global positions; a dim sharded over two
// axes in other than mesh order, which the header cannot carry, is
// refused with ErrInvalid at the sender.
func TestTransportSequenceSharded(t *testing.T) {
	for _, pl := range []placement.Placement{placement.ShardBalanced(1), placement.Shard(1)} {
		t.Run(pl.String(), func(t *testing.T) {
			err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
				m, err := mesh.New(c, []int{2, 2}, []string{"pp", "cp"})
				if err != nil {
					return err
				}
				tr, err := NewTransport(ctx, m, "pp")
				if err != nil {
					return err
				}
				// 7 positions over cp=2: uneven chunks either way.
				full := make([]float32, 2*7*3)
				for i := range full {
					full[i] = float32(i)
				}
				s, err := placement.NewSpec(tr.Mesh(), []int{2, 7, 3}, comm.Float32, []placement.Placement{pl})
				if err != nil {
					return err
				}
				want, err := placement.FromFull(s, full)
				if err != nil {
					return err
				}
				if tr.Rank() == 0 {
					if err := tr.Send(ctx, want, 1, 0); err != nil {
						return err
					}
					return tr.Flush(ctx)
				}
				p, err := tr.Post(ctx, 0, 0)
				if err != nil {
					return err
				}
				got, err := p.Wait(ctx)
				if err != nil {
					return err
				}
				if !got.Spec().Equal(want.Spec()) {
					return fmt.Errorf("received spec %v, sent %v", got.Spec(), want.Spec())
				}
				g, w := got.LocalData().([]float32), want.LocalData().([]float32)
				if fmt.Sprint(g) != fmt.Sprint(w) {
					return fmt.Errorf("received block %v, sent %v", g, w)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
	err := local.Run(context.Background(), 8, func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{2, 2, 2}, []string{"pp", "dp", "cp"})
		if err != nil {
			return err
		}
		tr, err := NewTransport(ctx, m, "pp")
		if err != nil {
			return err
		}
		if tr.Rank() != 0 {
			return nil
		}
		s, err := placement.NewSpec(tr.Mesh(), []int{4, 4}, comm.Float32, []placement.Placement{placement.Shard(1), placement.Shard(1)}, placement.WithOrder(1, "cp", "dp"))
		if err != nil {
			return err
		}
		dt, err := placement.NewLocal(s, make([]float32, 4))
		if err != nil {
			return err
		}
		if err := tr.Send(ctx, dt, 1, 0); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Send of a dim sharded over [cp dp] on mesh [dp cp]: %v, want ErrInvalid", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
