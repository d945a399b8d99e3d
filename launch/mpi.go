//go:build mpi

package launch

import (
	"context"
	"fmt"
	"os"

	"github.com/b7ea7098/loom/comm/mpi"
)

const mpiBuilt = true

// runMPI runs fn on this process's rank of mpi.World and ends the rank as
// endMPIRank says: MPI_Finalize after a clean run, MPI_Abort of the whole
// job after a communication failure.
func runMPI(ctx context.Context, j *Job, fn Func) error {
	world, err := mpi.World()
	if err != nil {
		return fmt.Errorf("launch: mpi: %w", err)
	}
	err = runOne(ctx, j, world, fn)
	return endMPIRank(j.Rank, err, mpi.Finalize, mpi.AbortJob, os.Stderr)
}
