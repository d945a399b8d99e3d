package launch

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm/nccl"
	"github.com/b7ea7098/loom/comm/nccl/topology"
	"github.com/b7ea7098/loom/comm/rendezvous"
)

// WorldKey is the rendezvous key under which the NCCL backend's world
// communicator is bootstrapped (rank 0 publishes the unique id at
// WorldKey+"/id"); the job's rendezvous server must be fresh, as
// cmd/loomrun's and torchrun's are.
const WorldKey = "loom/launch/world"

// checkNCCL loads NCCL and the CUDA driver, for Job.Check.
func checkNCCL(j *Job) error {
	if _, err := nccl.Load(); err != nil {
		return fmt.Errorf("launch: nccl (RANK=%d LOCAL_RANK=%d): %w", j.Rank, j.LocalRank, err)
	}
	return nil
}

// runNCCL runs fn on this process's rank of an NCCL world on the GPU that
// gpuOf picks, bootstrapped through the rendezvous server at j.Addr. The
// GPU is opened once, as a device/cuda context of the driver binding NCCL
// uses (lib.Driver()), and handed to the communicator; fn reaches it as
// the communicator's Device (interface{ Device() *cuda.Context }), since
// the topology may have put the rank on another GPU than LOCAL_RANK and
// compute must use the one NCCL does.
func runNCCL(ctx context.Context, j *Job, fn Func, cfg runConfig) (err error) {
	where := fmt.Sprintf("launch: nccl (RANK=%d LOCAL_RANK=%d)", j.Rank, j.LocalRank)
	lib, err := nccl.Load()
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	gpu, layout, err := gpuOf(j, cfg.shape, topology.Detect(j.LocalRanks))
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	if cfg.log != nil && j.Root() {
		fmt.Fprintln(cfg.log, layout)
	}
	dev, err := lib.Driver().Open(gpu)
	if err != nil {
		return fmt.Errorf("%s: GPU %d: %w", where, gpu, err)
	}
	defer func() { err = errors.Join(err, dev.Close()) }()
	store, err := rendezvous.Dial(ctx, j.Addr)
	if err != nil {
		return fmt.Errorf("%s: rendezvous server %s (MASTER_ADDR, MASTER_PORT): %w", where, j.Addr, err)
	}
	defer func() { err = errors.Join(err, store.Close()) }()
	c, err := lib.NewComm(ctx, dev, store, WorldKey, j.Rank, j.WorldSize)
	if err != nil {
		return fmt.Errorf("%s: %w", where, err)
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	return runOne(ctx, j, c, fn)
}

// gpuOf returns the GPU of this process and a line describing the layout.
// The mesh's ranks are row-major over the world and each host holds
// LocalRanks consecutive ones, so the host's ranks form the innermost
// axes that fit in it (with part of the next axis): Order lays that local
// shape on the host's GPUs, the innermost axis on the fastest links, and
// local position LocalRank gets order[LocalRank]. Without a shape, or when
// the host does not hold whole innermost axes, it is GPU LocalRank.
func gpuOf(j *Job, shape []int, t *topology.Topology) (int, string, error) {
	local := localShape(shape, j.LocalRanks)
	if local == nil || len(t.Devices) != j.LocalRanks {
		return j.LocalRank, fmt.Sprintf("NCCL: %d rank(s) per host, rank LOCAL_RANK on GPU LOCAL_RANK (mesh %v; %d GPUs known, topology from %s)", j.LocalRanks, shape, len(t.Devices), t.Source), nil
	}
	order, err := t.Order(local)
	if err != nil {
		return 0, "", fmt.Errorf("laying mesh %v (%v on this host) on the GPUs: %w", shape, local, err)
	}
	return order[j.LocalRank], fmt.Sprintf("NCCL: mesh %v, %v on each host; local mesh position i on GPU %v[i] (topology from %s)", shape, local, order, t.Source), nil
}

// localShape is the part of the mesh shape that one host's n consecutive
// ranks cover: the innermost axes whose product divides n, and the factor
// left for the next axis out; nil when n does not split that way.
func localShape(shape []int, n int) []int {
	if len(shape) == 0 || n < 1 {
		return nil
	}
	var inner []int
	prod := 1
	for k := len(shape) - 1; k >= 0 && prod < n; k-- {
		switch s := shape[k]; {
		case s < 1:
			return nil
		case n%(prod*s) == 0:
			inner = append([]int{s}, inner...)
			prod *= s
		case s%(n/prod) == 0:
			inner = append([]int{n / prod}, inner...)
			prod = n
		default:
			return nil
		}
	}
	if prod != n {
		return nil
	}
	return inner
}
