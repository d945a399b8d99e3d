//go:build mpi

package mpi_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// devBuf is a device buffer whose memory the host addresses
// (comm.HostBacked), as the emulated device's.
type devBuf struct{ h *comm.HostBuffer }

func (b devBuf) DType() comm.DType            { return b.h.DType() }
func (b devBuf) Len() int                     { return b.h.Len() }
func (b devBuf) Device() string               { return "emu:0" }
func (b devBuf) Slice(lo, hi int) comm.Buffer { return devBuf{b.h.SliceHost(lo, hi)} }
func (b devBuf) HostView() *comm.HostBuffer   { return b.h }

// opaqueBuf is device memory the host cannot address.
type opaqueBuf struct{ devBuf }

func (opaqueBuf) HostView() {} // not comm.HostBacked's signature

// TestHostBacked: the MPI backend runs collectives on comm.HostBacked
// buffers, in place and not, as comm/local does, and refuses device
// memory the host cannot address before any data moves.
func TestHostBacked(t *testing.T) {
	needRanks(t, 2)
	c := fresh(t, comm.Options{Timeout: 20 * time.Second})
	defer c.Free()
	ctx := context.Background()
	p, r := float32(c.Size()), float32(c.Rank())
	x := []float32{r, 2 * r}
	if err := comm.AllReduce(ctx, c, devBuf{comm.Host(x)}, devBuf{comm.Host(x)}, comm.Sum); err != nil {
		t.Fatal(err)
	}
	want := p * (p - 1) / 2
	if x[0] != want || x[1] != 2*want {
		t.Errorf("rank %d: in-place all-reduce on HostBacked gave %v, want [%v %v]", c.Rank(), x, want, 2*want)
	}
	out := make([]float32, 2*c.Size())
	if err := comm.AllGather(ctx, c, devBuf{comm.Host([]float32{r, r})}, devBuf{comm.Host(out)}); err != nil {
		t.Fatal(err)
	}
	for q := range c.Size() {
		if out[2*q] != float32(q) || out[2*q+1] != float32(q) {
			t.Errorf("rank %d: all-gather on HostBacked gave %v", c.Rank(), out)
			break
		}
	}
	opaque := opaqueBuf{devBuf{comm.Host([]float32{1})}}
	if err := comm.AllReduce(ctx, c, opaque, opaque, comm.Sum); !errors.Is(err, comm.ErrUnsupported) {
		t.Errorf("rank %d: all-reduce on opaque device memory: %v, want ErrUnsupported", c.Rank(), err)
	}
}
