package device

import (
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
)

// Kernels is a device's op set: each method mirrors one CPU kernel of
// package kernels (named in its comment), takes that kernel's arguments
// as Buffers of the device, and queues the work on the device's Compute
// stream. Dtypes, devices and freed buffers are checked when a method is
// called (errors wrap ErrInvalid or, for buffers of another device, match
// ErrMixed); what the CPU kernel itself rejects (lengths, targets out of
// range) is found when the work runs, and returned by the next
// Synchronize of the stream, wrapped with the method's name. Outputs may
// alias inputs where the CPU kernel allows it.
//
// Buffers of row data are Float32 unless a method says otherwise; the
// statistics LayerNorm saves and CrossEntropy's log-sum-exps and loss are
// Float64, as the CPU kernels keep them; targets are Int64.
//
// Workers: the kernels whose CPU form takes kernels.Workers run with the
// device's thread budget (its BLAS's threads); every row is computed as by
// a serial loop, so results do not depend on it.
type Kernels interface {
	// Gemm is (*kernels.BLAS).Sgemm for Float32 buffers and Dgemm for
	// Float64, once or Batch times at the strides of g; with
	// g.Precision GemmBF16, Sgemm over A and B rounded to bfloat16.
	Gemm(g Gemm) error
	// Fill sets every element of dst (Float32, Float64, BFloat16 or
	// Float16) to v, rounded to dst's type.
	Fill(dst Buffer, v float64) error
	// Cast converts src into dst (same length) between Float32 and
	// BFloat16, Float16 or Float64, rounding to nearest even
	// (internal/half).
	Cast(dst, src Buffer) error
	// Add is kernels.Add: dst = a + b.
	Add(dst, a, b Buffer) error
	// Mul is kernels.Mul: dst = a·b.
	Mul(dst, a, b Buffer) error
	// ColumnSums is kernels.ColumnSums: out (n values) = the sum of the
	// rows of x (rows of n).
	ColumnSums(out, x Buffer, n int) error
	// Softmax is kernels.SoftmaxRows, or kernels.LogSoftmaxRows when log,
	// over rows of n.
	Softmax(dst, src Buffer, n int, log bool) error
	// SoftmaxBackward is kernels.SoftmaxRowsBackward, or
	// kernels.LogSoftmaxRowsBackward when log.
	SoftmaxBackward(dx, y, dy Buffer, n int, log bool) error
	// CausalSoftmax is kernels.CausalSoftmax over t×t blocks.
	CausalSoftmax(dst, src Buffer, t int, scale float32) error
	// CausalSoftmaxBackward is kernels.CausalSoftmaxBackward.
	CausalSoftmaxBackward(dx, y, dy Buffer, t int, scale float32) error
	// LayerNorm is kernels.LayerNorm over rows of n; mean and rstd
	// (Float64, one per row) may both be nil when there is no backward,
	// and w and b may be nil.
	LayerNorm(y, mean, rstd, x, w, b Buffer, n int, eps float64) error
	// LayerNormBackward is kernels.LayerNormBackward; dx, dw and db may
	// be nil; dw and db are overwritten.
	LayerNormBackward(dx, dw, db, dy, x, w, mean, rstd Buffer, n int) error
	// BiasGELU is kernels.BiasGELU: y = GELU(x + bias) over rows of n;
	// deriv and bias may be nil.
	BiasGELU(y, deriv, x, bias Buffer, n int) error
	// BiasGELUBackward is kernels.BiasGELUBackward; dbias may be nil.
	BiasGELUBackward(dx, dbias, dy, deriv Buffer, n int) error
	// Attention is kernels.CausalAttentionForward: out and the
	// probabilities (kept for the backward) of s.Batch causal heads.
	Attention(out, probs, q, k, v Buffer, s AttnShape) error
	// AttentionBackward is kernels.CausalAttentionBackward.
	AttentionBackward(dq, dk, dv, g, probs, q, k, v Buffer, s AttnShape) error
	// CrossEntropy is kernels.CrossEntropyRows over rows of v logits:
	// loss (Float64, one element) = the summed negative log-likelihood;
	// lse (Float64, one per row) may be nil.
	CrossEntropy(loss, lse, logits, targets Buffer, v int) error
	// CrossEntropyBackward is kernels.CrossEntropyRowsBackward.
	CrossEntropyBackward(dx, logits, targets, lse Buffer, v int, scale float64) error
	// AdamW is kernels.AdamW on Float32 or Float64 buffers, with the
	// coefficients c rounded to their type.
	AdamW(p, g, m, v Buffer, c [8]float64) error
	// SGD is kernels.SGD on Float32 or Float64 buffers of one type, with
	// the coefficients of s rounded to it; buf may be nil when
	// s.Momentum is 0.
	SGD(p, g, buf Buffer, s kernels.SGDStep) error
	// SumSquares is kernels.SumSquares of x (Float32 or Float64) into out
	// (Float64, one element): the squared 2-norm of a gradient block.
	SumSquares(out, x Buffer) error
	// Scale is kernels.Scale: dst = c·x (Float32 or Float64, one type),
	// with c rounded to it; dst may be x.
	Scale(dst, x Buffer, c float64) error

	// CopyBox is kernels.CopyBox: it copies the box of the given size at
	// soff in src, a row-major array of shape sshape, to doff in dst, a
	// row-major array of shape dshape (placement's local copies). dst and
	// src have one dtype, any of them, and hold at least prod(shape)
	// elements each; the index slices have one length (none: one
	// element). A box outside either array is an error wrapping
	// ErrInvalid (kernels.CheckBox), found at the call. The index slices
	// are read before it returns.
	CopyBox(dst Buffer, dshape, doff []int, src Buffer, sshape, soff, size []int) error

	// The methods below serve autograd's ops on devices (step A6).

	// FillRows is kernels.FillRows: every row of dst (rows of
	// row.Len()) is set to row (Linear's bias before its beta = 1 GEMM).
	FillRows(dst, row Buffer) error
	// SumDims is kernels.SumDims: out holds x (of shape) summed over the
	// dims where reduce is set, in row-major order over the dims kept.
	SumDims(out, x Buffer, shape []int, reduce []bool) error
	// BroadcastDims is kernels.BroadcastDims, SumDims's adjoint: out (of
	// shape) repeats g along the dims where reduce is set.
	BroadcastDims(out, g Buffer, shape []int, reduce []bool) error
	// PermuteDims is kernels.PermuteDims: out is x (of shape) with its
	// dims reordered so that out's dim i is x's dim perm[i].
	PermuteDims(out, x Buffer, shape, perm []int) error
	// NarrowDim is kernels.NarrowDim: out ([outer, length, inner]) is
	// entries [start, start+length) of x ([outer, n, inner]) along the
	// middle dim.
	NarrowDim(out, x Buffer, outer, n, inner, start, length int) error
	// PadDim is kernels.PadDim, NarrowDim's adjoint: out ([outer, full,
	// inner]) is g ([outer, n, inner]) at [start, start+n) and zero
	// elsewhere.
	PadDim(out, g Buffer, outer, n, inner, start, full int) error
	// ConcatDim is kernels.ConcatDim: out ([outer, Σ sizes, inner]) joins
	// xs[i] ([outer, sizes[i], inner]) along the middle dim.
	ConcatDim(out Buffer, xs []Buffer, sizes []int, outer, inner int) error
	// Embedding is kernels.EmbeddingForward: out's row i is the row of
	// ids[i] (Int64) in table (rows lo … lo+V−1 of d values), zeros for
	// ids outside that range.
	Embedding(out, table, ids Buffer, lo, d int) error
	// EmbeddingBackward is kernels.EmbeddingBackward: dtable is the sum by
	// id of g's rows, accumulated in acc (Float64, dtable's length,
	// overwritten).
	EmbeddingBackward(dtable, acc, g, ids Buffer, lo, d int) error
	// Pointwise is kernels.ReLU, SiLU, Tanh or Sigmoid (f): dst = f(x).
	Pointwise(f Pointwise, dst, x Buffer) error
	// PointwiseBackward is kernels.ReLUBackward, SiLUBackward,
	// TanhBackward or SigmoidBackward: dx from dy and saved, which is x
	// for ReLU and SiLU and the forward's result for Tanh and Sigmoid.
	PointwiseBackward(f Pointwise, dx, saved, dy Buffer) error
	// DropoutMask is kernels.DropoutMask: mask holds the block at offset
	// of shape box of a tensor of shape global, each element 0 or 1/(1−p)
	// as drawn from seed, step and its global index.
	DropoutMask(mask Buffer, offset, box, global []int, p float64, seed, step uint64) error
	// ArgmaxRows is kernels.ArgmaxRows: dst (Int64, one per row) is the
	// index of each row's largest element, rows of n.
	ArgmaxRows(dst, x Buffer, n int) error

	// The methods below are A6's follow-ups.

	// SoftmaxDim is kernels.Softmax64 (kernels.LogSoftmax form when log)
	// over the middle dim of [outer, n, inner] Float32 buffers: the
	// softmax over a dim other than the last, in float64 as the host's.
	SoftmaxDim(dst, src Buffer, outer, n, inner int, log bool) error
	// SoftmaxDimBackward is kernels.Softmax64Backward over the middle dim
	// of [outer, n, inner] Float32 buffers.
	SoftmaxDimBackward(dx, y, dy Buffer, outer, n, inner int, log bool) error
	// CrossEntropyMean is CrossEntropy with the mean taken on the device:
	// loss (Float32, one element) = float32(Σ/float64(count)), the sum of
	// kernels.CrossEntropyRows in float64 divided by count (the global
	// rows), as autograd's host path computes it, so that nothing is
	// read back (0 rows give NaN, as 0/0); lse (Float64, one per row)
	// may be nil. A negative count wraps ErrInvalid.
	CrossEntropyMean(loss, lse, logits, targets Buffer, v, count int) error
	// CrossEntropyMeanBackward is kernels.CrossEntropyRowsBackward with
	// the scale float64(g[0])/float64(count) read from g (Float32, one
	// element: the loss's gradient) on the device when the work runs.
	CrossEntropyMeanBackward(dx, logits, targets, lse, g Buffer, v, count int) error
}

