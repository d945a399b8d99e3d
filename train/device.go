package train

import (
	"fmt"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
)

// The devices -device names (Flags.Device).
const (
	// DeviceCPU computes on the host, in Go memory: the default.
	DeviceCPU = "cpu"
	// DeviceEmu gives every rank an emulated device (device/emu, named
	// emu:<world rank>): host memory behind the device interfaces, with
	// asynchronous streams and a caching allocator, running the host's
	// CPU kernels. It takes the device code path without a GPU and gives
	// the host's results bit for bit.
	DeviceEmu = "emu"
	// DeviceCUDA computes on the GPU of each rank (under loomrun or
	// torchrun). The rank's device must be the device/cuda device whose
	// context and driver binding the rank's NCCL communicator uses, which
	// package launch does not hand to the rank yet (it opens a bare
	// context for NCCL, without NVRTC): asking for it is an error saying
	// so.
	DeviceCUDA = "cuda"
)

// ErrUnsupported is wrapped by the errors of flags that ask for what this
// build cannot do (-device cuda, -device emu on tcp or nccl); it matches
// loom.ErrUnsupported.
var ErrUnsupported = loom.NewSentinel("train: unsupported", loom.ErrUnsupported)

// DeviceKind returns -device, "cpu" when it was not set.
func (f Flags) DeviceKind() string {
	if f.Device == "" {
		return DeviceCPU
	}
	return f.Device
}

// checkDevice checks -device: cpu or emu, and cuda is an error naming what
// it needs.
func (f Flags) checkDevice() error {
	switch f.DeviceKind() {
	case DeviceCPU, DeviceEmu:
		return nil
	case DeviceCUDA:
		return fmt.Errorf("%w: -device cuda needs package launch to hand each rank the device/cuda device of the GPU it opens for NCCL "+
			"(one context and driver binding, NVRTC loaded), which this build does not do yet; "+
			"-device cpu computes on the host, -device emu takes the device code path on the CPU", ErrUnsupported)
	}
	return fmt.Errorf("%w: -device %q; want cpu, emu or cuda", ErrInvalid, f.Device)
}

// checkJob checks that job's collectives take the buffers of -device's
// devices: the emulated device's are host memory that comm/local and
// comm/mpi read in place, which comm/tcp and NCCL refuse.
func (f Flags) checkJob(job *launch.Job) error {
	if f.DeviceKind() == DeviceEmu && job.Backend != launch.Local && job.Backend != launch.MPI {
		return fmt.Errorf("%w: -device emu runs on the %s and %s backends (their collectives read the emulated device's host-backed buffers); this is a %s job",
			ErrUnsupported, launch.Local, launch.MPI, job.Backend)
	}
	return nil
}

// OpenDevice returns the device -device gives the rank of world rank
// rank: device.Host() for cpu, or emu.New(rank) running its kernels on
// blas for emu, which the caller closes after the rank's work. A -device
// that checkDevice refuses is its error.
func (f Flags) OpenDevice(rank int, blas *kernels.BLAS) (device.Device, error) {
	if err := f.checkDevice(); err != nil {
		return nil, err
	}
	if f.DeviceKind() == DeviceEmu {
		var opts []emu.Option
		if blas != nil {
			opts = append(opts, emu.WithBLAS(blas))
		}
		d, err := emu.New(rank, opts...)
		if err != nil {
			return nil, fmt.Errorf("train: -device emu: %w", err)
		}
		return d, nil
	}
	return device.Host(), nil
}

// DeviceLine is the line the examples print about -device for a job of
// ranks ranks: "device: cpu (the host)" or "device: emu (emu:0 … emu:3,
// one emulated device per rank running the host's CPU kernels)".
func (f Flags) DeviceLine(ranks int) string {
	switch f.DeviceKind() {
	case DeviceEmu:
		names := "emu:0"
		if ranks > 1 {
			names = fmt.Sprintf("emu:0 … emu:%d", ranks-1)
		}
		return fmt.Sprintf("device: emu (%s, one emulated device per rank running the host's CPU kernels)", names)
	case DeviceCPU:
		return "device: cpu (the host)"
	}
	return "device: " + f.DeviceKind()
}
