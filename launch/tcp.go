package launch

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/comm/tcp"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/internal/dynlib"
)

// runTCP runs fn on this process's rank of a TCP world (comm/tcp), the
// ranks finding each other through the rendezvous server at j.Addr. The
// setup (dialling the server, publishing this rank's address, connecting
// to every peer) is bounded by the communicator's timeout (LOOM_TIMEOUT),
// so that a rank that never comes is an error naming it, not a hang.
func runTCP(ctx context.Context, j *Job, fn Func) (err error) {
	where := fmt.Sprintf("launch: tcp (RANK=%d)", j.Rank)
	opts, err := comm.OptionsFromEnv()
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	opts = opts.WithDefaults()
	setup, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	store, err := rendezvous.Dial(setup, j.Addr)
	if err != nil {
		return fmt.Errorf("%s: rendezvous server %s (MASTER_ADDR, MASTER_PORT): %w", where, j.Addr, err)
	}
	// The store serves the setup only: the ranks then talk directly.
	c, err := tcp.New(setup, store, j.Rank, j.WorldSize, tcp.WithOptions(opts), tcp.WithJobID(WorldKey))
	if cerr := store.Close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("%s: joining the %d ranks (setup bounded by %v, %s): %w", where, j.WorldSize, opts.Timeout, comm.TimeoutEnv, err)
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	return runOne(ctx, j, c, fn)
}

// cudaProbe binds the two driver entry points that say whether a GPU is
// there.
type cudaProbe struct {
	init     func(flags uint32) int32
	devCount func(n *int32) int32
}

func (p *cudaProbe) symbols() []dynlib.Symbol {
	return []dynlib.Symbol{{Name: "cuInit", Fn: &p.init}, {Name: "cuDeviceGetCount", Fn: &p.devCount}}
}

// hasGPU reports whether this host's CUDA driver (the library that
// cuda.DriverEnv, read through getenv, forces, else cuda.DriverCandidates)
// loads, initialises and finds at least one device: the automatic choice
// between NCCL and TCP. It prints nothing and costs a failed dlopen on a
// host without the driver. A driver that loaded stays mapped, as NCCL
// loads the same library next and the driver's threads outlive its calls.
func hasGPU(getenv func(string) string) bool {
	spec := dynlib.Spec(strings.TrimSpace(getenv(cuda.DriverEnv)))
	p, _, _, err := dynlib.First(spec.Search("driver", cuda.DriverCandidates()...), dynlib.BindNew((*cudaProbe).symbols))
	if err != nil {
		return false
	}
	var n int32
	return p.init(0) == 0 && p.devCount(&n) == 0 && n > 0
}
