//go:build mpi

package launch

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm/mpi"
)

const mpiBuilt = true

// runMPI runs fn on this process's rank of mpi.World and finalises MPI.
func runMPI(ctx context.Context, j *Job, fn Func) error {
	world, err := mpi.World()
	if err != nil {
		return fmt.Errorf("launch: mpi: %w", err)
	}
	err = runOne(ctx, j, world, fn)
	if ferr := mpi.Finalize(); ferr != nil {
		// Finalize refuses when an abort left operations posted; the
		// error (and mpirun, on the non-zero exit) ends the job.
		err = errors.Join(err, fmt.Errorf("launch: mpi: %w", ferr))
	}
	return err
}
