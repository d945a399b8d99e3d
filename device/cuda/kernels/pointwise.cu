// Pointwise activations and their backward (kernels.ReLU, SiLU, Tanh,
// Sigmoid and their Backward), the dropout mask (kernels.DropoutMask) and
// the row argmax (kernels.ArgmaxRows). 1-D blocks, any grid. SiLU, Tanh and
// Sigmoid compute in double, as the CPU kernels do, and round once to
// float32 (they are memory bound, so double costs nothing that matters).
// Outputs may alias inputs of the same length.

// loom_sigmoid is 1/(1+e^−x) without overflow, the CPU's formula.
__device__ __forceinline__ double loom_sigmoid(double x) {
  if (x >= 0) return 1 / (1 + exp(-x));
  const double e = exp(x);
  return e / (1 + e);
}

// Activation selectors of loom_act_f32 and loom_act_bwd_f32.
#define LOOM_ACT_RELU 0
#define LOOM_ACT_SILU 1
#define LOOM_ACT_TANH 2
#define LOOM_ACT_SIGMOID 3

// y = act(x) for act one of LOOM_ACT_* (ReLU keeps a NaN).
extern "C" __global__ void loom_act_f32(float *y, const float *x, i64 n, int act) {
  LOOM_FOR(i, n) {
    const float v = x[i];
    switch (act) {
      case LOOM_ACT_RELU: y[i] = v < 0 ? 0.0f : v; break;
      case LOOM_ACT_SILU: y[i] = (float)((double)v * loom_sigmoid(v)); break;
      case LOOM_ACT_TANH: y[i] = (float)tanh((double)v); break;
      default: y[i] = (float)loom_sigmoid(v); break;
    }
  }
}
LOOM_KERNEL(loom_act_f32)

// dx = the gradient of act from dy: ReLU and SiLU take the forward's input
// in xy (ReLU passes dy where x > 0, 0 elsewhere, at 0 too); Tanh and
// Sigmoid take the forward's result (dy·(1 − y²), dy·y·(1 − y)).
extern "C" __global__ void loom_act_bwd_f32(float *dx, const float *xy, const float *dy, i64 n, int act) {
  LOOM_FOR(i, n) {
    const double f = xy[i], g = dy[i];
    switch (act) {
      case LOOM_ACT_RELU: dx[i] = f > 0 ? dy[i] : 0.0f; break;
      case LOOM_ACT_SILU: {
        const double s = loom_sigmoid(f);
        dx[i] = (float)(g * s * (1 + f * (1 - s)));
        break;
      }
      case LOOM_ACT_TANH: dx[i] = (float)(g * (1 - f * f)); break;
      default: dx[i] = (float)(g * f * (1 - f)); break;
    }
  }
}
LOOM_KERNEL(loom_act_bwd_f32)

// loom_mix64 is SplitMix64's finaliser (kernels' mix64).
__device__ __forceinline__ unsigned long long loom_mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// mask = the dropout mask of the block of nd ≤ 6 dims b0..b5 whose first
// element has global row-major index base in a tensor whose row-major
// strides are g0..g5 (kernels.DropoutMask): element e is kept, as keep =
// float32(1/(1−p)), when the hash of (seed, step, e) mapped to [0, 1) is at
// least p, and 0 otherwise. The same hash as the CPU's, so the same mask,
// bit for bit.
extern "C" __global__ void loom_dropout_mask_f32(float *mask, int nd, i64 base, i64 b0, i64 b1, i64 b2, i64 b3,
                                                 i64 b4, i64 b5, i64 g0, i64 g1, i64 g2, i64 g3, i64 g4, i64 g5,
                                                 double p, float keep, unsigned long long seed,
                                                 unsigned long long step) {
  const i64 b[6] = {b0, b1, b2, b3, b4, b5}, g[6] = {g0, g1, g2, g3, g4, g5};
  i64 n = 1;
  for (int d = 0; d < nd; d++) n *= b[d];
  const unsigned long long key = loom_mix64(seed ^ loom_mix64(step + 0x9e3779b97f4a7c15ull));
  LOOM_FOR(i, n) {
    i64 e = base, k = i;
    for (int d = nd - 1; d >= 0; d--) {
      e += (k % b[d]) * g[d];
      k /= b[d];
    }
    const double u = (double)(loom_mix64(key ^ (unsigned long long)e) >> 11) * 0x1p-53;
    mask[i] = u >= p ? keep : 0.0f;
  }
}
LOOM_KERNEL(loom_dropout_mask_f32)

// loom_argmax_better reports whether candidate (v, j) beats the current
// (bv, bj) in kernels.ArgmaxRows's order: the first NaN wins over
// everything, then the larger value, then on a tie the lower index.
__device__ __forceinline__ bool loom_argmax_better(float v, int j, float bv, int bj) {
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return vn && (!bn || j < bj);
  return v > bv || (v == bv && j < bj);
}

// out[r] = the index of the largest value of row r of x (rows of n ≥ 1):
// one warp per row, 1-D blocks of whole warps, any grid.
extern "C" __global__ void loom_argmax_rows_f32(i64 *out, const float *x, i64 rows, int n) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    float bv = __uint_as_float(0xff800000u);  // −∞, which any number ties or beats
    int bj = n;                               // beaten by every index on a tie
    for (int j = lane; j < n; j += 32)
      if (loom_argmax_better(x[r * n + j], j, bv, bj)) bv = x[r * n + j], bj = j;
    for (int o = 16; o > 0; o >>= 1) {
      const float v = __shfl_xor_sync(0xffffffffu, bv, o);
      const int j = __shfl_xor_sync(0xffffffffu, bj, o);
      if (loom_argmax_better(v, j, bv, bj)) bv = v, bj = j;
    }
    if (lane == 0) out[r] = bj;
  }
}
LOOM_KERNEL(loom_argmax_rows_f32)
