//go:build mpi

package mpi_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
)

// TestAllReduceBench times float32 AllReduce (sum, out of place) through
// this binding. Go's benchmark loop picks its iteration count per process,
// which separate MPI processes would not agree on, so this is a test with
// fixed counts, run only when LOOM_MPI_BENCH is set:
//
//	LOOM_MPI_BENCH=1 mpirun -np 4 /tmp/mpi.test -test.run AllReduceBench -test.v
//
// It prints, on rank 0, the mean time per call (the slowest rank's) for
// each size, in the nccl-tests columns of DESIGN §8.
func TestAllReduceBench(t *testing.T) {
	if os.Getenv("LOOM_MPI_BENCH") == "" {
		t.Skip("set LOOM_MPI_BENCH=1 to run")
	}
	sizes := []int{1 << 20, 64 << 20}
	if s := os.Getenv("LOOM_MPI_BENCH_BYTES"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		sizes = []int{n}
	}
	ctx := context.Background()
	p := world.Size()
	for _, bytes := range sizes {
		n := bytes / 4
		send, recv := make([]float32, n), make([]float32, n)
		for i := range send {
			send[i] = float32(i % 7)
		}
		iters := max(10, min(200, (256<<20)/bytes))
		run := func(k int) {
			for range k {
				if err := comm.AllReduce(ctx, world, comm.Host(send), comm.Host(recv), comm.Sum); err != nil {
					t.Fatal(err)
				}
			}
		}
		run(3)
		if err := comm.Barrier(ctx, world); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		run(iters)
		us := []float64{float64(time.Since(start).Microseconds()) / float64(iters)}
		if err := comm.AllReduce(ctx, world, comm.Host(us), comm.Host(us), comm.Max); err != nil {
			t.Fatal(err)
		}
		if world.Rank() == 0 {
			algbw := float64(bytes) / us[0] / 1e3
			busbw := algbw * 2 * float64(p-1) / float64(p)
			fmt.Printf("impl,op,variant,nranks,bytes,iters,time_us,min_us,algbw_GBps,busbw_GBps,note\n")
			fmt.Printf("loom-mpi,allreduce,out-of-place,%d,%d,%d,%.1f,,%.3f,%.3f,float32 sum\n", p, bytes, iters, us[0], algbw, busbw)
		}
	}
}
