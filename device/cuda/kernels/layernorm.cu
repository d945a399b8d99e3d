// LayerNorm forward and backward (kernels.LayerNorm, LayerNormBackward):
// one warp per row, 1-D blocks of whole warps, any grid. Row statistics and
// the backward's row sums accumulate in double, as on the CPU, in two passes
// (mean, then squared deviations), so a large mean does not cancel the
// variance.

// y = (x − μ)·rstd·w + b for every row of n values; w and b may be null
// (ones, zeros); mean and rstd, when not null, receive each row's μ and
// 1/sqrt(σ² + eps) in double, as kernels.LayerNorm keeps them, for the
// backward. y may alias x.
extern "C" __global__ void loom_layernorm_fwd_f32(float *y, double *mean, double *rstd, const float *x, const float *w,
                                                  const float *b, i64 rows, int n, double eps) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double s = 0;
    for (int j = lane; j < n; j += 32) s += xr[j];
    const double mu = loom_warp_sum(s) / n;
    double q = 0;
    for (int j = lane; j < n; j += 32) {
      const double d = xr[j] - mu;
      q += d * d;
    }
    const double rs = 1.0 / sqrt(loom_warp_sum(q) / n + eps);
    for (int j = lane; j < n; j += 32) {
      double h = (xr[j] - mu) * rs;
      if (w) h *= w[j];
      if (b) h += b[j];
      yr[j] = (float)h;
    }
    if (lane == 0 && mean) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}
LOOM_KERNEL(loom_layernorm_fwd_f32)

// The gradient of y = LayerNorm(x, w, b) from dy, x, w (null: ones) and the
// forward's mean and rstd. With x̂ = (x − μ)·rstd and h = dy⊙w, per row
// dx = rstd·(h − mean(h) − x̂·mean(h⊙x̂)) (dx null: not wanted; dx may alias
// dy). Each warp adds dy⊙x̂ and dy of its rows into its own row of dwPart
// and dbPart ([gridDim.x·blockDim.x/32, n] each, null: not wanted), which
// loom_sum_mid_f32 then reduces to dw and db, so no two warps write one
// address and the result does not depend on timing.
extern "C" __global__ void loom_layernorm_bwd_f32(float *dx, float *dwPart, float *dbPart, const float *dy,
                                                  const float *x, const float *w, const double *mean,
                                                  const double *rstd, i64 rows, int n) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  float *dwp = dwPart ? dwPart + warp * n : 0;
  float *dbp = dbPart ? dbPart + warp * n : 0;
  for (int j = lane; j < n; j += 32) {
    if (dwp) dwp[j] = 0;
    if (dbp) dbp[j] = 0;
  }
  for (i64 r = warp; r < rows; r += warps) {
    const float *xr = x + r * n, *gr = dy + r * n;
    const double mu = mean[r], rs = rstd[r];
    double s1 = 0, s2 = 0;
    for (int j = lane; j < n; j += 32) {
      const double xh = (xr[j] - mu) * rs;
      const double h = w ? (double)gr[j] * w[j] : (double)gr[j];
      s1 += h;
      s2 += h * xh;
      if (dwp) dwp[j] += (float)(gr[j] * xh);
      if (dbp) dbp[j] += gr[j];
    }
    const double m1 = loom_warp_sum(s1) / n, m2 = loom_warp_sum(s2) / n;
    if (!dx) continue;
    float *dr = dx + r * n;
    for (int j = lane; j < n; j += 32) {
      const double xh = (xr[j] - mu) * rs;
      const double h = w ? (double)gr[j] * w[j] : (double)gr[j];
      dr[j] = (float)(rs * (h - m1 - xh * m2));
    }
  }
}
LOOM_KERNEL(loom_layernorm_bwd_f32)
