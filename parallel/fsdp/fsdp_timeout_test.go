package fsdp

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
)

// TestFSDPTimeoutNamesLateRank: under WithReshardTo(2) on fsdp=4, rank 1
// sleeps in a unit's enter hook past the communicator's timeout. Rank 0
// then waits for it in the group all-gather of backward while ranks 2
// and 3 wait in the reduce-scatter for ranks 0 and 1; every rank's error
// must blame rank 1, not the rank 0 that ranks 2 and 3 were blocked on.
func TestFSDPTimeoutNamesLateRank(t *testing.T) {
	t.Setenv(comm.CostModelEnv, comm.CostModelOff)
	const p, late, timeout = 4, 1, 300 * time.Millisecond
	for run := range 3 {
		errs := make([]error, p)
		_ = local.Run(context.Background(), p, func(ctx context.Context, world comm.Communicator) error {
			m, err := mesh.New(world, []int{p}, []string{"fsdp"})
			if err != nil {
				return err
			}
			n, err := newFnet(m, comm.Float64)
			if err != nil {
				return err
			}
			f, err := FullyShard(ctx, n, []string{"h.*"}, WithReshardTo(2))
			if err != nil {
				return err
			}
			if world.Rank() == late {
				n.list.blocks[1].OnEnter(func(context.Context) error {
					time.Sleep(2 * timeout)
					return nil
				})
			}
			err = n.step(ctx, m, f)
			errs[world.Rank()] = err
			return err
		}, local.WithOptions(comm.Options{Timeout: timeout}))
		for r, err := range errs {
			if !errors.Is(err, comm.ErrTimeout) {
				t.Errorf("run %d, rank %d: %v, want a timeout", run, r, err)
			} else if got := comm.LateRanks(err); !slices.Equal(got, []int{late}) {
				t.Errorf("run %d, rank %d blames ranks %v, want [%d]: %v", run, r, got, late, err)
			} else if !strings.Contains(err.Error(), "[fsdp ") {
				t.Errorf("run %d, rank %d: %v, want the call's FSDP label", run, r, err)
			}
		}
	}
}