// Float64Kernels is a Kernels whose dtype-generic methods take Float64
// buffers as well as Float32 ones (every buffer of a call in one dtype):
// Add, Mul, ColumnSums, FillRows, SumDims, BroadcastDims, PermuteDims,
// NarrowDim, PadDim and ConcatDim, besides Gemm, Fill, Scale, CopyBox,
// AdamW, SGD and SumSquares, which take Float64 on every device. The
// emulated device's Kernels is one, since the CPU kernels it runs are
// generic. CUDA's kernels are float32 and need not be: autograd then
// refuses float64 ops on that device (ErrUnsupported, naming the op,
// dtype and device) instead of failing in a kernel.
type Float64Kernels interface {
	Kernels
	// Float64 reports whether the generic methods take Float64 buffers.
	Float64() bool
}

// Pointwise names an elementwise activation of Kernels.Pointwise.
type Pointwise int

// The activations.
const (
	// ReLU is max(x, 0).
	ReLU Pointwise = iota
	// SiLU is x·σ(x).
	SiLU
	// Tanh is tanh(x).
	Tanh
	// Sigmoid is σ(x) = 1/(1 + e^−x).
	Sigmoid
)

// String returns the activation's name, "ReLU", "SiLU", "Tanh" or
// "Sigmoid".
func (f Pointwise) String() string {
	switch f {
	case ReLU:
		return "ReLU"
	case SiLU:
		return "SiLU"
	case Tanh:
		return "Tanh"
	case Sigmoid:
		return "Sigmoid"
	}
	return fmt.Sprintf("Pointwise(%d)", int(f))
}

