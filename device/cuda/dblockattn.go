package cuda

import (
	"fmt"
	"math"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/kernels"
)

// Context parallelism's block attention (device.BlockAttentionKernels) on
// the kernels of kernels/block_attn.cu, float32 and float64: a warp per
// query row (per key row in the dk/dv kernel), an online softmax in the
// forward, the backward from the merged lse and the row dots. The row
// positions of a block that is not one run (QPos, KPos) are copied to a
// device scratch of int64 for the call.

var _ device.BlockAttentionKernels = cudaKernels{}

// blockAttnMaxDim is LOOM_BA_DMAX: the widest q/k and v rows.
const blockAttnMaxDim = 128

// blockAttnKernel is the name of kernel base for dt (Float32 or Float64).
func blockAttnKernel(base string, dt comm.DType) string {
	if dt == comm.Float64 {
		return base + "_f64"
	}
	return base + "_f32"
}

// floatArgs checks buffers that must all be Float32 or all Float64 (nil
// where optional), like the first non-nil one, and returns them.
func (k cudaKernels) floatArgs(op string, names []string, bufs []device.Buffer, optional []bool) ([]*DeviceBuffer, comm.DType, error) {
	dt := comm.Float32
	for _, b := range bufs {
		if b != nil && b.DType() == comm.Float64 {
			dt = comm.Float64
			break
		}
		if b != nil {
			break
		}
	}
	args := make([]arg, len(bufs))
	for i, b := range bufs {
		args[i] = arg{name: names[i], b: b, dtypes: []comm.DType{dt}, optional: optional[i]}
	}
	v, err := k.check(op, args...)
	return v, dt, err
}

// blockShape checks s and the buffers' lengths against it (want gives
// each named buffer's rows-and-width kind: "q" rows of DH, "k" key rows
// of DH, "v" key rows of DV, "o" query rows of DV, "r" one per query
// row).
func (k cudaKernels) blockShape(op string, s kernels.BlockAttnShape, names []string, v []*DeviceBuffer, kinds string) error {
	if s.Batch < 0 || s.TQ < 0 || s.TK < 0 || s.DH < 0 || s.DV < 0 {
		return k.invalid(op, "negative size in %+v", s)
	}
	if math.IsNaN(s.Scale) || math.IsInf(s.Scale, 0) {
		return k.invalid(op, "scale %v is not finite", s.Scale)
	}
	if _, ok := checked.Product([]int{s.Batch, max(s.TQ, s.TK), max(s.DH, s.DV, 1)}); !ok || s.TQ > math.MaxInt32 || s.TK > math.MaxInt32 {
		return k.invalid(op, "batch %d × rows %d × width %d overflows", s.Batch, max(s.TQ, s.TK), max(s.DH, s.DV))
	}
	if s.QPos != nil && len(s.QPos) != s.TQ || s.KPos != nil && len(s.KPos) != s.TK {
		return k.invalid(op, "%d Q positions and %d K positions for blocks of %d and %d rows", len(s.QPos), len(s.KPos), s.TQ, s.TK)
	}
	if s.DH > blockAttnMaxDim || s.DV > blockAttnMaxDim {
		return unsupported(k.d, op, "head widths %d and %d: the block attention kernels take up to %d", s.DH, s.DV, blockAttnMaxDim)
	}
	for i, b := range v {
		if b == nil {
			continue
		}
		var want int
		switch kinds[i] {
		case 'q':
			want = s.Batch * s.TQ * s.DH
		case 'k':
			want = s.Batch * s.TK * s.DH
		case 'v':
			want = s.Batch * s.TK * s.DV
		case 'o':
			want = s.Batch * s.TQ * s.DV
		case 'r':
			want = s.Batch * s.TQ
		}
		if b.Len() != want {
			return k.invalid(op, "%s has %d elements, want %d for %+v", names[i], b.Len(), want, s)
		}
	}
	return nil
}

// withPositions runs f with s's positions on the device (a null Buffer
// for a block that is one run) and the launch's shape arguments after
// them: qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal.
func (k cudaKernels) withPositions(op string, s kernels.BlockAttnShape, f func(shape []any) error) error {
	var sizes []int
	if s.QPos != nil && s.TQ > 0 {
		sizes = append(sizes, s.TQ)
	}
	if s.KPos != nil && s.TK > 0 {
		sizes = append(sizes, s.TK)
	}
	return k.withScratch(comm.Int64, sizes, func(sc []*DeviceBuffer) error {
		var pos [2]Buffer
		for i, p := range [][]int{s.QPos, s.KPos} {
			if len(p) == 0 {
				continue
			}
			b := sc[0]
			sc = sc[1:]
			host := make([]int64, len(p))
			for j, x := range p {
				host[j] = int64(x)
			}
			if err := CopyToDeviceAsync(k.d.compute, b.raw(), host); err != nil {
				return fmt.Errorf("%s: %s: positions: %w", k.d.name, op, err)
			}
			pos[i] = b.raw()
		}
		causal := int32(0)
		if s.Causal {
			causal = 1
		}
		return f([]any{pos[0], pos[1], int64(s.Batch), int32(s.TQ), int32(s.TK), int32(s.DH), int32(s.DV),
			int64(s.Q0), int64(s.K0), s.Scale, causal})
	})
}

