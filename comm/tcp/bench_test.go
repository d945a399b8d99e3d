package tcp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/tcp"
)

// BenchmarkTCP measures AllReduce, AllGather, ReduceScatter and AllToAll
// over loopback with p ranks in one process, each on its own
// connections. bytes is the size of the full buffer (AllReduce's vector,
// AllGather's output, ReduceScatter's and AllToAll's input); busbw follows
// nccl-tests: AllReduce moves 2(p-1)/p of it per rank, the others
// (p-1)/p. The metric times the calls alone, between two barriers,
// without the setup of the mesh; the 8-byte AllReduce is the latency of a
// scalar's all-reduce (ns/op).
func BenchmarkTCP(b *testing.B) {
	for _, p := range []int{2, 4} {
		b.Run(fmt.Sprintf("%v/p=%d/bytes=8", comm.OpAllReduce, p), func(b *testing.B) {
			benchTCP(b, comm.OpAllReduce, p, 8)
		})
	}
	for _, op := range []comm.Op{comm.OpAllReduce, comm.OpAllGather, comm.OpReduceScatter, comm.OpAllToAll} {
		for _, p := range []int{2, 4} {
			for _, size := range []int{1 << 20, 64 << 20} {
				b.Run(fmt.Sprintf("%v/p=%d/bytes=%d", op, p, size), func(b *testing.B) {
					benchTCP(b, op, p, size)
				})
			}
		}
	}
}

func benchTCP(b *testing.B, op comm.Op, p, size int) {
	n := size / 4
	var elapsed time.Duration
	err := world(context.Background(), b, p, func(ctx context.Context, c *tcp.Comm) error {
		recv := comm.Host(make([]float32, n))
		var send comm.Buffer = recv
		switch op {
		case comm.OpAllGather:
			send = recv.Slice(c.Rank()*(n/p), (c.Rank()+1)*(n/p))
			recv = recv.SliceHost(0, n/p*p)
		case comm.OpReduceScatter:
			send = recv.SliceHost(0, n/p*p)
			recv = comm.Host(make([]float32, n/p))
		case comm.OpAllToAll:
			send = recv.SliceHost(0, n/p*p)
			recv = comm.Host(make([]float32, n/p*p))
		}
		call := comm.Call{Op: op, Send: send, Recv: recv, Reduce: comm.Sum}
		if err := comm.Barrier(ctx, c); err != nil {
			return err
		}
		start := time.Now()
		for range b.N {
			if err := c.Do(ctx, call); err != nil {
				return err
			}
		}
		if err := comm.Barrier(ctx, c); err != nil {
			return err
		}
		if c.Rank() == 0 {
			elapsed = time.Since(start)
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	factor := float64(p-1) / float64(p)
	if op == comm.OpAllReduce {
		factor *= 2
	}
	per := elapsed.Seconds() / float64(b.N)
	b.ReportMetric(float64(size)*factor/per/1e9, "busbw_GB/s")
}
