// Bias + GELU (exact, erf form) forward (kernels.BiasGELU), in float32 with
// erfcf and expf; 1-D blocks, any grid. The backward needs no kernel of its
// own: dx = dy⊙deriv is loom_mul_f32 and dbias = Σ_rows dx is
// loom_sum_mid_f32 with outer = 1 (kernels.BiasGELUBackward).

// h = x + bias (a float32 add, bias broadcast over rows of n; null: none),
// y = h·Φ(h) and, when deriv is not null, deriv = GELU'(h) = Φ(h) + h·φ(h).
// y and deriv may alias x.
extern "C" __global__ void loom_bias_gelu_fwd_f32(float *y, float *deriv, const float *x, const float *bias, i64 rows,
                                                  int n) {
  LOOM_FOR(i, rows * n) {
    const float h = bias ? __fadd_rn(x[i], bias[i % n]) : x[i];
    const float cdf = 0.5f * erfcf(-0.70710678118654752f * h);
    const float pdf = 0.39894228040143268f * expf(-0.5f * h * h);
    y[i] = h * cdf;
    if (deriv) deriv[i] = cdf + h * pdf;
  }
}
LOOM_KERNEL(loom_bias_gelu_fwd_f32)
