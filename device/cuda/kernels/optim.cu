// Optimizer updates in place (1-D blocks, any grid): AdamW (kernels.AdamW)
// and SGD (optim.SGD's update). Every intermediate is rounded to float32 and
// nothing is fused (the _rn intrinsics keep NVRTC from contracting), in the
// order of the CPU code, so the device's parameters equal the host's bit for
// bit: division and square root are IEEE-rounded on both.

// One AdamW step with the coefficients of kernels.AdamW: c0 = 1 − lr·wd,
// c1 = β1, c2 = 1 − β1, c3 = β2, c4 = 1 − β2, c5 = sqrt(1 − β2^t),
// c6 = −lr/(1 − β1^t), c7 = ε.
extern "C" __global__ void loom_adamw_f32(float *p, const float *g, float *m, float *v, i64 n, float c0, float c1,
                                          float c2, float c3, float c4, float c5, float c6, float c7) {
  LOOM_FOR(i, n) {
    const float pi = __fmul_rn(p[i], c0), gi = g[i];
    const float mi = __fadd_rn(__fmul_rn(m[i], c1), __fmul_rn(c2, gi));
    const float vi = __fadd_rn(__fmul_rn(v[i], c3), __fmul_rn(__fmul_rn(c4, gi), gi));
    const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c5), c7);
    p[i] = __fadd_rn(pi, __fdiv_rn(__fmul_rn(c6, mi), den));
    m[i] = mi;
    v[i] = vi;
  }
}
LOOM_KERNEL(loom_adamw_f32)

// Flags of loom_sgd_f32.
#define LOOM_SGD_MAXIMIZE 1  // ascend: the gradient's sign is flipped
#define LOOM_SGD_NESTEROV 2  // Nesterov momentum
#define LOOM_SGD_FIRST 4     // the first step: buf becomes the direction

// One SGD step: d = ±g (+ wd·p); with momentum mu ≠ 0, buf = d on the first
// step, else buf = mu·buf + damp·d (damp = 1 − dampening), and d = buf, or
// d + mu·buf with Nesterov; then p = p − lr·d. buf may be null when mu = 0.
extern "C" __global__ void loom_sgd_f32(float *p, const float *g, float *buf, i64 n, float lr, float wd, float mu,
                                        float damp, int flags) {
  LOOM_FOR(i, n) {
    float d = g[i];
    if (flags & LOOM_SGD_MAXIMIZE) d = -d;
    if (wd != 0.0f) d = __fadd_rn(d, __fmul_rn(wd, p[i]));
    if (mu != 0.0f) {
      const float b = (flags & LOOM_SGD_FIRST) ? d : __fadd_rn(__fmul_rn(mu, buf[i]), __fmul_rn(damp, d));
      buf[i] = b;
      d = (flags & LOOM_SGD_NESTEROV) ? __fadd_rn(d, __fmul_rn(mu, b)) : b;
    }
    p[i] = __fsub_rn(p[i], __fmul_rn(lr, d));
  }
}
LOOM_KERNEL(loom_sgd_f32)
