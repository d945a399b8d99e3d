//go:build linux && (amd64 || arm64)

package cuda_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/cuda"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestFakeDeviceTinyGPT trains a small GPT of the tiny GPT's form (its
// trainer, corpus, AdamW and every op of its step: embedding, LayerNorm,
// Linear with bias, fused causal attention, bias+GELU, cross-entropy,
// gradient clipping) for a few steps on one rank whose device is a whole
// cuda.Device on the fake libraries (driver, NVRTC running the real kernel
// sources, cuBLAS), in float32 and with autocast (float32 only under
// -short), and compares every step's loss with the host's (and the
// emulated device's with the host's, bit for bit).
//
// Tolerance: 1e-5 relative. The fake cuBLAS sums each product in double
// and rounds once where the host's BLAS sums in float32 (a relative
// difference of at most K·2⁻²⁴ per GEMM, K ≤ 64 here: 4e-6), and the
// device's kernels differ from the CPU's by at most a few float32 ulps
// (TestFakeDevice's tolerances); through two steps of AdamW that moves the
// loss (about 4.8) by well under 1e-5 of it. Measured: equal bit for bit
// in both modes (the rounding of the float32 loss hides the GEMMs'
// differences). Time: about 6 s a step on the fake (the emulated kernels
// run their warps as threads), 12 s per mode, plus the fake's build.
func TestFakeDeviceTinyGPT(t *testing.T) {
	open := cuda.OpenFakeDevice(t)
	run := tinygpt.Default()
	run.D, run.H, run.L, run.F, run.T, run.B = 32, 2, 2, 64, 16, 4
	run.V = tinygpt.MinVocab
	cfg := gpt.FromReference(run)
	bl, err := kernels.Load(kernels.WithLibrary("go"), kernels.WithThreads(1))
	if err != nil {
		t.Fatal(err)
	}
	const steps = 2
	train := func(d device.Device, tape ...autograd.Option) []float64 {
		var losses []float64
		err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			opts := []gpt.TrainOption{gpt.WithRun(run), gpt.WithModel(gpt.WithSeed(7)), gpt.WithTape(autograd.WithBLAS(bl)), gpt.WithTape(tape...)}
			if d != nil {
				opts = append(opts, gpt.WithDevice(d))
			}
			tr, err := gpt.NewTrainer(ctx, m, cfg, opts...)
			if err != nil {
				return err
			}
			for i := range steps {
				_, loss, err := tr.Step(ctx)
				if err != nil {
					return fmt.Errorf("step %d: %w", i+1, err)
				}
				losses = append(losses, loss)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return losses
	}
	modes := []struct {
		name string
		tape []autograd.Option
	}{{"f32", nil}, {"autocast", []autograd.Option{autograd.WithAutocast()}}}
	if testing.Short() {
		modes = modes[:1]
	}
	for _, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			host := train(nil, mode.tape...)
			e, err := emu.New(0, emu.WithBLAS(bl))
			if err != nil {
				t.Fatal(err)
			}
			onEmu := train(e, mode.tape...)
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			l, d := open(t)
			start := time.Now()
			onCUDA := train(d, mode.tape...)
			t.Logf("%d steps on the fake device in %v; GEMM: %s", steps, time.Since(start).Round(time.Millisecond), d.GEMMPath())
			for i := range host {
				t.Logf("step %d: host %.7f emu %.7f cuda %.7f (Δ %v)", i+1, host[i], onEmu[i], onCUDA[i], onCUDA[i]-host[i])
				if math.Float64bits(onEmu[i]) != math.Float64bits(host[i]) {
					t.Errorf("step %d: emu %v, host %v", i+1, onEmu[i], host[i])
				}
				if d := math.Abs(onCUDA[i] - host[i]); !(d <= 1e-5*math.Abs(host[i])) {
					t.Errorf("step %d: the fake CUDA device's loss %v is %.3g from the host's %v; want at most 1e-5 relative", i+1, onCUDA[i], d, host[i])
				}
			}
			if err := d.Close(); err != nil {
				t.Error(err)
			}
			if err := l.Close(); err != nil {
				t.Error(err)
			}
		})
	}
}
