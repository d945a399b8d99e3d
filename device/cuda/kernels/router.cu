// The MoE router's choice of experts (moe.Router.Route's scores, top-K
// selection and gates, moe/router.go computeLocal): one warp per token,
// 1-D blocks of whole warps, any grid. The scores are computed as the CPU
// does, in double in the same order (every lane of the warp computes the
// row's max and Σ exp itself, so no reduction reorders them) and rounded
// to float32; the selection follows the CPU's order exactly (a larger key
// first, equal keys the lower index first, NaN last), so the chosen
// experts are the CPU's whenever the float32 scores are. The capacity
// limit, the routing plan and the losses' sums are not here: the host
// plans from the chosen experts (kernels.PlanRouting).

// loom_before reports whether (ka, a) ranks before (kb, b) in moe's
// order: a larger key first, on equal keys the lower index, NaN last (NaNs
// by index).
__device__ __forceinline__ bool loom_before(double ka, int a, double kb, int b) {
  if (ka != ka) return kb != kb && a < b;
  if (kb != kb) return true;
  if (ka != kb) return ka > kb;
  return a < b;
}

// loom_router_score returns the float32 score of logit z: softmax (exp(z −
// mx)/s) or the logistic sigmoid, rounded to float32 as the CPU's scoreRow.
__device__ __forceinline__ double loom_router_score(float z, double mx, double s, int sigmoid) {
  if (!sigmoid) return (double)(float)(exp((double)z - mx) / s);
  const double x = z;
  if (x >= 0) return (double)(float)(1 / (1 + exp(-x)));
  const double e = exp(x);
  return (double)(float)(e / (1 + e));
}

// For every token t of logits [n, e]: sel[t, 0..k) = its k experts, best
// first; gates[t, j] = float32(gateScale·p_sel/d) with d = Σ of the
// selected scores (+1e-20 for sigmoid scores) when renorm, else 1; lse[t] =
// log Σ exp(z) (for the z-loss; null: not wanted); bad[t] = the number of
// logits that are NaN or ±Inf, in which case sel is 0..k−1 and the gates
// are 0, as on the CPU (which then reports the error). Selection keys are
// the scores, or float32(score + bias[x]) when bias is not null (the
// expert bias, rounded to float32 by the caller). With groups > 0
// (1 ≤ groups ≤ 64, dividing e) the experts form groups of e/groups; each
// group scores the double sum of its sumTop best keys, and a token chooses
// among its topGroups best groups only. sigmoid selects the score (0:
// softmax). k ≤ e.
extern "C" __global__ void loom_router_topk_f32(int *sel, float *gates, double *lse, i64 *bad, const float *logits,
                                                const float *bias, i64 n, int e, int k, int sigmoid, int renorm,
                                                double gateScale, int groups, int topGroups, int sumTop) {
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < n; t += warps) {
    const float *z = logits + t * e;
    // The row's max (Go's max: a NaN wins) and the non-finite count, then
    // Σ exp(z − max) in the CPU's order.
    double mx = -__longlong_as_double(0x7ff0000000000000ll);
    i64 nb = 0;
    for (int x = 0; x < e; x++) {
      const double f = z[x];
      if (f != f || f - f != 0) nb++;
      if (mx == mx && (f != f || f > mx)) mx = f;
    }
    if (nb > 0) {
      for (int j = lane; j < k; j += 32) {
        sel[t * k + j] = j;
        gates[t * k + j] = 0;
      }
      if (lane == 0) {
        bad[t] = nb;
        if (lse) lse[t] = 0;
      }
      continue;
    }
    double s = 0;
    for (int x = 0; x < e; x++) s += exp((double)z[x] - mx);
    // key(x) is expert x's selection key.
#define LOOM_KEY(x)                                                                     \
  (bias ? (double)__fadd_rn((float)loom_router_score(z[x], mx, s, sigmoid), bias[x]) \
        : loom_router_score(z[x], mx, s, sigmoid))
    // The allowed groups, as bits (all experts without a group limit).
    unsigned long long allowed = ~0ull;
    const int size = groups > 0 ? e / groups : e;
    if (groups > 0) {
      allowed = 0;
      // Every lane computes the same group scores and choice.
      double pk = 0;
      int pg = -1;
      for (int c = 0; c < topGroups; c++) {
        double bk = 0;
        int bg = -1;
        for (int g = 0; g < groups; g++) {
          // The group's score: the sum of its sumTop best keys, best first.
          double sum = 0, qk = 0;
          int q = -1;
          for (int m = 0; m < sumTop; m++) {
            double mk = 0;
            int mi = -1;
            for (int x = g * size; x < (g + 1) * size; x++) {
              const double kx = LOOM_KEY(x);
              if ((q < 0 || loom_before(qk, q, kx, x)) && (mi < 0 || loom_before(kx, x, mk, mi))) mk = kx, mi = x;
            }
            sum += mk;
            qk = mk, q = mi;
          }
          if ((pg < 0 || loom_before(pk, pg, sum, g)) && (bg < 0 || loom_before(sum, g, bk, bg))) bk = sum, bg = g;
        }
        allowed |= 1ull << bg;
        pk = bk, pg = bg;
      }
    }
    // The k best allowed experts, in order: slot j takes the best expert
    // ranked after slot j−1's; lanes split the experts.
    double pk = 0, d = 0;
    int px = -1;
    for (int j = 0; j < k; j++) {
      double bk = 0;
      int bx = -1;
      for (int x = lane; x < e; x += 32) {
        if (!(allowed >> (x / size) & 1)) continue;
        const double kx = LOOM_KEY(x);
        if ((px < 0 || loom_before(pk, px, kx, x)) && (bx < 0 || loom_before(kx, x, bk, bx))) bk = kx, bx = x;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const double ok = __shfl_xor_sync(0xffffffffu, bk, o);
        const int ox = __shfl_xor_sync(0xffffffffu, bx, o);
        if (ox >= 0 && (bx < 0 || loom_before(ok, ox, bk, bx))) bk = ok, bx = ox;
      }
      pk = bk, px = bx;
      if (lane == 0) sel[t * k + j] = bx;
      d += loom_router_score(z[bx], mx, s, sigmoid);
    }
#undef LOOM_KEY
    if (lane != 0) continue;
    if (!renorm)
      d = 1;
    else if (sigmoid)
      d += 1e-20;
    for (int j = 0; j < k; j++)
      gates[t * k + j] = (float)(gateScale * loom_router_score(z[sel[t * k + j]], mx, s, sigmoid) / d);
    bad[t] = 0;
    if (lse) lse[t] = mx + log(s);
  }
}
LOOM_KERNEL(loom_router_topk_f32)
