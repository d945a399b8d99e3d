package local_test

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
)

// Four in-process ranks sum a vector; every rank ends with the total.
func ExampleRun() {
	results := make([][]float32, 4)
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Communicator) error {
		x := []float32{float32(c.Rank()), 1}
		if err := comm.AllReduce(ctx, c, comm.Host(x), comm.Host(x), comm.Sum); err != nil {
			return err
		}
		results[c.Rank()] = x
		return nil
	})
	fmt.Println(results, err)
	// Output: [[6 4] [6 4] [6 4] [6 4]] <nil>
}

// AllToAllV with uneven counts: rank r sends r+1 copies of its rank to each
// peer, so every rank receives 1, 2 and 3 elements from ranks 0, 1 and 2.
func ExampleRun_allToAllV() {
	out := make([][]int32, 3)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		send := make([]int32, 3*(r+1))
		for i := range send {
			send[i] = int32(r)
		}
		recv := make([]int32, 6)
		sendCounts := []int{r + 1, r + 1, r + 1}
		recvCounts := []int{1, 2, 3}
		if err := comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sendCounts, recvCounts); err != nil {
			return err
		}
		out[r] = recv
		return nil
	})
	fmt.Println(out[0], out[2], err)
	// Output: [0 1 1 2 2 2] [0 1 1 2 2 2] <nil>
}

// Forcing an algorithm for one call, and reading back what ran from the
// flight recorder.
func ExampleRun_forcedAlgorithm() {
	_ = local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
		x := comm.Host(make([]float64, 1024))
		if err := c.Do(ctx, comm.Call{Op: comm.OpAllReduce, Send: x, Recv: x, Reduce: comm.Sum, Algorithm: comm.Ring}); err != nil {
			return err
		}
		if c.Rank() == 0 {
			e := c.Recorder().Entries()[0]
			fmt.Println(e.Op, e.Algorithm, e.Bytes, e.State)
		}
		return nil
	})
	// Output: allreduce ring 8192 completed
}

// A fused gather through shared memory: every rank publishes its rows and
// takes row r of every peer straight from the peer's slice, with no send
// or receive buffer in between. Share returns once every rank has read,
// so each rank may then reuse its rows.
func ExampleComm_Share() {
	got := make([][]float32, 3)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		r := c.Rank()
		rows := []float32{float32(10 * r), float32(10*r + 1), float32(10*r + 2)} // rank r's row j: 10r+j
		sm, ok := c.(comm.SharedMemory)
		if !ok {
			return fmt.Errorf("%T does not share memory", c)
		}
		mine := make([]float32, c.Size())
		err := sm.Share(ctx, rows, func(peers []any) error {
			for q, p := range peers {
				mine[q] = p.([]float32)[r] // rank q's row r
			}
			return nil
		})
		got[r] = mine
		return err
	})
	fmt.Println(got, err)
	// Output: [[0 10 20] [1 11 21] [2 12 22]] <nil>
}
