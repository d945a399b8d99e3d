package cuda

import (
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
)

// The fused attention of kernels/flash_attn.cu (device.FlashAttention):
// three kernels, a warp per row and flashWarps rows per block sharing
// each 32-row tile of the other operand. What they keep in device memory
// is out, the Batch·T lse and, in the backward, a Batch·T scratch of the
// row sums D = rowsum(dout∘out): never Batch·T·T.

var _ device.FlashAttention = cudaKernels{}

const (
	flashMaxDim = 128 // LOOM_FA_DMAX: widest q/k and v rows
	flashWarps  = 8   // LOOM_FA_WARPS: rows per block
)

// flashKernel is the name of the flash kernel base for dt.
func flashKernel(base string, dt comm.DType) string {
	if dt == comm.BFloat16 {
		return base + "_bf16"
	}
	return base + "_f32"
}

// FlashFits reports whether the fused kernels take s with elements of
// dt: float32 or bfloat16, head widths 1 to 128.
func (k cudaKernels) FlashFits(s device.AttnShape, dt comm.DType) bool {
	return (dt == comm.Float32 || dt == comm.BFloat16) && s.Batch >= 0 && s.T >= 0 &&
		s.DH > 0 && s.DH <= flashMaxDim && s.DV > 0 && s.DV <= flashMaxDim
}

// flashArgs checks fused attention's buffers: the tensors (named in
// names, nil where optional) share q's dtype, float32 or bfloat16, and
// lse is Float32; it returns them in order with lse last.
func (k cudaKernels) flashArgs(op string, s device.AttnShape, names []string, bufs []device.Buffer, optional []bool,
	lse device.Buffer) ([]*DeviceBuffer, error) {
	q := bufs[len(bufs)-3]
	dt := comm.Float32
	if q != nil && q.DType() == comm.BFloat16 {
		dt = comm.BFloat16
	}
	args := make([]arg, 0, len(bufs)+1)
	for i, b := range bufs {
		args = append(args, arg{name: names[i], b: b, dtypes: []comm.DType{dt}, optional: optional[i]})
	}
	args = append(args, f32("lse", lse))
	v, err := k.check(op, args...)
	if err != nil {
		return nil, err
	}
	if !k.FlashFits(s, dt) {
		if s.Batch < 0 || s.T < 0 || s.DH < 0 || s.DV < 0 {
			return nil, k.invalid(op, "negative shape %+v", s)
		}
		return nil, unsupported(k.d, op, "head widths %d and %d: the fused kernels take 1 to %d", s.DH, s.DV, flashMaxDim)
	}
	bt := s.Batch * s.T
	lens := map[string][2]int{"lse": {v[len(v)-1].Len(), bt}}
	for i, name := range names {
		if v[i] == nil {
			continue
		}
		w := s.DV
		if name == "q" || name == "k" || name == "dq" || name == "dk" {
			w = s.DH
		}
		lens[name] = [2]int{v[i].Len(), bt * w}
	}
	for _, name := range append(names, "lse") {
		if l, ok := lens[name]; ok && l[0] != l[1] {
			return nil, k.invalid(op, "%s has %d elements, want %d for %+v", name, l[0], l[1], s)
		}
	}
	return v, nil
}

// flashGrid is the grid of the flash kernels for s: one block per
// (head, row tile), capped as every grid-stride kernel is.
func (k cudaKernels) flashGrid(s device.AttnShape) Dim3 {
	return k.gridFor(s.Batch*((s.T+flashWarps-1)/flashWarps), 1)
}

// FlashAttention is device.FlashAttention's forward: one launch of
// loom_flash_attn_fwd (online softmax over 32-key tiles).
func (k cudaKernels) FlashAttention(out, lse, q, kk, vv device.Buffer, s device.AttnShape) error {
	const op = "FlashAttention"
	v, err := k.flashArgs(op, s, []string{"out", "q", "k", "v"}, []device.Buffer{out, q, kk, vv}, make([]bool, 4), lse)
	if err != nil {
		return err
	}
	if s.Batch*s.T == 0 {
		return nil
	}
	return k.launch(op, "flash_attn.cu", flashKernel("loom_flash_attn_fwd", v[1].DType()), k.flashGrid(s), Dim3{X: 32 * flashWarps}, 0,
		v[0].raw(), v[4].raw(), v[1].raw(), v[2].raw(), v[3].raw(), int64(s.Batch), int32(s.T), int32(s.DH), int32(s.DV), s.Scale)
}

// FlashAttentionBackward is device.FlashAttention's backward: the dq
// kernel (which also writes D = rowsum(g∘out) into a Batch·T float32
// scratch) then the dk/dv kernel, each recomputing the probabilities
// from lse.
func (k cudaKernels) FlashAttentionBackward(dq, dk, dv, g, out, lse, q, kk, vv device.Buffer, s device.AttnShape) error {
	const op = "FlashAttentionBackward"
	v, err := k.flashArgs(op, s, []string{"dq", "dk", "dv", "g", "out", "q", "k", "v"},
		[]device.Buffer{dq, dk, dv, g, out, q, kk, vv}, []bool{true, true, true, false, false, false, false, false}, lse)
	if err != nil {
		return err
	}
	if s.Batch*s.T == 0 || (v[0] == nil && v[1] == nil && v[2] == nil) {
		return nil
	}
	dt := v[5].DType()
	grid, block := k.flashGrid(s), Dim3{X: 32 * flashWarps}
	b, t, dh, dvw := int64(s.Batch), int32(s.T), int32(s.DH), int32(s.DV)
	return k.withScratch(comm.Float32, []int{s.Batch * s.T}, func(sc []*DeviceBuffer) error {
		dd := sc[0]
		if err := k.launch(op, "flash_attn.cu", flashKernel("loom_flash_attn_bwd_dq", dt), grid, block, 0,
			v[0].raw(), dd.raw(), v[3].raw(), v[4].raw(), v[8].raw(), v[5].raw(), v[6].raw(), v[7].raw(), b, t, dh, dvw, s.Scale); err != nil {
			return err
		}
		if v[1] == nil && v[2] == nil {
			return nil
		}
		return k.launch(op, "flash_attn.cu", flashKernel("loom_flash_attn_bwd_dkv", dt), grid, block, 0,
			v[1].raw(), v[2].raw(), v[3].raw(), v[8].raw(), dd.raw(), v[5].raw(), v[6].raw(), v[7].raw(), b, t, dh, dvw, s.Scale)
	})
}
