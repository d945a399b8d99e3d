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

// world spans every process of the job; blockingWorld too, with
// WithBlockingCalls.
var world, blockingWorld *mpi.Comm

// worlds are the configurations the backend-wide tests run under.
func worlds() []struct {
	name string
	c    *mpi.Comm
} {
	return []struct {
		name string
		c    *mpi.Comm
	}{{"nonblocking", world}, {"blocking", blockingWorld}}
}

func TestMain(m *testing.M) {
	var err error
	if world, err = mpi.World(); err == nil {
		blockingWorld, err = mpi.World(mpi.WithBlockingCalls(true))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mpi.World:", err)
		os.Exit(2)
	}
	code := m.Run()
	if err := mpi.Finalize(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		mpi.AbortJob(3)
	}
	os.Exit(code)
}

// launcher runs fn on the first p processes of parent: it splits parent
// (processes from p on pass color -1 and get no communicator), runs fn on
// the part, which inherits parent's configuration, and frees it. Each
// process returns only its own rank's error; mpirun fails the job if any
// process fails.
func launcher(parent *mpi.Comm) commtest.Launcher {
	return func(ctx context.Context, p int, fn func(ctx context.Context, c comm.Communicator) error) error {
		color := 0
		if parent.Rank() >= p {
			color = -1
		}
		c, err := parent.SplitComm(ctx, color, 0)
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
}

// TestConformance runs the backend-independent conformance suite for every
// communicator size from 1 to the world size, each process checking its
// own rank's results, with nonblocking and with blocking calls.
func TestConformance(t *testing.T) {
	ranks := make([]int, world.Size())
	for i := range ranks {
		ranks[i] = i + 1
	}
	t.Logf("world of %d processes; MPI provided %v", world.Size(), mpi.Provided())
	for _, w := range worlds() {
		t.Run(w.name, func(t *testing.T) {
			commtest.Run(t, launcher(w.c), commtest.Config{Ranks: ranks, Short: testing.Short()})
		})
	}
}
