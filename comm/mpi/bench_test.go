//go:build mpi

package mpi_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/mpi"
)

// TestAllReduceBench compares float32 AllReduce (sum, out of place)
// through this binding, in both call modes, with raw MPI on the same
// buffers: MPI_Allreduce, and MPI_Iallreduce then MPI_Wait, called
// directly. The four take turns in rounds (in a rotating order), so that a
// noisy machine affects them alike, and the ratios come from one run;
// within a round each runs its calls back to back, the ranks in lockstep
// through the operation itself, as loombench and raw MPI benchmarks run.
// Go's benchmark loop picks its iteration count per process, which
// separate MPI processes would not agree on, so this is a test with fixed
// counts, run only when LOOM_MPI_BENCH is set:
//
//	LOOM_MPI_BENCH=1 mpirun -np 4 /tmp/mpi.test -test.run AllReduceBench -test.v
//
// LOOM_MPI_BENCH_BYTES sets the sizes (comma-separated bytes, default
// 1 MiB and 64 MiB) and LOOM_MPI_BENCH_ITERS the iterations. Rank 0
// prints, per size and way, the median over iterations of the slowest
// rank's time, and loom's ratios to raw MPI.
func TestAllReduceBench(t *testing.T) {
	if os.Getenv("LOOM_MPI_BENCH") == "" {
		t.Skip("set LOOM_MPI_BENCH=1 to run")
	}
	sizes := []int{1 << 20, 64 << 20}
	if s := os.Getenv("LOOM_MPI_BENCH_BYTES"); s != "" {
		sizes = sizes[:0]
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 4 {
				t.Fatalf("LOOM_MPI_BENCH_BYTES: bad size %q", f)
			}
			sizes = append(sizes, n)
		}
	}
	iters := 0
	if s := os.Getenv("LOOM_MPI_BENCH_ITERS"); s != "" {
		var err error
		if iters, err = strconv.Atoi(s); err != nil || iters < 1 {
			t.Fatalf("LOOM_MPI_BENCH_ITERS: bad count %q", s)
		}
	}
	const rounds = 10
	ctx := context.Background()
	type way struct {
		name string
		call func(send, recv []float32) error
	}
	ways := []way{
		{"raw MPI_Allreduce", func(s, r []float32) error { return mpi.RawAllReduce(world, s, r, true) }},
		{"raw MPI_Iallreduce+Wait", func(s, r []float32) error { return mpi.RawAllReduce(world, s, r, false) }},
		{"loom nonblocking", func(s, r []float32) error {
			return comm.AllReduce(ctx, world, comm.Host(s), comm.Host(r), comm.Sum)
		}},
		{"loom blocking", func(s, r []float32) error {
			return comm.AllReduce(ctx, blockingWorld, comm.Host(s), comm.Host(r), comm.Sum)
		}},
	}
	for _, bytes := range sizes {
		n := bytes / 4
		send, recv := make([]float32, n), make([]float32, n)
		for i := range send {
			send[i] = float32(i % 7)
		}
		k := iters
		if k == 0 {
			k = max(20, min(200, (512<<20)/bytes))
		}
		k = (k + rounds - 1) / rounds * rounds
		times := make([][]float64, len(ways)) // µs, per way and iteration
		for i := range times {
			times[i] = make([]float64, 0, k)
		}
		for round := range rounds {
			for j := range ways {
				w := (round + j) % len(ways)
				for it := -2; it < k/rounds; it++ { // two warmup calls
					t0 := time.Now()
					if err := ways[w].call(send, recv); err != nil {
						t.Fatalf("%s: %v", ways[w].name, err)
					}
					if it >= 0 {
						times[w] = append(times[w], float64(time.Since(t0).Nanoseconds())/1e3)
					}
				}
			}
		}
		med := make([]float64, len(ways))
		for w := range ways {
			// The slowest rank's time per iteration, then the median.
			if err := comm.AllReduce(ctx, world, comm.Host(times[w]), comm.Host(times[w]), comm.Max); err != nil {
				t.Fatal(err)
			}
			slices.Sort(times[w])
			med[w] = (times[w][(k-1)/2] + times[w][k/2]) / 2
		}
		if world.Rank() != 0 {
			continue
		}
		fmt.Printf("allreduce float32 sum, %d ranks, %d B, %d iterations: median of the slowest rank's time\n", world.Size(), bytes, k)
		for w, x := range ways {
			fmt.Printf("  %-24s %10.1f us\n", x.name, med[w])
		}
		rawBest := min(med[0], med[1])
		fmt.Printf("  loom nonblocking / raw MPI_Iallreduce+Wait %.2f, loom blocking / raw MPI_Allreduce %.2f, loom's best / raw's best %.2f\n",
			med[2]/med[1], med[3]/med[0], min(med[2], med[3])/rawBest)
	}
}
