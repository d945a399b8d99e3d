package cuda

import (
	"fmt"
	"math"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
)

// The Kernels methods of A6's follow-ups: the softmax over a middle dim
// and the cross-entropy whose mean and backward scale stay on the device.

// dimShape checks buffers of [outer, n, inner] and returns the element
// count.
func (k cudaKernels) dimShape(op string, outer, n, inner int, names string, bufs ...*DeviceBuffer) (int, error) {
	l, err := k.shapeSize(op, []int{outer, n, inner})
	if err != nil {
		return 0, err
	}
	return l, k.lens(op, l, names, bufs...)
}

// SoftmaxDim is the softmax (log-softmax when log) over the middle dim of
// [outer, n, inner] by loom_softmax_dim_f32, in double as kernels.Softmax64
// (exp and log of the device's libm, so a float32 result may differ from
// the host's by one rounding).
func (k cudaKernels) SoftmaxDim(dst, src device.Buffer, outer, n, inner int, log bool) error {
	const op = "SoftmaxDim"
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	if _, err := k.dimShape(op, outer, n, inner, "ds", v...); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	return k.elementwise(op, "softmax.cu", "loom_softmax_dim_f32", outer*inner, v[0].raw(), v[1].raw(),
		int64(outer), int64(n), int64(inner), flag(log))
}

// SoftmaxDimBackward is SoftmaxDim's gradient from its output y by
// loom_softmax_dim_bwd_f32, in double as kernels.Softmax64Backward.
func (k cudaKernels) SoftmaxDimBackward(dx, y, dy device.Buffer, outer, n, inner int, log bool) error {
	const op = "SoftmaxDimBackward"
	v, err := k.check(op, f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	if _, err := k.dimShape(op, outer, n, inner, "xyd", v...); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	return k.elementwise(op, "softmax.cu", "loom_softmax_dim_bwd_f32", outer*inner, v[0].raw(), v[1].raw(), v[2].raw(),
		int64(outer), int64(n), int64(inner), flag(log))
}

// flag is a C int of b.
func flag(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// CrossEntropyMean is CrossEntropy's sum divided by count on the device:
// the per-row losses, loom_sum_f64, then loom_xent_mean_f32 rounds
// sum/count to float32 into loss, so nothing is read back. A target
// outside [0, v) is found as CrossEntropy's is.
func (k cudaKernels) CrossEntropyMean(loss, lse, logits, targets device.Buffer, v, count int) error {
	const op = "CrossEntropyMean"
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "count", count); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	b, err := k.check(op, f32("loss", loss), f64("lse", lse, true), f32("logits", logits), i64s("targets", targets))
	if err != nil {
		return err
	}
	if b[0].Len() != 1 {
		return k.invalid(op, "loss has %d elements, want 1", b[0].Len())
	}
	rows, err := k.rowsOf(op, b[2], "logits", v)
	if err != nil {
		return err
	}
	if err := k.lens(op, rows, "_lst", nil, b[1], nil, b[3]); err != nil {
		return err
	}
	if v > math.MaxInt32 {
		return k.invalid(op, "%d classes do not fit a C int", v)
	}
	if err := k.checkTargets(op, b[3], rows, v); err != nil {
		return err
	}
	return k.withScratch(comm.Float64, []int{rows, 1}, func(s []*DeviceBuffer) error {
		if err := k.rowwise(op, "xent.cu", "loom_xent_fwd_f32", rows, s[0].raw(), b[1].raw(), b[2].raw(), b[3].raw(),
			int64(rows), int32(v)); err != nil {
			return err
		}
		if err := k.launch(op, "elementwise.cu", "loom_sum_f64", Dim3{X: 1}, Dim3{X: blockThreads}, 0, s[1].raw(), s[0].raw(), int64(rows)); err != nil {
			return err
		}
		return k.launch(op, "xent.cu", "loom_xent_mean_f32", Dim3{X: 1}, Dim3{X: 1}, 0, b[0].raw(), s[1].raw(), float64(count))
	})
}

// CrossEntropyMeanBackward is CrossEntropyBackward with the scale
// g[0]/count (in double) read by loom_xent_mean_bwd_f32 on the device.
func (k cudaKernels) CrossEntropyMeanBackward(dx, logits, targets, lse, g device.Buffer, v, count int) error {
	const op = "CrossEntropyMeanBackward"
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "count", count); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	b, err := k.check(op, f32("dx", dx), f32("logits", logits), i64s("targets", targets), f64("lse", lse, false), f32("g", g))
	if err != nil {
		return err
	}
	if b[4].Len() != 1 {
		return k.invalid(op, "g has %d elements, want 1", b[4].Len())
	}
	rows, err := k.rowsOf(op, b[1], "logits", v)
	if err != nil {
		return err
	}
	if err := k.lens(op, b[1].Len(), "d", b[0]); err != nil {
		return err
	}
	if err := k.lens(op, rows, "__tl", nil, nil, b[2], b[3]); err != nil {
		return err
	}
	if v > math.MaxInt32 {
		return k.invalid(op, "%d classes do not fit a C int", v)
	}
	if err := k.checkTargets(op, b[2], rows, v); err != nil {
		return err
	}
	return k.rowwise(op, "xent.cu", "loom_xent_mean_bwd_f32", rows, b[0].raw(), b[1].raw(), b[2].raw(), b[3].raw(), b[4].raw(),
		int64(rows), int32(v), float64(count))
}
