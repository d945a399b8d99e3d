package local_test

import (
	"context"
	"errors"

	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// FuzzAllToAllVCounts drives AllToAllV with arbitrary, often inconsistent,
// counts and buffer sizes. Whatever the input, every rank must either
// succeed with exactly the reference result or fail with ErrInvalid before
// any data moved; nothing may panic, hang or time out.
func FuzzAllToAllVCounts(f *testing.F) {
	f.Add([]byte{2, 1, 2, 3, 4, 1, 0})
	f.Add([]byte{3, 0, 0, 0, 1, 1, 1, 2, 2, 2, 1, 0})
	f.Add([]byte{4, 255, 3, 1, 0, 9, 9, 9, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 5})
	f.Add([]byte{1, 7, 1, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		next := func() int {
			if len(data) == 0 {
				return 0
			}
			b := data[0]
			data = data[1:]
			return int(b)
		}
		p := 1 + next()%5
		send := make([][]int, p)
		for i := range send {
			send[i] = make([]int, p)
			for j := range send[i] {
				send[i][j] = int(int8(next())) % 4 // negative counts too
			}
		}
		mode := next()
		recv := make([][]int, p)
		for j := range recv {
			recv[j] = make([]int, p)
			for i := range recv[j] {
				recv[j][i] = send[i][j]
			}
		}
		if mode&1 == 1 { // perturb one expectation
			recv[next()%p][next()%p]++
		}
		slack := make([]int, p) // extra or missing buffer room per rank
		for r := range slack {
			slack[r] = next()%3 - 1
		}
		got := make([][]int32, p)
		errs := make([]error, p)
		err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
			r := c.Rank()
			in := make([]int32, max(0, sum(send[r])+slack[r]))
			for i := range in {
				in[i] = int32(1000*r + i)
			}
			out := make([]int32, max(0, sum(recv[r])+slack[r]))
			for i := range out {
				out[i] = -1
			}
			got[r] = out
			errs[r] = comm.AllToAllV(ctx, c, comm.Host(in), comm.Host(out), send[r], recv[r])
			return nil
		}, withTimeout(10*time.Second))
		if err != nil {
			t.Fatalf("run: %v", err)
		}
		failed := 0
		for r, e := range errs {
			if e == nil {
				continue
			}
			failed++
			if !errors.Is(e, comm.ErrInvalid) {
				t.Fatalf("rank %d: %v is not ErrInvalid", r, e)
			}
			for _, v := range got[r] {
				if v != -1 {
					t.Fatalf("rank %d: data moved although the call failed: %v", r, got[r])
				}
			}
		}
		if failed != 0 && failed != p {
			t.Fatalf("ranks disagree: %v", errs)
		}
		if failed == p {
			return
		}
		for r := 0; r < p; r++ { // the reference
			at := 0
			for q := 0; q < p; q++ {
				off := 0
				for j := 0; j < r; j++ {
					off += send[q][j]
				}
				for k := 0; k < recv[r][q]; k++ {
					if want := int32(1000*q + off + k); got[r][at] != want {
						t.Fatalf("rank %d from %d [%d]: %d, want %d", r, q, k, got[r][at], want)
					}
					at++
				}
			}
		}
	})
}

func sum(xs []int) int {
	s := 0
	for _, x := range xs {
		s += x
	}
	return s
}