// BlockAttention is device.BlockAttentionKernels' forward: one launch of
// loom_block_attn_fwd, a warp per query row.
func (k cudaKernels) BlockAttention(out, lse, q, kk, vv device.Buffer, s kernels.BlockAttnShape) error {
	const op = "BlockAttention"
	names := []string{"out", "lse", "q", "k", "v"}
	v, dt, err := k.floatArgs(op, names, []device.Buffer{out, lse, q, kk, vv}, make([]bool, 5))
	if err != nil {
		return err
	}
	if err := k.blockShape(op, s, names, v, "orqkv"); err != nil {
		return err
	}
	if s.Batch*s.TQ == 0 {
		return nil
	}
	return k.withPositions(op, s, func(shape []any) error {
		return k.rowwise(op, "block_attn.cu", blockAttnKernel("loom_block_attn_fwd", dt), s.Batch*s.TQ,
			append([]any{v[0].raw(), v[1].raw(), v[2].raw(), v[3].raw(), v[4].raw()}, shape...)...)
	})
}

// MergeAttention is device.BlockAttentionKernels' LSE merge: a thread per
// row.
func (k cudaKernels) MergeAttention(out, lse, o2, lse2 device.Buffer, dv int) error {
	const op = "MergeAttention"
	v, dt, err := k.floatArgs(op, []string{"out", "lse", "o2", "lse2"}, []device.Buffer{out, lse, o2, lse2}, make([]bool, 4))
	if err != nil {
		return err
	}
	rows := v[1].Len()
	if dv < 0 || dv > math.MaxInt32 || v[3].Len() != rows || v[0].Len() != rows*dv || v[2].Len() != rows*dv {
		return k.invalid(op, "out %d, lse %d, o2 %d, lse2 %d elements for rows of %d", v[0].Len(), rows, v[2].Len(), v[3].Len(), dv)
	}
	return k.elementwise(op, "block_attn.cu", blockAttnKernel("loom_block_attn_merge", dt), rows,
		v[0].raw(), v[1].raw(), v[2].raw(), v[3].raw(), int64(rows), int32(dv))
}

// AttentionRowDots is device.BlockAttentionKernels' row dots: a thread
// per row.
func (k cudaKernels) AttentionRowDots(delta, dout, out device.Buffer, dv int) error {
	const op = "AttentionRowDots"
	v, dt, err := k.floatArgs(op, []string{"delta", "dout", "out"}, []device.Buffer{delta, dout, out}, make([]bool, 3))
	if err != nil {
		return err
	}
	rows := v[0].Len()
	if dv < 0 || dv > math.MaxInt32 || v[1].Len() != rows*dv || v[2].Len() != rows*dv {
		return k.invalid(op, "delta %d, dout %d and out %d elements for rows of %d", rows, v[1].Len(), v[2].Len(), dv)
	}
	return k.elementwise(op, "block_attn.cu", blockAttnKernel("loom_block_attn_rowdots", dt), rows,
		v[0].raw(), v[1].raw(), v[2].raw(), int64(rows), int32(dv))
}

// BlockAttentionBackward is device.BlockAttentionKernels' backward: the
// dq kernel (a warp per query row) when dq is wanted, then the dk/dv
// kernel (a warp per key row) when dk or dv is; each adds to its
// gradients and recomputes the probabilities from lse.
func (k cudaKernels) BlockAttentionBackward(dq, dk, dv, dout, q, kk, vv, lse, delta device.Buffer, s kernels.BlockAttnShape) error {
	const op = "BlockAttentionBackward"
	names := []string{"dout", "dq", "dk", "dv", "q", "k", "v", "lse", "delta"}
	v, dt, err := k.floatArgs(op, names, []device.Buffer{dout, dq, dk, dv, q, kk, vv, lse, delta},
		[]bool{false, true, true, true, false, false, false, false, false})
	if err != nil {
		return err
	}
	if err := k.blockShape(op, s, names, v, "oqkvqkvrr"); err != nil {
		return err
	}
	if s.Batch*s.TQ*s.TK == 0 || v[1] == nil && v[2] == nil && v[3] == nil {
		return nil
	}
	return k.withPositions(op, s, func(shape []any) error {
		in := []any{v[0].raw(), v[4].raw(), v[5].raw(), v[6].raw(), v[7].raw(), v[8].raw()}
		if v[1] != nil {
			if err := k.rowwise(op, "block_attn.cu", blockAttnKernel("loom_block_attn_bwd_dq", dt), s.Batch*s.TQ,
				append(append([]any{v[1].raw()}, in...), shape...)...); err != nil {
				return err
			}
		}
		if v[2] == nil && v[3] == nil {
			return nil
		}
		return k.rowwise(op, "block_attn.cu", blockAttnKernel("loom_block_attn_bwd_dkv", dt), s.Batch*s.TK,
			append(append([]any{v[2].raw(), v[3].raw()}, in...), shape...)...)
	})
}
