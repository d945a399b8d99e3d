//go:build mpi

package mpi_test

import (
	"context"
	"fmt"
	"os"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/commtest"
	"github.com/b7ea7098/loom/comm/mpi"
)

// Every MPI process runs this test binary and is one rank; build it once
// and start it under mpirun:
//
//	go test -tags mpi -c -o /tmp/mpi.test ./comm/mpi
//	mpirun --allow-run-as-root --oversubscribe -np 4 /tmp/mpi.test -test.short
//
// Without mpirun the binary runs as a singleton job of one rank.

// world spans every process of the job.
var world *mpi.Comm

func TestMain(m *testing.M) {
	w, err := mpi.World()
	if err != nil {
		fmt.Fprintln(os.Stderr, "mpi.World:", err)
		os.Exit(2)
	}
	world = w
	code := m.Run()
	if err := mpi.Finalize(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		mpi.AbortJob(3)
	}
	os.Exit(code)
}

// launch runs fn on the first p processes of the world: it splits the
// world (processes from p on pass color -1 and get no communicator), runs
// fn on the part, and frees it. Each process returns only its own rank's
// error; mpirun fails the job if any process fails.
func launch(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
	color := 0
	if world.Rank() >= p {
		color = -1
	}
	c, err := world.SplitComm(ctx, color, 0)
	if err != nil {
		return err
	}
	if c == nil {
		return nil
	}
	if err := fn(ctx, c); err != nil {
		return fmt.Errorf("rank %d: %w", c.Rank(), err)
	}
	return c.Free()
}

// TestConformance runs the backend-independent conformance suite for every
// communicator size from 1 to the world size, each process checking its
// own rank's results.
func TestConformance(t *testing.T) {
	ranks := make([]int, world.Size())
	for i := range ranks {
		ranks[i] = i + 1
	}
	t.Logf("world of %d processes; MPI provided %v", world.Size(), mpi.Provided())
	commtest.Run(t, launch, commtest.Config{Ranks: ranks, Short: testing.Short()})
}
