// The local pieces of the vocab-parallel cross-entropy
// (parallel.VocabParallelCrossEntropy): each rank holds the logits of a
// vocab block [lo, lo+vl) for its rows, and the ranks exchange per-row
// maxima (all-reduce max) and (Σ exp, picked logit) pairs (all-reduce sum)
// between these kernels. One warp per row, 1-D blocks of whole warps, any
// grid. exp is double, like the CPU's kernels.ExpShift, so results differ
// from the host's only in the last float32 rounding.

// loom_max_go returns max(a, b) with Go's rules: a NaN wins, and +0 is
// larger than −0.
__device__ __forceinline__ float loom_max_go(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return __float_as_uint(a) & 0x80000000u ? b : a;
  return a > b ? a : b;
}

// mx[r] = the largest logit of row r of the block x [rows, vl] (−∞ for an
// empty block; NaN when the row holds one).
extern "C" __global__ void loom_vocab_max_f32(float *mx, const float *x, i64 rows, int vl) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    float m = __uint_as_float(0xff800000u);
    for (int j = lane; j < vl; j += 32) m = loom_max_go(m, x[r * vl + j]);
    for (int o = 16; o > 0; o >>= 1) m = loom_max_go(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) mx[r] = m;
  }
}
LOOM_KERNEL(loom_vocab_max_f32)

// pairs[2r] = Σ_j exp(x[r, j] − rmax[r]) over the block (in double, rounded
// once) and pairs[2r+1] = x[r, targets[r] − lo] when the target lies in the
// block, else 0: this rank's share of the pairs, Partial(sum) over the
// vocab axis.
extern "C" __global__ void loom_vocab_sumexp_pick_f32(float *pairs, const float *x, const float *rmax,
                                                      const i64 *targets, i64 rows, int vl, i64 lo) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const double shift = rmax[r];
    double s = 0;
    for (int j = lane; j < vl; j += 32) s += exp((double)x[r * vl + j] - shift);
    s = loom_warp_sum(s);
    if (lane != 0) continue;
    const i64 k = targets[r] - lo;
    pairs[2 * r] = (float)s;
    pairs[2 * r + 1] = k >= 0 && k < vl ? x[r * vl + k] : 0.0f;
  }
}
LOOM_KERNEL(loom_vocab_sumexp_pick_f32)

// The backward of the pairs: dx[r, j] = g[2r]·float32(exp(x[r, j] −
// rmax[r])), plus g[2r+1] at the target when it lies in the block (a
// float32 add, as the CPU's). dx may alias x.
extern "C" __global__ void loom_vocab_ce_bwd_f32(float *dx, const float *x, const float *rmax, const i64 *targets,
                                                 const float *g, i64 rows, int vl, i64 lo) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const double shift = rmax[r], gs = g[2 * r];
    const i64 k = targets[r] - lo;
    for (int j = lane; j < vl; j += 32) {
      float v = (float)(gs * (double)(float)exp((double)x[r * vl + j] - shift));
      if (j == k) v = __fadd_rn(v, g[2 * r + 1]);
      dx[r * vl + j] = v;
    }
  }
}
LOOM_KERNEL(loom_vocab_ce_bwd_f32)
