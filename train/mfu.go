package train

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
)

// FlopsPerToken is the model FLOPs of one trained token (forward and
// backward) of a decoder-only transformer by PaLM's formula (Chowdhery et
// al. 2022, arXiv:2204.02311, Appendix B):
//
//	6·N + 12·L·H·Q·T = 6·N + 12·L·D·T
//
// where L is layers, D = H·Q the width (heads × head width) and T the
// sequence length: 6 FLOPs per token per weight of the matrix products
// (2 forward, 4 backward) and 12·L·D·T for attention's two T-long
// products per layer, counted over the whole T×T score matrix as PaLM
// does (a causal kernel need only do half). N counts the parameters that
// take part in matrix products: every parameter except the token and
// position embedding tables, which are lookups. PaLM ties its output
// layer to its token embedding, so its N includes that matrix once;
// loom's GPTs have an untied lm_head, which N includes (nanoGPT's
// estimate_mfu counts the same: its tied wte is the lm_head, its wpe is
// left out). For a mixture-of-experts model N is the parameters active
// per token: each token passes K of E experts. Recomputation under
// activation checkpointing is not model FLOPs and is not counted.
// Negative arguments are an error wrapping ErrInvalid.
func FlopsPerToken(n, layers, width, seq int) (float64, error) {
	for _, a := range []struct {
		name string
		v    int
	}{{"N (parameters)", n}, {"layers", layers}, {"width", width}, {"sequence length", seq}} {
		if err := numcheck.NonNegativeCount(ErrInvalid, a.name, a.v); err != nil {
			return 0, fmt.Errorf("train: FlopsPerToken: %w", err)
		}
	}
	return 6*float64(n) + 12*float64(layers)*float64(width)*float64(seq), nil
}

// Precision is the arithmetic a GPU's matrix products run in, which
// chooses its peak (DevicePeak).
type Precision string

const (
	// FP32 is single precision on the CUDA cores (no tensor cores).
	FP32 Precision = "fp32"
	// TF32 is float32 data multiplied on the tensor cores in TF32
	// (PyTorch's allow_tf32), accumulated in float32.
	TF32 Precision = "tf32"
	// BF16 is bfloat16 inputs on the tensor cores, accumulated in float32.
	BF16 Precision = "bf16"
)

// Peak is the peak of one device: a GPU, or the CPUs one host's ranks
// compute on.
type Peak struct {
	// FLOPS is the peak in floating-point operations per second.
	FLOPS float64
	// Source says where the figure comes from: a datasheet, an estimate
	// and its derivation, or -peak.
	Source string
}

// ErrNoPeak is returned by DevicePeak for a device or precision its table
// lacks (the caller can take the peak from the user: -peak); it matches
// loom.ErrInvalid.
var ErrNoPeak = loom.NewSentinel("train: no peak known", loom.ErrInvalid)

