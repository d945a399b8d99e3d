package launch

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm/nccl"
	"github.com/b7ea7098/loom/comm/rendezvous"
)

// WorldKey is the rendezvous key under which the NCCL backend's world
// communicator is bootstrapped (rank 0 publishes the unique id at
// WorldKey+"/id"); the job's rendezvous server must be fresh, as
// cmd/loomrun's and torchrun's are.
const WorldKey = "loom/launch/world"

// runNCCL runs fn on this process's rank of an NCCL world on GPU
// LocalRank, bootstrapped through the rendezvous server at j.Addr.
func runNCCL(ctx context.Context, j *Job, fn Func) (err error) {
	where := fmt.Sprintf("launch: nccl (RANK=%d LOCAL_RANK=%d)", j.Rank, j.LocalRank)
	lib, err := nccl.Load()
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	dev, err := lib.OpenDevice(j.LocalRank)
	if err != nil {
		return fmt.Errorf("%s: GPU %d: %w", where, j.LocalRank, err)
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	store, err := rendezvous.Dial(ctx, j.Addr)
	if err != nil {
		return fmt.Errorf("%s: rendezvous server %s (MASTER_ADDR, MASTER_PORT): %w", where, j.Addr, err)
	}
	defer func() { err = errors.Join(err, store.Close()) }()
	c, err := nccl.NewComm(ctx, dev, store, WorldKey, j.Rank, j.WorldSize)
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	return runOne(ctx, j, c, fn)
}
