package train

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/launch"
)

// TestFlopsPerToken: PaLM's 6·N + 12·L·D·T on the tiny GPT and GPT-2
// small, N counted by hand without the embedding tables.
func TestFlopsPerToken(t *testing.T) {
	// A block of width D and MLP width F: ln1 and ln2 (4D), qkv (3D²+3D),
	// proj (D²+D), fc (DF+F), mlp proj (FD+D) = 4D² + 2DF + 9D + F.
	block := func(d, f int) int { return 4*d*d + 2*d*f + 9*d + f }
	for _, tc := range []struct {
		name                string
		n, layers, width, t int
		want                float64
	}{
		// Tiny: L=2, D=128, F=512, V=256, T=64: N = 2·198272 + ln_f 256 +
		// lm_head 32768 = 429568 (470528 with wte and wpe).
		{"tiny", 2*block(128, 512) + 2*128 + 256*128, 2, 128, 64, 6*429568 + 12*2*128*64},
		// GPT-2 small: L=12, D=768, F=3072, V=50304, T=1024: N =
		// 12·7087872 + 1536 + 38633472 = 123689472.
		{"gpt2-small", 12*block(768, 3072) + 2*768 + 50304*768, 12, 768, 1024, 855383040},
		{"no blocks", 10, 0, 8, 4, 60},
	} {
		got, err := FlopsPerToken(tc.n, tc.layers, tc.width, tc.t)
		if err != nil || got != tc.want {
			t.Errorf("%s: FlopsPerToken(%d, %d, %d, %d) = %v, %v; want %v", tc.name, tc.n, tc.layers, tc.width, tc.t, got, err, tc.want)
		}
	}
	if block(128, 512) != 198272 || 12*block(768, 3072)+2*768+50304*768 != 123689472 {
		t.Errorf("the hand counts are wrong")
	}
	for _, bad := range [][4]int{{-1, 1, 1, 1}, {1, -1, 1, 1}, {1, 1, -1, 1}, {1, 1, 1, -1}} {
		if _, err := FlopsPerToken(bad[0], bad[1], bad[2], bad[3]); !errors.Is(err, ErrInvalid) || !errors.Is(err, loom.ErrInvalid) {
			t.Errorf("FlopsPerToken%v: %v, want ErrInvalid", bad, err)
		}
	}
}

// TestDevicePeak: the table by device name (as the driver reports it)
// and precision, and the error for a device or precision it lacks.
func TestDevicePeak(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Precision
		want float64 // TFLOP/s
	}{
		{"NVIDIA H100 80GB HBM3", FP32, 66.9},
		{"NVIDIA H100 80GB HBM3", TF32, 494.7},
		{"NVIDIA H100 80GB HBM3", BF16, 989.4},
		{"NVIDIA H200", BF16, 989.4},
		{"NVIDIA H200", TF32, 494.7},
		{"nvidia h200", FP32, 66.9},
		{"NVIDIA GH200 480GB", BF16, 989.4},
		{"NVIDIA H100 PCIe", TF32, 378},
		{"NVIDIA H100 NVL", BF16, 835.5},
		{"NVIDIA H200 NVL", TF32, 417.5},
		{"NVIDIA A100-SXM4-80GB", FP32, 19.5},
		{"NVIDIA A100-PCIE-40GB", TF32, 156},
		{"NVIDIA A100 80GB PCIe", BF16, 312},
		{"NVIDIA L40S", BF16, 362.05},
		{"NVIDIA L40", TF32, 90.5},
		{"NVIDIA L4", FP32, 30.3},
		{"NVIDIA A10", BF16, 125},
	} {
		got, err := DevicePeak(tc.name, tc.p)
		if err != nil || got.FLOPS != tc.want*1e12 || !strings.Contains(got.Source, string(tc.p)) {
			t.Errorf("DevicePeak(%q, %s) = %+v, %v; want %g TFLOP/s", tc.name, tc.p, got, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		p    Precision
		want string
	}{
		{"Tesla T4", BF16, `"Tesla T4" (the table has H200 NVL, H100 NVL, H100 PCIe, GH200, H200 SXM, H100 SXM, A100, L40S, L40, A10, L4); give it with -peak`},
		{"NVIDIA H100 80GB HBM3", "fp8", `precision "fp8"; want fp32, tf32 or bf16`},
	} {
		_, err := DevicePeak(tc.name, tc.p)
		if !errors.Is(err, ErrNoPeak) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("DevicePeak(%q, %s): %v; want ErrNoPeak with %q", tc.name, tc.p, err, tc.want)
		}
	}
}

