package train

import (
	"context"
	"fmt"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
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
	// DeviceCUDA computes on the GPU of each rank, on the NCCL backend
	// (under loomrun or torchrun): package launch opens the rank's GPU as
	// a device/cuda device (named cuda:<GPU>) whose context the rank's
	// NCCL communicator shares (launch.WithDevice, launch.DeviceOf).
	DeviceCUDA = "cuda"
)

// ErrUnsupported is wrapped by the errors of flags that ask for what this
// build cannot do (-device cuda off NCCL, -device emu on tcp or nccl); it matches
// loom.ErrUnsupported.
var ErrUnsupported = loom.NewSentinel("train: unsupported", loom.ErrUnsupported)

// DeviceKind returns -device, "cpu" when it was not set.
func (f Flags) DeviceKind() string {
	if f.Device == "" {
		return DeviceCPU
	}
	return f.Device
}

// checkDevice checks that -device is cpu, emu or cuda.
func (f Flags) checkDevice() error {
	switch f.DeviceKind() {
	case DeviceCPU, DeviceEmu, DeviceCUDA:
		return nil
	}
	return fmt.Errorf("%w: -device %q; want cpu, emu or cuda", ErrInvalid, f.Device)
}

// checkJob checks that job's collectives take the buffers of -device's
// devices: the emulated device's are host memory that comm/local and
// comm/mpi read in place, which comm/tcp and NCCL refuse; a GPU's are
// device memory, which only NCCL takes (and only its jobs have a GPU per
// rank).
func (f Flags) checkJob(job *launch.Job) error {
	if f.DeviceKind() == DeviceCUDA && job.Backend != launch.NCCL {
		return fmt.Errorf("%w: -device cuda runs on the %s backend (one GPU per process, under loomrun or torchrun, its communicator on the rank's device); this is a %s job; "+
			"-device cpu computes on the host, -device emu takes the device code path on the CPU", ErrUnsupported, launch.NCCL, job.Backend)
	}
	if f.DeviceKind() == DeviceEmu && job.Backend != launch.Local && job.Backend != launch.MPI {
		return fmt.Errorf("%w: -device emu runs on the %s and %s backends (their collectives read the emulated device's host-backed buffers); this is a %s job",
			ErrUnsupported, launch.Local, launch.MPI, job.Backend)
	}
	return nil
}

// OpenDevice returns the device -device gives the rank of world rank
// rank, whose launch.Func got ctx: device.Host() for cpu, emu.New(rank)
// running its kernels on blas for emu, which the caller closes after the
// rank's work, or for cuda the device launch opened for the rank
// (launch.DeviceOf), which launch closes. A -device that checkDevice
// refuses is its error, and cuda on a rank that launch gave no device
// (a job run without launch.WithDevice, or not on NCCL) wraps
// ErrUnsupported.
func (f Flags) OpenDevice(ctx context.Context, rank int, blas *kernels.BLAS) (device.Device, error) {
	if err := f.checkDevice(); err != nil {
		return nil, err
	}
	if f.DeviceKind() == DeviceCUDA {
		d := launch.DeviceOf(ctx)
		if d == nil {
			return nil, fmt.Errorf("%w: -device cuda: rank %d has no GPU from package launch (it opens one per rank on the %s backend, with launch.WithDevice)", ErrUnsupported, rank, launch.NCCL)
		}
		return d, nil
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
	case DeviceCUDA:
		return "device: cuda (one GPU per rank, shared with its NCCL communicator)"
	}
	return "device: " + f.DeviceKind()
}

// Precision is the arithmetic of the run's matrix products, which chooses
// the GPU's peak for MFU: BF16 with -mp bf16, TF32 with -tf32 on -device
// cuda, FP32 otherwise.
func (f Flags) Precision() Precision {
	switch {
	case f.MP == "bf16":
		return BF16
	case f.TF32 && f.DeviceKind() == DeviceCUDA:
		return TF32
	}
	return FP32
}

// DeviceInfo describes the device world rank 0 computed on (Run's
// Result.Device), for the examples' GEMM and MFU lines and -json.
type DeviceInfo struct {
	// Kind is -device: cpu, emu or cuda.
	Kind string
	// Name is the device's name: "host", "emu:0", "cuda:0".
	Name string
	// Model is the GPU's name as the driver reports it ("NVIDIA H200"),
	// which DevicePeak looks up; empty off cuda.
	Model string
	// GEMM says what computed the matrix products: cuBLAS's version and
	// path on cuda, the host BLAS on cpu and emu (emulated), and the
	// precision (f32, tf32 or bf16).
	GEMM string
}

// Describe names the device with its model where there is one:
// "cuda:0 (NVIDIA H200)", "emu:0", "host".
func (d DeviceInfo) Describe() string {
	if d.Model != "" {
		return fmt.Sprintf("%s (%s)", d.Name, d.Model)
	}
	return d.Name
}

// deviceInfo describes dev, whose GEMMs ran on blas off cuda, after a
// run with flags f.
func (f Flags) deviceInfo(dev device.Device, blas *kernels.BLAS) DeviceInfo {
	info := DeviceInfo{Kind: f.DeviceKind(), Name: dev.Name()}
	prec := string(f.Precision()) // the GEMM line's f32, tf32 or bf16
	if f.Precision() == FP32 {
		prec = "f32"
	}
	switch d := dev.(type) {
	case *cuda.Device:
		info.Model = d.Context().Name()
		info.GEMM = fmt.Sprintf("%s (%s)", d.GEMMPath(), prec)
	default:
		host := "the host BLAS"
		if blas != nil {
			host = blas.Config()
		}
		if dev.Kind() == device.KindEmulated {
			info.GEMM = fmt.Sprintf("emulated on %s (%s; %s's GEMMs run on the CPUs)", host, prec, dev.Name())
		} else {
			info.GEMM = fmt.Sprintf("%s (%s)", host, prec)
		}
	}
	return info
}

// DevicePeak is the peak one device of job computes at and the number of
// such devices, for the MFU of a run on dev (Result.Device): with -peak
// that figure; on cuda the GPU's dense peak in the run's Precision from
// DevicePeak's table (an unknown GPU is DevicePeak's error, wrapping
// ErrNoPeak and naming -peak), one device per rank; on cpu and emu the
// CPUs' estimate of JobPeak (the emulated device computes on them), its
// source saying so for emu.
func (l Loop) DevicePeak(job *launch.Job, dev DeviceInfo) (Peak, int, error) {
	if dev.Kind == DeviceCUDA {
		devices := max(1, job.WorldSize)
		if l.Flags.Peak > 0 {
			return Peak{FLOPS: l.Flags.Peak * 1e12, Source: fmt.Sprintf("-peak %g TFLOP/s", l.Flags.Peak)}, devices, nil
		}
		p, err := DevicePeak(dev.Model, l.Flags.Precision())
		return p, devices, err
	}
	p, n := l.JobPeak(job)
	if dev.Kind == DeviceEmu && l.Flags.Peak <= 0 {
		p.Source = "emulated devices: the CPUs' " + p.Source
	}
	return p, n, nil
}