// gpuPeaks are the dense (no 2:4 sparsity) peaks in TFLOP/s of the GPUs
// loom is run on, by a part of the name cuDeviceGetName reports (e.g.
// "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"), most specific
// first. Sources:
//   - H100/H200 SXM (and GH200, the same GH100 part and clocks): NVIDIA
//     H100 Tensor Core GPU Architecture whitepaper (2022), the H100 SXM5
//     column: FP32 66.9, TF32 tensor 494.7, BF16 tensor 989.4 (checked
//     against the copy of that table at
//     https://glennklockwood.com/garden/processors/h100; the datasheets'
//     989 and 1,979 TFLOP/s for TF32 and BF16 are with sparsity, twice
//     these); the H200 is the same compute with HBM3e (NVIDIA H200
//     datasheet, https://www.nvidia.com/en-us/data-center/h200/).
//   - H100 PCIe: the same whitepaper: FP32 51.2, TF32 378, BF16 756.
//   - H100 NVL and H200 NVL: their datasheets (nvidia.com/en-us/data-center/h100/,
//     .../h200/): FP32 60, TF32 835 and BF16 1,671 with sparsity, halved here.
//   - A100 (SXM4 and PCIe, 40 and 80 GB alike): NVIDIA A100 datasheet
//     (https://www.nvidia.com/en-us/data-center/a100/): FP32 19.5, TF32
//     156, BF16 312.
//   - L40S, L40, A10, L4: their datasheets (nvidia.com/en-us/data-center/
//     l40s/, .../l40/, .../products/a10-gpu/, .../l4/), the tensor
//     figures with sparsity halved: L40S FP32 91.6, TF32 183, BF16 362;
//     L40 90.5, 90.5, 181; A10 31.2, 62.5, 125; L4 30.3, 60, 121. The
//     rows are matched in order, so L40S comes before L40 and L4, and
//     A100 before A10.
//
// Only the H100 SXM5 row was checked against a copy of its source while
// this table was written; the others are the datasheets' figures as
// published, to be rechecked on the device (nvidia-smi names it).
var gpuPeaks = []struct {
	match            string // upper-case part of the device name
	label            string
	fp32, tf32, bf16 float64
	source           string
}{
	{"H200 NVL", "H200 NVL", 60, 417.5, 835.5, "NVIDIA H200 NVL datasheet (dense: half the sparse figures)"},
	{"H100 NVL", "H100 NVL", 60, 417.5, 835.5, "NVIDIA H100 NVL datasheet (dense: half the sparse figures)"},
	{"H100 PCIE", "H100 PCIe", 51.2, 378, 756, "NVIDIA H100 architecture whitepaper, H100 PCIe"},
	{"GH200", "GH200", 66.9, 494.7, 989.4, "NVIDIA H100 architecture whitepaper, H100 SXM5 (GH200's GPU)"},
	{"H200", "H200 SXM", 66.9, 494.7, 989.4, "NVIDIA H100 architecture whitepaper, H100 SXM5 (the H200 has its compute)"},
	{"H100", "H100 SXM", 66.9, 494.7, 989.4, "NVIDIA H100 architecture whitepaper, H100 SXM5"},
	{"A100", "A100", 19.5, 156, 312, "NVIDIA A100 datasheet"},
	{"L40S", "L40S", 91.6, 183, 362.05, "NVIDIA L40S datasheet (dense: half the sparse figures)"},
	{"L40", "L40", 90.5, 90.5, 181, "NVIDIA L40 datasheet (dense: half the sparse figures)"},
	{"A10", "A10", 31.2, 62.5, 125, "NVIDIA A10 datasheet (dense: half the sparse figures)"},
	{"L4", "L4", 30.3, 60, 121, "NVIDIA L4 datasheet (dense: half the sparse figures)"},
}

// DevicePeak returns the dense peak of the GPU called name (as
// cuDeviceGetName reports it; case is ignored) in precision p, from a
// table of datasheet figures (A100, H100 SXM/PCIe/NVL, H200 SXM/NVL,
// GH200, L40S, L40, A10, L4). A device or precision the table lacks is an error wrapping
// ErrNoPeak that names the known devices and the -peak flag.
func DevicePeak(name string, p Precision) (Peak, error) {
	up := strings.ToUpper(name)
	for _, g := range gpuPeaks {
		if !strings.Contains(up, g.match) {
			continue
		}
		var tf float64
		switch p {
		case FP32:
			tf = g.fp32
		case TF32:
			tf = g.tf32
		case BF16:
			tf = g.bf16
		default:
			return Peak{}, fmt.Errorf("%w: precision %q; want %s, %s or %s", ErrNoPeak, p, FP32, TF32, BF16)
		}
		return Peak{FLOPS: tf * 1e12, Source: fmt.Sprintf("%s dense %s peak %g TFLOP/s (%s)", g.label, p, tf, g.source)}, nil
	}
	known := make([]string, len(gpuPeaks))
	for i, g := range gpuPeaks {
		known[i] = g.label
	}
	return Peak{}, fmt.Errorf("%w: for the device %q (the table has %s); give it with -peak (TFLOP/s)", ErrNoPeak, name, strings.Join(known, ", "))
}

// HostPeak is the estimated single-precision peak of cores CPUs of this
// machine (at most its CPU count, at least 1), from kernels.EstimatePeak:
// the detected vector ISA, FMA units and clock (a nominal upper bound,
// not a measurement; its Source gives the derivation).
func HostPeak(cores int) Peak {
	e := kernels.EstimatePeak()
	e.Cores = max(1, min(e.Cores, cores))
	return Peak{FLOPS: e.FLOPS(), Source: "kernels.EstimatePeak, " + e.String()}
}

// JobPeak is the peak one device of job computes at and the number of
// such devices, for MFU: with -peak (Flags.Peak, TFLOP/s) that figure,
// otherwise on the host the CPUs each host's ranks use (HostPeak of
// LocalRanks × their GEMM threads, Threads), one device per host
// (WorldSize/LocalRanks hosts).
func (l Loop) JobPeak(job *launch.Job) (Peak, int) {
	hosts := max(1, job.WorldSize/max(1, job.LocalRanks))
	if l.Flags.Peak > 0 {
		return Peak{FLOPS: l.Flags.Peak * 1e12, Source: fmt.Sprintf("-peak %g TFLOP/s", l.Flags.Peak)}, hosts
	}
	cpus := runtime.NumCPU()
	return HostPeak(job.LocalRanks * Threads(l.Flags.Threads, job.LocalRanks, cpus)), hosts
}