// TestJobPeak: -peak overrides the estimate, one device per host; without
// it the host's CPUs its ranks use, from kernels.EstimatePeak.
func TestJobPeak(t *testing.T) {
	core := kernels.EstimatePeak().PerCoreFLOPS()
	for _, tc := range []struct {
		name      string
		peak      float64 // -peak
		threads   int     // -threads
		job       launch.Job
		wantFLOPS float64
		devices   int
		source    string
	}{
		{"-peak, in-process", 2, 0, launch.Job{WorldSize: 4, LocalRanks: 4}, 2e12, 1, "-peak 2 TFLOP/s"},
		{"-peak, two hosts", 0.5, 0, launch.Job{WorldSize: 8, LocalRanks: 4}, 0.5e12, 2, "-peak 0.5 TFLOP/s"},
		{"estimate, one thread", 0, 1, launch.Job{WorldSize: 1, LocalRanks: 1}, core, 1, "kernels.EstimatePeak"},
		{"estimate, every CPU", 0, 0, launch.Job{WorldSize: 1, LocalRanks: 1}, kernels.EstimatePeak().FLOPS(), 1, "kernels.EstimatePeak"},
	} {
		l := Loop{Flags: Flags{Peak: tc.peak, Threads: tc.threads}}
		p, n := l.JobPeak(&tc.job)
		if math.Abs(p.FLOPS-tc.wantFLOPS) > 1e-9*tc.wantFLOPS || n != tc.devices || !strings.Contains(p.Source, tc.source) {
			t.Errorf("%s: JobPeak = %+v, %d; want %g FLOP/s, %d device(s), source %q", tc.name, p, n, tc.wantFLOPS, tc.devices, tc.source)
		}
	}
}

// TestMFU: tokens/s × FLOPs/token over the devices' peak, and the errors
// for values that make no utilization.
func TestMFU(t *testing.T) {
	peak := Peak{FLOPS: 1e10, Source: "test"}
	m, err := NewMFU(1000, 1e6, peak, 2)
	if err != nil || m.MFU != 0.05 || m.FlopsPerToken != 1e6 || m.PeakFLOPS != 2e10 || m.PeakSource != "2 × test" {
		t.Errorf("NewMFU = %+v, %v", m, err)
	}
	// 1000 tokens/s × 1e6 FLOP/token = 1 GFLOP/s, of 2 × 10 GFLOP/s.
	if s, want := m.String(), "MFU 5.00% (1 MFLOP/token × 1000 tokens/s = 1 GFLOP/s of 20 GFLOP/s peak: 2 × test)"; s != want {
		t.Errorf("String() = %q, want %q", s, want)
	}
	for _, tc := range []struct {
		tokens, fpt float64
		peak        float64
		devices     int
		want        string
	}{
		{math.NaN(), 1, 1, 1, "tokens/s NaN"},
		{-1, 1, 1, 1, "tokens/s -1"},
		{1, math.Inf(1), 1, 1, "FLOPs per token +Inf"},
		{1, 1, 0, 1, "peak FLOP/s 0"},
		{1, 1, 1, 0, "devices 0"},
	} {
		_, err := NewMFU(tc.tokens, tc.fpt, Peak{FLOPS: tc.peak}, tc.devices)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewMFU(%v, %v, %v, %d): %v; want ErrInvalid naming %q", tc.tokens, tc.fpt, tc.peak, tc.devices, err, tc.want)
		}
	}
}

// TestLoopDevicePeak: on cuda the GPU's table peak in the run's precision
// (-mp bf16, -tf32), one device per rank, -peak overriding it, and an
// unknown GPU's MFU line naming -peak instead of an error; on emu the
// CPUs' estimate, said to be the emulated devices'.
func TestLoopDevicePeak(t *testing.T) {
	job := &launch.Job{WorldSize: 4, LocalRanks: 1, Processes: 4}
	h200 := DeviceInfo{Kind: DeviceCUDA, Name: "cuda:0", Model: "NVIDIA H200"}
	for _, tc := range []struct {
		name    string
		flags   Flags
		dev     DeviceInfo
		tflops  float64
		devices int
		source  string
	}{
		{"f32", Flags{Device: DeviceCUDA}, h200, 66.9, 4, "H200 SXM dense fp32"},
		{"tf32", Flags{Device: DeviceCUDA, TF32: true}, h200, 494.7, 4, "H200 SXM dense tf32"},
		{"bf16", Flags{Device: DeviceCUDA, MP: "bf16", TF32: true}, h200, 989.4, 4, "H200 SXM dense bf16"},
		{"-peak", Flags{Device: DeviceCUDA, Peak: 100}, h200, 100, 4, "-peak 100"},
		{"emu", Flags{Device: DeviceEmu, Peak: 0}, DeviceInfo{Kind: DeviceEmu, Name: "emu:0"}, 0, 4, "emulated devices: the CPUs' kernels.EstimatePeak"},
	} {
		l := Loop{Flags: tc.flags}
		p, n, err := l.DevicePeak(job, tc.dev)
		if err != nil || n != tc.devices || !strings.Contains(p.Source, tc.source) || (tc.tflops > 0 && p.FLOPS != tc.tflops*1e12) {
			t.Errorf("%s: DevicePeak = %+v, %d, %v; want %g TFLOP/s × %d from %q", tc.name, p, n, err, tc.tflops, tc.devices, tc.source)
		}
		m, err := l.RunMFU(job, tc.dev, 1000, 1e9)
		if err != nil || m.PeakTFLOPS != p.FLOPS/1e12 || m.MFU != 1e12/(p.FLOPS*float64(n)) {
			t.Errorf("%s: RunMFU = %+v, %v", tc.name, m, err)
		}
	}
	l := Loop{Flags: Flags{Device: DeviceCUDA}}
	m, err := l.RunMFU(job, DeviceInfo{Kind: DeviceCUDA, Name: "cuda:0", Model: "Tesla T4"}, 1000, 1e9)
	if err != nil || m.MFU != 0 || !strings.Contains(m.String(), "MFU unknown") || !strings.Contains(m.String(), "-peak") {
		t.Errorf("unknown GPU: %v, %v; want an MFU line naming -peak", m, err)
	}
}
