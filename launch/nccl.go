package launch

import (
	"context"
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm/nccl"
	"github.com/b7ea7098/loom/comm/nccl/topology"
	"github.com/b7ea7098/loom/comm/rendezvous"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
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

// WithDevice makes Job.Run on NCCL open each rank's GPU as a device/cuda
// Device (named "cuda:N", with NVRTC searched for and loaded when found)
// whose context the rank's communicator is made on, so that compute and
// NCCL share one context and one driver binding; the rank reaches it with
// DeviceOf(ctx). Job.Run closes it after fn returns. The other backends
// ignore it (they have no GPU). opts are cuda.OpenDevice's (e.g.
// cuda.WithBLASOptions(cuda.WithTF32(true)) for -tf32).
func WithDevice(opts ...cuda.DeviceOption) Option {
	return func(c *runConfig) { c.device, c.deviceOpts = true, opts }
}

// deviceKey is the context key of the rank's device (DeviceOf).
type deviceKey struct{}

// DeviceOf returns the device Job.Run opened for the rank whose fn got ctx
// (WithDevice on NCCL), or nil when it opened none. The device belongs to
// Job.Run, which closes it after fn returns: fn must not close it.
func DeviceOf(ctx context.Context) device.Device {
	d, _ := ctx.Value(deviceKey{}).(device.Device)
	return d
}

// runNCCL runs fn on this process's rank of an NCCL world on the GPU that
// gpuOf picks, bootstrapped through the rendezvous server at j.Addr. The
// GPU is opened once and handed to the communicator: as a bare
// device/cuda context of NCCL's own driver binding (lib.Driver()), or with
// cfg.device as a cuda.Device of a binding loaded here with NVRTC, which
// NCCL is then loaded on (nccl.WithDriverLib) and fn reaches through
// DeviceOf. Either way fn reaches the context as the communicator's Device
// (interface{ Device() *cuda.Context }), since the topology may have put
// the rank on another GPU than LOCAL_RANK and compute must use the one
// NCCL does.
func runNCCL(ctx context.Context, j *Job, fn Func, cfg runConfig) (err error) {
	where := fmt.Sprintf("launch: nccl (RANK=%d LOCAL_RANK=%d)", j.Rank, j.LocalRank)
	var (
		cu   *cuda.Lib
		opts []nccl.LoadOption
	)
	if cfg.device {
		// NVRTC searched for (not forced): a missing one fails the first
		// kernel compile, naming it, not the job's start.
		if cu, err = cuda.Load(); err != nil {
			return fmt.Errorf("%s: CUDA for the rank's device: %w", where, err)
		}
		defer func() { err = errors.Join(err, cu.Close()) }()
		opts = append(opts, nccl.WithDriverLib(cu))
	}
	lib, err := nccl.Load(opts...)
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
	var cctx *cuda.Context
	if cfg.device {
		d, err := cuda.OpenDevice(cu, gpu, cfg.deviceOpts...)
		if err != nil {
			return fmt.Errorf("%s: GPU %d: %w", where, gpu, err)
		}
		defer func() { err = errors.Join(err, d.Close()) }()
		cctx = d.Context()
		ctx = context.WithValue(ctx, deviceKey{}, device.Device(d))
	} else {
		c, err := lib.Driver().Open(gpu)
		if err != nil {
			return fmt.Errorf("%s: GPU %d: %w", where, gpu, err)
		}
		defer func() { err = errors.Join(err, c.Close()) }()
		cctx = c
	}
	store, err := rendezvous.Dial(ctx, j.Addr)
	if err != nil {
		return fmt.Errorf("%s: rendezvous server %s (MASTER_ADDR, MASTER_PORT): %w", where, j.Addr, err)
	}
	defer func() { err = errors.Join(err, store.Close()) }()
	c, err := lib.NewComm(ctx, cctx, store, WorldKey, j.Rank, j.WorldSize)
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