// Gemm is one GEMM, or a batch of them, in row-major layout:
// C = Alpha·op(A)·op(B) + Beta·C with op(A) M×K, op(B) K×N and C M×N, the
// contract of (*kernels.BLAS).Sgemm. Leading dimensions and strides are in
// elements.
type Gemm struct {
	// TransA and TransB transpose A and B.
	TransA, TransB bool
	// M, N and K are the dimensions.
	M, N, K int
	// A, B and C are buffers of one dtype, Float32 or Float64.
	A, B, C Buffer
	// LDA, LDB and LDC are the row strides of A, B and C.
	LDA, LDB, LDC int
	// Alpha and Beta scale the product and C; with Beta 0, C's previous
	// contents (even NaN) are ignored.
	Alpha, Beta float64
	// Batch is the number of GEMMs (0 means 1); GEMM i reads A, B and C
	// from StrideA·i, StrideB·i and StrideC·i elements on.
	Batch                     int
	StrideA, StrideB, StrideC int
	// Precision is the arithmetic of the products: GemmF32 (the zero
	// value: the buffers' own type) or GemmBF16 (Float32 buffers only).
	Precision GemmPrecision
}

// GemmPrecision is the arithmetic of a Gemm's products.
type GemmPrecision int

// The precisions of Gemm.
const (
	// GemmF32 multiplies in the buffers' type (Float32 or Float64). On
	// CUDA a Float32 GEMM may use TF32 where the device's BLAS allows
	// it (device/cuda's WithTF32).
	GemmF32 GemmPrecision = iota
	// GemmBF16 is autocast's GEMM: A and B (Float32) are rounded to
	// bfloat16 (nearest even) and their products accumulated in float32
	// into C (Float32), as cuBLAS's bfloat16 GEMM with a float32 compute
	// type does. On the host and the emulated device it is the float32
	// GEMM over the rounded inputs (internal/half.RoundBFloat16s): each
	// product of two bfloat16 values is exact in float32, so only the
	// order of the float32 sums may differ from cuBLAS's.
	GemmBF16
)

