package local_test

import (
	"context"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// devBuf is a device buffer whose memory the host addresses
// (comm.HostBacked), as the emulated device's.
type devBuf struct{ h *comm.HostBuffer }

func (b devBuf) DType() comm.DType               { return b.h.DType() }
func (b devBuf) Len() int                        { return b.h.Len() }
func (b devBuf) Device() string                  { return "emu:0" }
func (b devBuf) Slice(lo, hi int) comm.Buffer    { return devBuf{b.h.SliceHost(lo, hi)} }
func (b devBuf) HostView() *comm.HostBuffer      { return b.h }
func (b opaqueBuf) Slice(lo, hi int) comm.Buffer { return b }

// opaqueBuf is device memory the host cannot address.
type opaqueBuf struct{ devBuf }

func (opaqueBuf) HostView() {} // not comm.HostBacked's signature

// TestHostBacked runs collectives on comm.HostBacked buffers, in place
// and not, and checks that other device buffers are refused before any
// data moves.
func TestHostBacked(t *testing.T) {
	const p = 3
	err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
		r := float32(c.Rank())
		x := []float32{r, 2 * r}
		if err := comm.AllReduce(ctx, c, devBuf{comm.Host(x)}, devBuf{comm.Host(x)}, comm.Sum); err != nil {
			return err
		}
		if x[0] != 3 || x[1] != 6 {
			t.Errorf("rank %d: in-place all-reduce on HostBacked gave %v", c.Rank(), x)
		}
		all := make([]float32, p)
		all[c.Rank()] = r
		whole := devBuf{comm.Host(all)}
		if err := comm.AllGather(ctx, c, whole.Slice(c.Rank(), c.Rank()+1), whole); err != nil {
			return err
		}
		if all[0] != 0 || all[1] != 1 || all[2] != 2 {
			t.Errorf("rank %d: in-place all-gather on HostBacked gave %v", c.Rank(), all)
		}
		err := comm.AllReduce(ctx, c, opaqueBuf{devBuf{comm.Host(x)}}, devBuf{comm.Host(x)}, comm.Sum)
		if err == nil || !strings.Contains(err.Error(), "unsupported: the local backend needs host or comm.HostBacked buffers, got local_test.opaqueBuf on emu:0") {
			t.Errorf("rank %d: a buffer the host cannot address: %v", c.Rank(), err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
