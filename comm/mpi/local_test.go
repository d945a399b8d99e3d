//go:build mpi

package mpi_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/comm/mpi"
)

// TestMatchesLocal runs every collective on the MPI world and, inside this
// process, on comm/local with the same number of ranks and the same
// inputs (commtest.Fill per rank), and checks that this process's rank gets
// the same result from both: bit for bit for data movement, min, max and
// integer reductions, and within a rounding bound for float sums and
// products (the backends may add in different orders). It does so with
// nonblocking and with blocking calls.
func TestMatchesLocal(t *testing.T) {
	for _, w := range worlds() {
		t.Run(w.name, func(t *testing.T) { matchesLocal(t, w.c) })
	}
}

func matchesLocal(t *testing.T, mc *mpi.Comm) {
	p, r := mc.Size(), mc.Rank()
	const n = 1031
	for _, dt := range comm.AllDTypes() {
		for _, op := range []comm.Op{comm.OpAllReduce, comm.OpReduce, comm.OpReduceScatter, comm.OpBroadcast,
			comm.OpAllGather, comm.OpGather, comm.OpScatter, comm.OpAllToAll, comm.OpAllToAllV} {
			rops := []comm.ReduceOp{0}
			if op.Reduces() {
				rops = comm.AllReduceOps()
			}
			for _, rop := range rops {
				name := fmt.Sprintf("%v/%v", op, dt)
				if rop != 0 {
					name += "/" + rop.String()
				}
				seed := uint64(len(name))*7919 + uint64(op)*131 + uint64(dt)*17 + uint64(rop)
				kind := commtest.Mixed
				if rop == comm.Prod {
					kind = commtest.NearOne
				}
				root := (p - 1) / 2
				mk := func(rank int) comm.Call { return makeCall(op, dt, rop, rank, p, n, root, seed, kind) }

				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				want := make([]*comm.HostBuffer, p)
				err := local.Run(ctx, p, func(ctx context.Context, c comm.Communicator) error {
					call := mk(c.Rank())
					if err := c.Do(ctx, call); err != nil {
						return err
					}
					if call.Recv != nil {
						want[c.Rank()] = call.Recv.(*comm.HostBuffer)
					}
					return nil
				}, local.WithOptions(comm.Options{}))
				if err != nil {
					cancel()
					t.Fatalf("%s: local: %v", name, err)
				}
				call := mk(r)
				err = mc.Do(ctx, call)
				cancel()
				if err != nil {
					t.Fatalf("%s: mpi: %v", name, err)
				}
				if call.Recv == nil || (op.Rooted() && op != comm.OpBroadcast && op != comm.OpScatter && r != root) {
					continue
				}
				got := call.Recv.(*comm.HostBuffer)
				inputs := func(q int) []float64 { return commtest.ToFloat64(mk(q).Send.(*comm.HostBuffer)) }
				if msg := compare(got, want[r], dt, rop, p, inputs, op); msg != "" {
					t.Errorf("%s (rank %d of %d): mpi and local differ: %s", name, r, p, msg)
				}
			}
		}
	}
}

// makeCall builds rank's call with inputs from commtest.Fill.
func makeCall(op comm.Op, dt comm.DType, rop comm.ReduceOp, rank, p, n, root int, seed uint64, kind commtest.ValueKind) comm.Call {
	fill := func(m int) *comm.HostBuffer { return commtest.Fill(dt, m, seed, rank, kind) }
	zero := func(m int) *comm.HostBuffer { b, _ := comm.NewHostBuffer(dt, m); return b }
	c := comm.Call{Op: op, Reduce: rop, Root: root}
	switch op {
	case comm.OpAllReduce, comm.OpReduce:
		c.Send, c.Recv = fill(n), zero(n)
	case comm.OpReduceScatter:
		c.Send, c.Recv = fill(p*n), zero(n)
	case comm.OpBroadcast:
		b := fill(n)
		c.Send, c.Recv = b, b
	case comm.OpAllGather:
		c.Send, c.Recv = fill(n), zero(p*n)
	case comm.OpGather:
		c.Send = fill(n)
		if rank == root {
			c.Recv = zero(p * n)
		}
	case comm.OpScatter:
		if rank == root {
			c.Send = fill(p * n)
		}
		c.Recv = zero(n)
	case comm.OpAllToAll:
		c.Send, c.Recv = fill(p*n), zero(p*n)
	case comm.OpAllToAllV:
		count := func(i, j int) int { return (i*5 + j*3) % 7 * n / 5 }
		c.SendCounts, c.RecvCounts = make([]int, p), make([]int, p)
		st, rt := 0, 0
		for j := range p {
			c.SendCounts[j], c.RecvCounts[j] = count(rank, j), count(j, rank)
			st += c.SendCounts[j]
			rt += c.RecvCounts[j]
		}
		c.Send, c.Recv = fill(st), zero(rt)
	}
	if op == comm.OpReduce && rank != root {
		c.Recv = nil
	}
	return c
}

// compare returns "" when got and want agree, else a description of the
// first difference.
func compare(got, want *comm.HostBuffer, dt comm.DType, rop comm.ReduceOp, p int, inputs func(q int) []float64, op comm.Op) string {
	if got.Len() != want.Len() {
		return fmt.Sprintf("lengths %d and %d", got.Len(), want.Len())
	}
	exact := !dt.IsFloat() || rop == 0 || rop == comm.Min || rop == comm.Max
	if exact {
		gb, wb := got.Bytes(), want.Bytes()
		for i := range gb {
			if gb[i] != wb[i] {
				return fmt.Sprintf("byte %d: %#x vs %#x", i, gb[i], wb[i])
			}
		}
		return ""
	}
	g, w := commtest.ToFloat64(got), commtest.ToFloat64(want)
	in := make([][]float64, p)
	for q := range p {
		in[q] = inputs(q)
	}
	off := 0
	if op == comm.OpReduceScatter {
		off = world.Rank() * got.Len()
	}
	u := map[comm.DType]float64{comm.Float32: 0x1p-24, comm.Float64: 0x1p-53, comm.BFloat16: 0x1p-8, comm.Float16: 0x1p-11}[dt]
	for i := range g {
		scale := 0.0
		if rop == comm.Prod {
			scale = 1
			for q := range p {
				scale *= math.Abs(in[q][off+i])
			}
		} else {
			for q := range p {
				scale += math.Abs(in[q][off+i])
			}
		}
		tol := 2*float64(p)*u*scale + u*math.Abs(w[i])
		if d := math.Abs(g[i] - w[i]); !(d <= tol) {
			return fmt.Sprintf("[%d] mpi %v local %v (|diff| %.3g > %.3g)", i, g[i], w[i], d, tol)
		}
	}
	return ""
}