// MFU is a run's model FLOPs utilization: the model FLOPs it did per
// second (tokens/s × FlopsPerToken) over the peak of the devices it ran
// on. The JSON names are those of the examples' -json.
type MFU struct {
	// MFU is the utilization, a fraction (0.35 is 35%).
	MFU float64 `json:"mfu"`
	// FlopsPerToken is the model FLOPs of one token (FlopsPerToken).
	FlopsPerToken float64 `json:"flops_per_token"`
	// PeakFLOPS is the peak of all the run's devices together, FLOP/s.
	PeakFLOPS float64 `json:"peak_flops"`
	// PeakTFLOPS is one device's peak in TFLOP/s.
	PeakTFLOPS float64 `json:"peak_tflops"`
	// PeakSource says where one device's peak comes from and how many
	// devices there were.
	PeakSource string `json:"peak_source"`
	tokensPerS float64
	unknown    error // RunMFU: no peak for the device (MFU 0)
}

// RunMFU is the MFU of a run of tokensPerS tokens per second at
// flopsPerToken on job's devices as dev describes them (Result.Device),
// over Loop.DevicePeak. A GPU the peak table lacks, without -peak, is not
// an error: the MFU is 0 and its line says why and names -peak. Bad
// numbers are NewMFU's errors.
func (l Loop) RunMFU(job *launch.Job, dev DeviceInfo, tokensPerS, flopsPerToken float64) (MFU, error) {
	peak, devices, err := l.DevicePeak(job, dev)
	if errors.Is(err, ErrNoPeak) {
		return MFU{FlopsPerToken: flopsPerToken, tokensPerS: tokensPerS, unknown: err}, nil
	}
	if err != nil {
		return MFU{}, err
	}
	return NewMFU(tokensPerS, flopsPerToken, peak, devices)
}

// NewMFU computes the MFU of a run of tokensPerS tokens per second over
// devices devices of peak each. tokensPerS and flopsPerToken must be
// finite and not negative, the peak positive and finite and devices at
// least 1; otherwise the error wraps ErrInvalid.
func NewMFU(tokensPerS, flopsPerToken float64, peak Peak, devices int) (MFU, error) {
	for _, err := range []error{
		numcheck.NonNegative(ErrInvalid, "tokens/s", tokensPerS),
		numcheck.NonNegative(ErrInvalid, "FLOPs per token", flopsPerToken),
		numcheck.Positive(ErrInvalid, "peak FLOP/s", peak.FLOPS),
		numcheck.Count(ErrInvalid, "devices", devices),
	} {
		if err != nil {
			return MFU{}, fmt.Errorf("train: MFU: %w", err)
		}
	}
	total := peak.FLOPS * float64(devices)
	return MFU{
		MFU:           tokensPerS * flopsPerToken / total,
		FlopsPerToken: flopsPerToken,
		PeakFLOPS:     total,
		PeakTFLOPS:    peak.FLOPS / 1e12,
		PeakSource:    fmt.Sprintf("%d × %s", devices, peak.Source),
		tokensPerS:    tokensPerS,
	}, nil
}

// String is the line the examples print, e.g. "MFU 41.2% (855.4
// MFLOP/token × 12000 tokens/s = 10.3 TFLOP/s of 25 TFLOP/s peak: 1 × ...)".
func (m MFU) String() string {
	if m.unknown != nil {
		return fmt.Sprintf("MFU unknown (%s/token × %.0f tokens/s = %s/s): %v", flops(m.FlopsPerToken), m.tokensPerS, flops(m.tokensPerS*m.FlopsPerToken), m.unknown)
	}
	return fmt.Sprintf("MFU %.2f%% (%s/token × %.0f tokens/s = %s/s of %s/s peak: %s)",
		100*m.MFU, flops(m.FlopsPerToken), m.tokensPerS, flops(m.tokensPerS*m.FlopsPerToken), flops(m.PeakFLOPS), m.PeakSource)
}

// flops formats a FLOP count with an SI prefix: "855.4 MFLOP".
func flops(v float64) string {
	for _, u := range []struct {
		scale float64
		unit  string
	}{{1e15, "PFLOP"}, {1e12, "TFLOP"}, {1e9, "GFLOP"}, {1e6, "MFLOP"}, {1e3, "kFLOP"}} {
		if math.Abs(v) >= u.scale {
			return fmt.Sprintf("%.4g %s", v/u.scale, u.unit)
		}
	}
	return fmt.Sprintf("%.4g FLOP", v)
}