// String returns "f32" or "bf16".
func (p GemmPrecision) String() string {
	switch p {
	case GemmF32:
		return "f32"
	case GemmBF16:
		return "bf16"
	}
	return fmt.Sprintf("GemmPrecision(%d)", int(p))
}

// AttnShape is the shape of causal attention over Batch heads: T
// positions, query and key width DH, value width DV, scores scaled by
// Scale.
type AttnShape struct {
	Batch, T, DH, DV int
	Scale            float32
}

// FlashAttention is fused causal attention, which a device may offer
// beside Kernels (Kernels().(FlashAttention)): the results of Attention
// and AttentionBackward without the Batch·T·T probabilities in device
// memory. The forward keeps each row's log-sum-exp of the scaled scores
// instead (lse: Float32, Batch·T elements); the backward recomputes the
// probabilities from q, k and lse tile by tile, and reads the forward's
// out for the softmax backward's row sums. Buffers are queued on the
// Compute stream as Kernels' are; errors wrap ErrInvalid for buffers that
// do not fit s, loom.ErrUnsupported for a shape or dtype without a kernel.
type FlashAttention interface {
	// FlashFits reports whether the fused kernels take shape s and
	// element type dt; a caller uses Attention otherwise.
	FlashFits(s AttnShape, dt comm.DType) bool
	// FlashAttention writes out (Batch·T·DV) and lse (Batch·T, Float32)
	// from q, k (Batch·T·DH) and v (Batch·T·DV).
	FlashAttention(out, lse, q, k, v Buffer, s AttnShape) error
	// FlashAttentionBackward writes the gradients dq, dk and dv (each
	// may be nil when not wanted) of FlashAttention's out from its
	// gradient g, given the forward's out and lse.
	FlashAttentionBackward(dq, dk, dv, g, out, lse, q, k, v Buffer, s AttnShape) error
}

// MoEKernels is the data movement of a mixture-of-experts dispatch and
// combine on a device (package moe's device path): each method mirrors one
// permute kernel of package kernels, on Float32 buffers of the device,
// queued on its Compute stream. A device offers it by implementing it
// beside Kernels (Kernels().(MoEKernels)); moe refuses device tensors
// without it, naming the device.
//
// The routing plan r (kernels.PlanRouting's, computed on the host from
// the experts the router chose) and counts are read before a method
// returns, so the caller may plan the next dispatch into them at once;
// a nil r or a plan whose sizes do not fit the buffers is an error (at
// the call for a nil plan, else when the work runs, as for Kernels).
type MoEKernels interface {
	// Permute is kernels.Permute: packed row p of out (r.Rows() rows of
	// d) is row RowSlot[p]/K of x (r.Tokens rows), zero for pad rows.
	Permute(out, x Buffer, d int, r *kernels.Routing) error
	// Unpermute is kernels.Unpermute: row t of out (r.Tokens rows of d)
	// is the gate-weighted sum of its slots' packed rows; gates (n·K
	// values) may be nil, weighting every slot by 1.
	Unpermute(out, packed, gates Buffer, d int, r *kernels.Routing) error
	// UnpermuteBackward is kernels.UnpermuteBackward: dpacked (or nil)
	// gets the gate-scaled rows of dout, dgates (or nil) the dot products
	// of packed's rows with dout's; packed may be nil when dgates is,
	// gates may be nil.
	UnpermuteBackward(dpacked, dgates, dout, packed, gates Buffer, d int, r *kernels.Routing) error
	// GroupByExpert is kernels.GroupByExpert: the rows of src (rank-major
	// chunks of counts, a [ranks, local] matrix) regrouped expert-major
	// into dst.
	GroupByExpert(dst, src Buffer, d int, counts []int, ranks, local int) error
	// GroupByRank is kernels.GroupByRank, GroupByExpert's inverse.
	GroupByRank(dst, src Buffer, d int, counts []int, ranks, local int) error
}
