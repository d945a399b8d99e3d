package device

import "github.com/b7ea7098/loom/kernels"

// BlockAttentionKernels is the optional op set of context parallelism's
// block attention (package parallel/cp), beside Kernels
// (Kernels().(BlockAttentionKernels)): each method mirrors the CPU kernel
// of package kernels it names, on Buffers of the device that are all
// Float32 or all Float64 (the kernel's type parameter), queued on the
// Compute stream, with errors as for Kernels. The shape's position slices
// (QPos, KPos) are read before a method returns. parallel/cp refuses
// device tensors whose kernels lack it, naming the device.
type BlockAttentionKernels interface {
	// BlockAttention is kernels.BlockAttentionForward: out and the rows'
	// log-sum-exps lse of one Q block against one K/V block.
	BlockAttention(out, lse, q, k, v Buffer, s kernels.BlockAttnShape) error
	// MergeAttention is kernels.MergeAttention: (o2, lse2) merged into
	// (out, lse) in place, rows of dv.
	MergeAttention(out, lse, o2, lse2 Buffer, dv int) error
	// AttentionRowDots is kernels.AttentionRowDots: delta = rowsum(dout∘out).
	AttentionRowDots(delta, dout, out Buffer, dv int) error
	// BlockAttentionBackward is kernels.BlockAttentionBackward: adds one
	// block pair's gradients to dq, dk and dv (any may be nil).
	BlockAttentionBackward(dq, dk, dv, dout, q, k, v, lse, delta Buffer, s kernels.BlockAttnShape) error
}
