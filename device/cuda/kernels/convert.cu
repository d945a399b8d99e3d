// Fills and casts that device.Kernels needs beyond elementwise.cu's float32
// ones (1-D blocks, any grid): fills by bit pattern, so one kernel serves
// every type of a width (the host rounds the value to the buffer's type),
// and the exact float32 ↔ float64 casts.

// out[i] = v, 2-byte elements (bfloat16 or float16 bit patterns).
extern "C" __global__ void loom_fill_u16(unsigned short *out, unsigned short v, i64 n) {
  LOOM_FOR(i, n) out[i] = v;
}
LOOM_KERNEL(loom_fill_u16)

// out[i] = v, 8-byte elements (float64 bit patterns).
extern "C" __global__ void loom_fill_u64(unsigned long long *out, unsigned long long v, i64 n) {
  LOOM_FOR(i, n) out[i] = v;
}
LOOM_KERNEL(loom_fill_u64)

// out = float64(x), exact.
extern "C" __global__ void loom_cast_f32_f64(double *out, const float *x, i64 n) {
  LOOM_FOR(i, n) out[i] = (double)x[i];
}
LOOM_KERNEL(loom_cast_f32_f64)

// out = float32(x), to nearest even (a C cast, as Go's float32(x)).
extern "C" __global__ void loom_cast_f64_f32(float *out, const double *x, i64 n) {
  LOOM_FOR(i, n) out[i] = (float)x[i];
}
LOOM_KERNEL(loom_cast_f64_f32)

// out [outer, mid, inner] = g [outer, inner] repeated over mid: a row
// broadcast (outer = 1: kernels.FillRows) and one pass of
// kernels.BroadcastDims. Bit-exact copies.
extern "C" __global__ void loom_broadcast_mid_f32(float *out, const float *g, i64 outer, i64 mid, i64 inner) {
  LOOM_FOR(k, outer * mid * inner) out[k] = g[k / (mid * inner) * inner + k % inner];
}
LOOM_KERNEL(loom_broadcast_mid_f32)

// partial[blockIdx.x] = this block's share of Σ x, in double (a total of
// kernels.SumDims over every dim, which loom_sum_f64 then adds). Whole
// warps per block.
extern "C" __global__ void loom_sum_f32_partial(double *partial, const float *x, i64 n) {
  __shared__ double buf[32];
  double s = 0;
  LOOM_FOR(i, n) s += x[i];
  s = loom_block_sum(s, buf);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
LOOM_KERNEL(loom_sum_f32_partial)
