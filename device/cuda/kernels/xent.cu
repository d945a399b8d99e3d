// Softmax cross-entropy over rows of logits (kernels.CrossEntropyRows and
// CrossEntropyRowsBackward): one warp per row, 1-D blocks of whole warps,
// any grid. logsumexp is kept in double per row, as on the CPU. Targets are
// int64 class indices; a row whose target is outside [0, v) gets a NaN loss
// rather than reading outside its row, and loom_xent_targets finds it for
// the host, which reports it as the CPU kernel's error.

// loss[r] = logsumexp(x_r) − x_r[targets[r]] and lse[r] = logsumexp(x_r)
// (lse null: not wanted), in double; loom_sum_f64 adds the losses.
extern "C" __global__ void loom_xent_fwd_f32(double *loss, double *lse, const float *logits, const i64 *targets,
                                             i64 rows, int v) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const float *x = logits + r * v;
    float mx = -__uint_as_float(0x7f800000u);
    for (int j = lane; j < v; j += 32) mx = fmaxf(mx, x[j]);
    mx = loom_warp_max(mx);
    double s = 0;
    for (int j = lane; j < v; j += 32) s += expf(x[j] - mx);
    const double l = mx + log(loom_warp_sum(s));
    if (lane != 0) continue;
    const i64 t = targets[r];
    loss[r] = t >= 0 && t < v ? l - x[t] : __longlong_as_double(0x7ff8000000000000ll);
    if (lse) lse[r] = l;
  }
}
LOOM_KERNEL(loom_xent_fwd_f32)

// loom_xent_bwd_rows sets dx = scale·(softmax(x_r) − onehot(targets[r])) per
// row, from the forward's lse, a warp per row.
__device__ __forceinline__ void loom_xent_bwd_rows(float *dx, const float *logits, const i64 *targets,
                                                   const double *lse, i64 rows, int v, double scale) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
    const i64 t = targets[r];
    const double l = lse[r];
    for (int j = lane; j < v; j += 32) {
      const double p = expf((float)(logits[r * v + j] - l));
      dx[r * v + j] = (float)(scale * (j == t ? p - 1 : p));
    }
  }
}

// dx = scale·(softmax(x_r) − onehot(targets[r])) per row, from the
// forward's lse: the gradient of scale·Σ loss. dx may alias logits.
extern "C" __global__ void loom_xent_bwd_f32(float *dx, const float *logits, const i64 *targets, const double *lse,
                                             i64 rows, int v, float scale) {
  loom_xent_bwd_rows(dx, logits, targets, lse, rows, v, (double)scale);
}
LOOM_KERNEL(loom_xent_bwd_f32)

// loom_xent_bwd_f32 with the scale g[0]/count read on the device, g the
// mean loss's gradient (CrossEntropyMeanBackward: nothing read back).
extern "C" __global__ void loom_xent_mean_bwd_f32(float *dx, const float *logits, const i64 *targets,
                                                  const double *lse, const float *g, i64 rows, int v, double count) {
  loom_xent_bwd_rows(dx, logits, targets, lse, rows, v, (double)g[0] / count);
}
LOOM_KERNEL(loom_xent_mean_bwd_f32)

// loss[0] = (float)(sum[0] / count): CrossEntropyMean's loss from the summed
// row losses, as autograd's host path rounds it (0/0 = NaN for no rows).
// One thread.
extern "C" __global__ void loom_xent_mean_f32(float *loss, const double *sum, double count) {
  if (blockIdx.x == 0 && threadIdx.x == 0) loss[0] = (float)(sum[0] / count);
}
LOOM_KERNEL(loom_xent_mean_f32)

// *bad = the least row r < rows whose target lies outside [0, v), where it
// is less than *bad: the host sets *bad to ~0 and reads it when it next
// waits for the device (kernels.CrossEntropyRows's target check). 1-D
// blocks, any grid.
extern "C" __global__ void loom_xent_targets(unsigned long long *bad, const i64 *targets, i64 rows, i64 v) {
  LOOM_FOR(r, rows) {
    const i64 t = targets[r];
    if (t < 0 || t >= v) atomicMin(bad, (unsigned long long)r);
  }
}
LOOM_KERNEL(loom_xent_targets)
