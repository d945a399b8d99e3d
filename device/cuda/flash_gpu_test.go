//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// TestGPUFlashAttention runs the fused attention of device 0 on random
// shapes (float32 and bfloat16, T up to 300, head widths up to 128)
// against package kernels' CPU attention with TestFakeFlashAttention's
// tolerances and allocation bound; with LOOM_CUDA_BENCH=1 it also times
// the fused forward and backward against the reference path (cuBLAS and
// the causal softmax kernel) at T = 1024 and logs one line starting
// "flash_attn:", which scripts/gpu_check.sh reports. It skips without a
// GPU (fails under LOOM_CUDA_REQUIRE=1).
func TestGPUFlashAttention(t *testing.T) {
	d := openGPU(t)
	fa := d.Kernels().(device.FlashAttention)
	r := rand.New(rand.NewPCG(27, 1024))
	for i := range 12 {
		dt := comm.Float32
		if i%3 == 2 {
			dt = comm.BFloat16
		}
		dh, dv := 8*(1+r.IntN(16)), 8*(1+r.IntN(16))
		if i%2 == 0 {
			dv = dh
		}
		s := device.AttnShape{Batch: 1 + r.IntN(8), T: 1 + r.IntN(300), DH: dh, DV: dv, Scale: float32(1 / math.Sqrt(float64(dh)))}
		what := fmt.Sprintf("%v %+v", dt, s)
		bt := s.Batch * s.T
		in := func(n int) []float64 {
			x := make([]float64, n)
			for j := range x {
				v := float32(2*r.Float64() - 1)
				if dt == comm.BFloat16 {
					v = math.Float32frombits(uint32(bf16Bits(v)) << 16)
				}
				x[j] = float64(v)
			}
			return x
		}
		q, k, v, g := in(bt*s.DH), in(bt*s.DH), in(bt*s.DV), in(bt*s.DV)
		want := cpuAttention(t, s, q, k, v, g)
		got, peak := flashAttention(t, d, fa, dt, s, q, k, v, g)
		if lim := max(512, (int64(bt)*4+511)/512*512); peak > lim {
			t.Errorf("%s: peak %d bytes allocated, want at most %d", what, peak, lim)
		}
		for j, name := range []string{"out", "lse", "dq", "dk", "dv"} {
			tl := []tol{flashOut, flashLSE, flashGrad, flashGrad, flashGrad}[j]
			if dt == comm.BFloat16 && j != 1 {
				tl.rtol += 4e-3
				if j >= 2 {
					tl.atol += 2e-3
				}
			}
			compareOut(t, what+": "+name, got[j], want[j], tl)
		}
	}
	if os.Getenv("LOOM_CUDA_BENCH") != "1" {
		return
	}
	// GPT-2 small's attention at batch 8: 8·12 heads of T 1024, width 64.
	s := device.AttnShape{Batch: 96, T: 1024, DH: 64, DV: 64, Scale: 0.125}
	bt := s.Batch * s.T
	alloc := func(n int, in bool) device.Buffer {
		b, err := d.Alloc(comm.Float32, n)
		if err != nil {
			t.Fatal(err)
		}
		if !in { // an output: its first write is the kernel's
			return b
		}
		x := make([]float32, n)
		for j := range x {
			x[j] = float32(2*r.Float64() - 1)
		}
		if err := d.CopyFromHost(b, comm.Host(x)); err != nil {
			t.Fatal(err)
		}
		return b
	}
	q, k, v, g := alloc(bt*s.DH, true), alloc(bt*s.DH, true), alloc(bt*s.DV, true), alloc(bt*s.DV, true)
	out, lse, probs := alloc(bt*s.DV, false), alloc(bt, false), alloc(bt*s.T, false)
	dq, dk, dv := alloc(bt*s.DH, false), alloc(bt*s.DH, false), alloc(bt*s.DV, false)
	kk := d.Kernels()
	timeIt := func(f func() error) time.Duration {
		t.Helper()
		if err := f(); err != nil { // warm-up: compiles and caches
			t.Fatal(err)
		}
		start, err := d.NewEvent(true)
		if err != nil {
			t.Fatal(err)
		}
		end, err := d.NewEvent(true)
		if err != nil {
			t.Fatal(err)
		}
		const reps = 5
		if err := start.Record(d.Compute()); err != nil {
			t.Fatal(err)
		}
		for range reps {
			if err := f(); err != nil {
				t.Fatal(err)
			}
		}
		if err := end.Record(d.Compute()); err != nil {
			t.Fatal(err)
		}
		if err := end.Synchronize(); err != nil {
			t.Fatal(err)
		}
		el, err := end.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = start.Close(), end.Close()
		return el / reps
	}
	fused := timeIt(func() error {
		if err := fa.FlashAttention(out, lse, q, k, v, s); err != nil {
			return err
		}
		return fa.FlashAttentionBackward(dq, dk, dv, g, out, lse, q, k, v, s)
	})
	ref := timeIt(func() error {
		if err := kk.Attention(out, probs, q, k, v, s); err != nil {
			return err
		}
		return kk.AttentionBackward(dq, dk, dv, g, probs, q, k, v, s)
	})
	// At T = 1024 the two paths agree (the reference ran last).
	read := func(b device.Buffer) []float64 {
		h := comm.Host(make([]float32, b.Len()))
		if err := d.CopyToHost(h, b); err != nil {
			t.Fatal(err)
		}
		return fromHost(h)
	}
	refOut, refDQ := read(out), read(dq)
	if err := fa.FlashAttention(out, lse, q, k, v, s); err != nil {
		t.Fatal(err)
	}
	if err := fa.FlashAttentionBackward(dq, dk, dv, g, out, lse, q, k, v, s); err != nil {
		t.Fatal(err)
	}
	compareOut(t, "T 1024: out vs the reference path", read(out), refOut, tol{2 * flashOut.rtol, 2 * flashOut.atol})
	compareOut(t, "T 1024: dq vs the reference path", read(dq), refDQ, tol{2 * flashGrad.rtol, 4 * flashGrad.atol})
	// FlashAttention-2's count: the forward's two products over the causal
	// half are 2·B·T²·dh flops, the backward 2.5 times that.
	flops := 3.5 * 2 * float64(s.Batch) * float64(s.T) * float64(s.T) * float64(s.DH)
	t.Logf("flash_attn: B·H %d T %d dh %d float32 forward+backward: fused %.3f ms (%.1f TFLOP/s causal), reference %.3f ms, fused/reference %.2f",
		s.Batch, s.T, s.DH, fused.Seconds()*1e3, flops/fused.Seconds()/1e12, ref.Seconds()*1e3, fused.Seconds()/ref.Seconds())
}
