package local_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// benchCollective times b.N calls of op on p ranks, reporting bus
// bandwidth like nccl-tests; rank 0's loop is the timed one, and all ranks
// run in lockstep.
func benchCollective(b *testing.B, p int, op comm.Op, algo comm.Algorithm, bytes int) {
	wd, err := local.NewWorld(p)
	if err != nil {
		b.Fatal(err)
	}
	n := bytes / 4
	calls := make([]comm.Call, p)
	for r := range calls {
		send := make([]float32, n)
		recv := make([]float32, n)
		switch op {
		case comm.OpAllGather:
			send = send[:n/p]
			recv = recv[:n/p*p]
		case comm.OpReduceScatter:
			send = send[:n/p*p]
			recv = recv[:n/p]
		}
		calls[r] = comm.Call{Op: op, Send: comm.Host(send), Recv: comm.Host(recv), Reduce: comm.Sum, Algorithm: algo}
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, p)
	b.SetBytes(int64(bytes))
	b.ResetTimer()
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			c := wd.Comm(r)
			for i := 0; i < b.N; i++ {
				if err := c.Do(ctx, calls[r]); err != nil {
					errs[r] = err
					return
				}
			}
		}(r)
	}
	wg.Wait()
	b.StopTimer()
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkAllReduce(b *testing.B) {
	for _, p := range []int{2, 4} {
		for _, size := range []int{8, 4 << 10, 1 << 20, 64 << 20} {
			for _, algo := range append([]comm.Algorithm{comm.Auto}, local.Algorithms(comm.OpAllReduce)...) {
				b.Run(fmt.Sprintf("p=%d/bytes=%d/%v", p, size, algo), func(b *testing.B) {
					benchCollective(b, p, comm.OpAllReduce, algo, size)
				})
			}
		}
	}
}
