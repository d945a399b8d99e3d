// Elementwise kernels, casts and sums (1-D blocks unless a kernel says
// otherwise; any grid). The products and sums use the _rn intrinsics so
// NVRTC does not contract them into fused multiply-adds: each result is the
// float32 expression evaluated as written, as package kernels computes it.

// out = a·x + b·y elementwise (kernels.Add is a = b = 1; b = 0 is a scale
// and does not read y, which may then be null). out may alias x or y.
extern "C" __global__ void loom_axpby_f32(float *out, const float *x, const float *y, float a, float b, i64 n) {
  LOOM_FOR(i, n) {
    float v = __fmul_rn(a, x[i]);
    if (b != 0.0f) v = __fadd_rn(v, __fmul_rn(b, y[i]));
    out[i] = v;
  }
}
LOOM_KERNEL(loom_axpby_f32)

// out = x⊙y elementwise (kernels.Mul). out may alias x or y.
extern "C" __global__ void loom_mul_f32(float *out, const float *x, const float *y, i64 n) {
  LOOM_FOR(i, n) out[i] = __fmul_rn(x[i], y[i]);
}
LOOM_KERNEL(loom_mul_f32)

// out[i] = v.
extern "C" __global__ void loom_fill_f32(float *out, float v, i64 n) {
  LOOM_FOR(i, n) out[i] = v;
}
LOOM_KERNEL(loom_fill_f32)

// out = bfloat16(x), to nearest, ties to even (internal/half.ToBFloat16).
extern "C" __global__ void loom_cast_f32_bf16(unsigned short *out, const float *x, i64 n) {
  LOOM_FOR(i, n) out[i] = loom_f32_to_bf16(x[i]);
}
LOOM_KERNEL(loom_cast_f32_bf16)

// out = float32(x), exact (internal/half.BFloat16ToFloat32).
extern "C" __global__ void loom_cast_bf16_f32(float *out, const unsigned short *x, i64 n) {
  LOOM_FOR(i, n) out[i] = loom_bf16_to_f32(x[i]);
}
LOOM_KERNEL(loom_cast_bf16_f32)

// Sum over the middle dimension of x [outer, mid, inner] into out [outer,
// inner], accumulated in double (kernels.ColumnSums is outer = 1; the bias
// gradients and autograd's sums over a dim are this). 2-D blocks: x threads
// take columns, y threads split mid, and each block adds its y threads'
// partial sums in dynamic shared memory of blockDim.x·blockDim.y doubles.
extern "C" __global__ void loom_sum_mid_f32(float *out, const float *x, i64 outer, i64 mid, i64 inner) {
  LOOM_DYN_SMEM(double, part);
  const i64 tiles = (inner + blockDim.x - 1) / blockDim.x;
  const unsigned me = threadIdx.y * blockDim.x + threadIdx.x;
  // t is the same for the whole block, so every thread meets the barriers.
  for (i64 t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
    const i64 o = t / tiles, i = (t % tiles) * blockDim.x + threadIdx.x;
    double s = 0;
    if (i < inner)
      for (i64 m = threadIdx.y; m < mid; m += blockDim.y) s += (double)x[(o * mid + m) * inner + i];
    part[me] = s;
    __syncthreads();
    if (threadIdx.y == 0 && i < inner) {
      double a = 0;
      for (unsigned k = 0; k < blockDim.y; k++) a += part[k * blockDim.x + threadIdx.x];
      out[o * inner + i] = (float)a;
    }
    __syncthreads();
  }
}
LOOM_KERNEL(loom_sum_mid_f32)

// partial[blockIdx.x] = this block's share of Σ x², in double (the squared
// 2-norm of gradient clipping, optim.ClipGradNorm). Whole warps per block;
// loom_sum_f64 then adds the gridDim.x partials.
extern "C" __global__ void loom_sumsq_f32(double *partial, const float *x, i64 n) {
  __shared__ double buf[32];
  double s = 0;
  LOOM_FOR(i, n) {
    double v = x[i];
    s += v * v;
  }
  s = loom_block_sum(s, buf);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
LOOM_KERNEL(loom_sumsq_f32)

// out[0] = Σ x, in double, by one block of whole warps (launch a grid of 1).
extern "C" __global__ void loom_sum_f64(double *out, const double *x, i64 n) {
  __shared__ double buf[32];
  double s = 0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = loom_block_sum(s, buf);
  if (threadIdx.x == 0) out[0] = s;
}
LOOM_KERNEL(loom_sum_f64)
