// Row softmax, log-softmax and the causal softmax of attention scores, and
// their backward (kernels.SoftmaxRows, LogSoftmaxRows, CausalSoftmax and
// their Backward): one warp per row, 1-D blocks of whole warps, any grid.
// exp is float32 expf of the argument formed in double; sums accumulate in
// double. Outputs may alias their inputs.

// loom_softmax_row writes to y[0..m) the softmax (or log-softmax) of
// scale·x[0..m) (each product rounded to float32, as a separate multiply
// would) and zeros to y[m..w); the calling warp's lanes split the row.
__device__ __forceinline__ void loom_softmax_row(float *y, const float *x, int m, int w, float scale, bool logOut,
                                                 unsigned lane) {
  float mx = -__uint_as_float(0x7f800000u);
  for (int j = lane; j < m; j += 32) mx = fmaxf(mx, __fmul_rn(x[j], scale));
  mx = loom_warp_max(mx);
  double s = 0;
  for (int j = lane; j < m; j += 32) s += expf((float)((double)__fmul_rn(x[j], scale) - mx));
  const double lse = mx + log(loom_warp_sum(s));
  for (int j = lane; j < m; j += 32) {
    const double v = (double)__fmul_rn(x[j], scale) - lse;
    y[j] = logOut ? (float)v : expf((float)v);
  }
  for (int j = m + lane; j < w; j += 32) y[j] = 0;
}

// y = softmax of every row of x (rows of n), or log-softmax when logOut.
extern "C" __global__ void loom_softmax_rows_f32(float *y, const float *x, i64 rows, int n, int logOut) {
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps)
    loom_softmax_row(y + r * n, x + r * n, n, n, 1.0f, logOut != 0, threadIdx.x & 31u);
}
LOOM_KERNEL(loom_softmax_rows_f32)

// dx = y⊙(dy − Σ dy⊙y) per row, the gradient of y = softmax(x).
extern "C" __global__ void loom_softmax_rows_bwd_f32(float *dx, const float *y, const float *dy, i64 rows, int n) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const float *yr = y + r * n, *gr = dy + r * n;
    double s = 0;
    for (int j = lane; j < n; j += 32) s += (double)gr[j] * yr[j];
    s = loom_warp_sum(s);
    for (int j = lane; j < n; j += 32) dx[r * n + j] = (float)(yr[j] * (gr[j] - s));
  }
}
LOOM_KERNEL(loom_softmax_rows_bwd_f32)

// dx = dy − exp(y)·Σ dy per row, the gradient of y = log-softmax(x).
extern "C" __global__ void loom_logsoftmax_rows_bwd_f32(float *dx, const float *y, const float *dy, i64 rows, int n) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const float *yr = y + r * n, *gr = dy + r * n;
    double s = 0;
    for (int j = lane; j < n; j += 32) s += gr[j];
    s = loom_warp_sum(s);
    for (int j = lane; j < n; j += 32) dx[r * n + j] = (float)(gr[j] - (double)expf(yr[j]) * s);
  }
}
LOOM_KERNEL(loom_logsoftmax_rows_bwd_f32)

// For every t×t block of scores x, row i becomes the softmax of scale·x over
// columns j ≤ i, and 0 at j > i (the reference attention's probabilities).
extern "C" __global__ void loom_causal_softmax_f32(float *y, const float *x, i64 blocks, int t, float scale) {
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < blocks * t; r += warps)
    loom_softmax_row(y + r * t, x + r * t, (int)(r % t) + 1, t, scale, false, threadIdx.x & 31u);
}
LOOM_KERNEL(loom_causal_softmax_f32)

// dx_j = scale·y_j·(dy_j − Σ_{k≤i} dy_k·y_k) for j ≤ i and 0 for j > i, per
// row i of every t×t block: the gradient of loom_causal_softmax_f32.
extern "C" __global__ void loom_causal_softmax_bwd_f32(float *dx, const float *y, const float *dy, i64 blocks, int t,
                                                       float scale) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < blocks * t; r += warps) {
    const int m = (int)(r % t) + 1;
    const float *yr = y + r * t, *gr = dy + r * t;
    double s = 0;
    for (int j = lane; j < m; j += 32) s += (double)gr[j] * yr[j];
    s = loom_warp_sum(s);
    for (int j = lane; j < t; j += 32) dx[r * t + j] = j < m ? (float)((double)scale * yr[j] * (gr[j] - s)) : 0.0f;
  }
}
LOOM_KERNEL(loom_causal_softmax_bwd_f32)

// loom_dim_base is the index of element 0 of column c of [outer, n, inner]
// (c = o·inner + i).
__device__ __forceinline__ i64 loom_dim_base(i64 c, i64 n, i64 inner) { return (c / inner) * n * inner + c % inner; }

// The softmax (log-softmax when logout) over the middle dim of
// [outer, n, inner], in double as kernels.Softmax64 computes it (its max
// keeps a NaN, as Go's does): one thread per (outer, inner) column,
// adjacent threads on adjacent columns, so the loads coalesce for
// inner ≥ 32. dst may alias src. 1-D blocks, any grid.
extern "C" __global__ void loom_softmax_dim_f32(float *dst, const float *src, i64 outer, i64 n, i64 inner,
                                                int logout) {
  LOOM_FOR(c, outer * inner) {
    const i64 base = loom_dim_base(c, n, inner);
    double m = -__longlong_as_double(0x7ff0000000000000ll);
    for (i64 k = 0; k < n; k++) {
      const double v = src[base + k * inner];
      if (v != v || v > m) m = v;
    }
    double s = 0;
    for (i64 k = 0; k < n; k++) s += exp((double)src[base + k * inner] - m);
    const double lse = m + log(s);
    for (i64 k = 0; k < n; k++) {
      const i64 i = base + k * inner;
      dst[i] = logout ? (float)((double)src[i] - lse) : (float)exp((double)src[i] - lse);
    }
  }
}
LOOM_KERNEL(loom_softmax_dim_f32)

// dx from y = loom_softmax_dim_f32's output and dy, in double as
// kernels.Softmax64Backward: y⊙(dy − Σ dy⊙y), or dy − exp(y)·Σ dy for the
// log-softmax. dx must not overlap y or dy. 1-D blocks, any grid.
extern "C" __global__ void loom_softmax_dim_bwd_f32(float *dx, const float *y, const float *dy, i64 outer, i64 n,
                                                    i64 inner, int logout) {
  LOOM_FOR(c, outer * inner) {
    const i64 base = loom_dim_base(c, n, inner);
    double s = 0;
    for (i64 k = 0; k < n; k++) {
      const i64 i = base + k * inner;
      s += logout ? (double)dy[i] : (double)dy[i] * (double)y[i];
    }
    for (i64 k = 0; k < n; k++) {
      const i64 i = base + k * inner;
      dx[i] = logout ? (float)((double)dy[i] - exp((double)y[i]) * s) : (float)((double)y[i] * ((double)dy[i] - s));
    }
  }
}
LOOM_KERNEL(loom_softmax_dim_bwd_f32)
