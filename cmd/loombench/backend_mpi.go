//go:build mpi

package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/mpi"
)

// The MPI backend: one rank per process, started by mpirun, e.g.
//
//	go build -tags mpi -o /tmp/loombench ./cmd/loombench
//	mpirun -np 4 /tmp/loombench -backend mpi -b 1M -e 64M -f 64
//
// MPI chooses its own algorithms, so only auto is offered.
// LOOM_MPI_BLOCKING=1 (mpirun -x LOOM_MPI_BLOCKING=1) measures the blocking
// call mode (mpi.WithBlockingCalls).
func init() {
	backends["mpi"] = backend{
		run: func(ctx context.Context, p int, opts comm.Options, fn func(context.Context, comm.Communicator) error) error {
			w, err := mpi.World(mpi.WithOptions(opts))
			if err != nil {
				return err
			}
			if w.Size() != p {
				return errors.Join(fmt.Errorf("the job has %d processes, not %d", w.Size(), p), w.Free())
			}
			return errors.Join(fn(ctx, w), w.Free())
		},
		algorithms: func(comm.Op) []comm.Algorithm { return nil },
		world: func() (int, int, error) {
			w, err := mpi.World()
			if err != nil {
				return 0, 0, err
			}
			return w.Size(), w.Rank(), w.Free()
		},
		finish: mpi.Finalize,
	}
}
