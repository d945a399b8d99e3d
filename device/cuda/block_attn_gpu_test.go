//go:build linux && (amd64 || arm64)

package cuda

import (
	"errors"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

// gpuBlockAttn runs device.BlockAttentionKernels on d for host slices of
// T: each call copies its slices to device buffers, runs the method and
// copies every buffer back (so an output or an accumulated gradient comes
// back into its slice).
type gpuBlockAttn[T float32 | float64] struct {
	d *Device
	k device.BlockAttentionKernels
}

// call runs f on device copies of xs (nil stays nil) and copies them back.
func (g gpuBlockAttn[T]) call(f func(b []device.Buffer) error, xs ...[]T) error {
	dt := comm.Float32
	var z T
	if _, ok := any(z).(float64); ok {
		dt = comm.Float64
	}
	bufs := make([]device.Buffer, len(xs))
	defer func() {
		for _, b := range bufs {
			if b != nil {
				_ = b.Free()
			}
		}
	}()
	for i, x := range xs {
		if x == nil {
			continue
		}
		b, err := g.d.Alloc(dt, len(x))
		if err != nil {
			return err
		}
		bufs[i] = b
		if err := g.d.CopyFromHost(b, comm.Host(x)); err != nil {
			return err
		}
	}
	if err := f(bufs); err != nil {
		return err
	}
	var errs []error
	for i, x := range xs {
		if x != nil {
			errs = append(errs, g.d.CopyToHost(comm.Host(x), bufs[i]))
		}
	}
	return errors.Join(errs...)
}

func (g gpuBlockAttn[T]) forward(out, lse, q, k, v []T, s kernels.BlockAttnShape) error {
	return g.call(func(b []device.Buffer) error { return g.k.BlockAttention(b[0], b[1], b[2], b[3], b[4], s) }, out, lse, q, k, v)
}

func (g gpuBlockAttn[T]) merge(out, lse, o2, lse2 []T, dv int) error {
	return g.call(func(b []device.Buffer) error { return g.k.MergeAttention(b[0], b[1], b[2], b[3], dv) }, out, lse, o2, lse2)
}

func (g gpuBlockAttn[T]) rowDots(delta, dout, out []T, dv int) error {
	return g.call(func(b []device.Buffer) error { return g.k.AttentionRowDots(b[0], b[1], b[2], dv) }, delta, dout, out)
}

func (g gpuBlockAttn[T]) backward(dq, dk, dv, dout, q, k, v, lse, delta []T, s kernels.BlockAttnShape) error {
	return g.call(func(b []device.Buffer) error {
		return g.k.BlockAttentionBackward(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], s)
	}, dq, dk, dv, dout, q, k, v, lse, delta)
}

// TestGPUBlockAttention runs context parallelism's block attention
// (kernels/block_attn.cu) on device 0 against package kernels' CPU block
// kernels, float64 within 1e-12 relative and float32 within the flash
// kernels' tolerances: testBlockAttention's cases, and a cp=2 rank's
// blocks of a load-balanced T = 1024 (its own, two runs of 256, and the
// other rank's), 8 heads of 64. scripts/gpu_check.sh reports it as
// block-attn. It skips without a GPU (fails under LOOM_CUDA_REQUIRE=1).
func TestGPUBlockAttention(t *testing.T) {
	d := openGPU(t)
	k := d.Kernels().(device.BlockAttentionKernels)
	mine, other := runs([2]int{0, 256}, [2]int{768, 1024}), runs([2]int{256, 512}, [2]int{512, 768})
	cases := append(blockAttnCases(), blockAttnCase{name: "T=1024 cp=2 rank 0", batch: 8, tq: 512, dh: 64, dv: 64,
		tk1: 512, tk2: 512, qpos: mine, kpos1: mine, kpos2: other, causal: true})
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/f64", c.name), func(t *testing.T) {
			blockAttnCheck[float64](t, gpuBlockAttn[float64]{d, k}, c, blockAttnTol64, blockAttnTol64/10, blockAttnTol64, blockAttnTol64/10)
		})
		t.Run(fmt.Sprintf("%s/f32", c.name), func(t *testing.T) {
			if c.tq > 100 {
				// Sums of 512 float32 products on both sides, in other
				// orders: about √512 times the roundings of the short rows.
				blockAttnCheck[float32](t, gpuBlockAttn[float32]{d, k}, c, 1e-3, 1e-4, 1e-3, 1e-3)
				return
			}
			blockAttnCheck[float32](t, gpuBlockAttn[float32]{d, k}, c, 1e-4, 2e-5, 2e-4, 5e-5)
		})
	}
}
