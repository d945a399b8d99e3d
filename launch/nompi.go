//go:build !mpi

package launch

import (
	"context"
	"fmt"
)

const mpiBuilt = false

// runMPI fails: this binary has no MPI backend (Detect says so first).
func runMPI(context.Context, *Job, Func) error {
	return fmt.Errorf("launch: %w: the mpi backend needs a binary built with -tags mpi", ErrInvalid)
}
