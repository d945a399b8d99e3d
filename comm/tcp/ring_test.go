package tcp_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/tcp"
)

// TestRingSegments runs the ring algorithms on vectors long enough to be
// cut into many segments (and into blocks of unequal length), where a
// segment goes on to the next rank while the following one is still on
// the wire and the all-reduce's two phases overlap. Values are small
// integers, so every order of summation gives the exact result.
func TestRingSegments(t *testing.T) {
	cases := []struct {
		op     comm.Op
		reduce comm.ReduceOp
		p, n   int // ranks; float64 elements of the full vector
	}{
		{comm.OpAllReduce, comm.Sum, 2, 300_001},
		{comm.OpAllReduce, comm.Sum, 3, 200_003},
		{comm.OpAllReduce, comm.Avg, 4, 150_007},
		{comm.OpAllReduce, comm.Max, 3, 40_001},
		{comm.OpReduceScatter, comm.Sum, 3, 3 * 70_001},
		{comm.OpReduceScatter, comm.Avg, 4, 4 * 50_000},
		{comm.OpAllGather, comm.Sum, 3, 3 * 70_001},
	}
	for _, tc := range cases {
		t.Run(fmt.Sprintf("%v/%v/p=%d/n=%d", tc.op, tc.reduce, tc.p, tc.n), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			// Rank r's element i is (r+1)·(i%7+1)·p, so that the average is
			// an integer too.
			val := func(r, i int) float64 { return float64((r + 1) * (i%7 + 1) * tc.p) }
			var sumR, maxR float64
			for r := range tc.p {
				sumR += float64(r + 1)
				maxR = float64(r + 1)
			}
			want := func(i int) float64 {
				base := float64((i%7 + 1) * tc.p)
				switch tc.reduce {
				case comm.Avg:
					return base * sumR / float64(tc.p)
				case comm.Max:
					return base * maxR
				}
				return base * sumR
			}
			err := world(ctx, t, tc.p, func(ctx context.Context, c *tcp.Comm) error {
				r, p, n := c.Rank(), tc.p, tc.n
				var send, recv []float64
				var wantAt func(i int) float64
				switch tc.op {
				case comm.OpAllReduce:
					send, recv, wantAt = make([]float64, n), make([]float64, n), want
					for i := range send {
						send[i] = val(r, i)
					}
				case comm.OpReduceScatter:
					m := n / p
					send, recv = make([]float64, n), make([]float64, m)
					for i := range send {
						send[i] = val(r, i)
					}
					wantAt = func(i int) float64 { return want(r*m + i) }
				case comm.OpAllGather:
					m := n / p
					send, recv = make([]float64, m), make([]float64, n)
					for i := range send {
						send[i] = val(r, r*m+i)
					}
					wantAt = func(i int) float64 { return val(i/m, i) }
				}
				call := comm.Call{Op: tc.op, Send: comm.Host(send), Recv: comm.Host(recv), Reduce: tc.reduce, Algorithm: comm.Ring}
				// Twice: the second call reuses the pooled buffers and the
				// scratch memory of the first.
				for round := range 2 {
					clear(recv)
					if err := c.Do(ctx, call); err != nil {
						return err
					}
					for i, got := range recv {
						if w := wantAt(i); got != w {
							return fmt.Errorf("rank %d, call %d: element %d of %d is %v, want %v", r, round, i, len(recv), got, w)
						}
					}
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
