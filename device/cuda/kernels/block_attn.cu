// Block attention with log-sum-exp (device.BlockAttentionKernels, the
// kernels of package kernels' BlockAttentionForward, MergeAttention,
// AttentionRowDots and BlockAttentionBackward): one Q block of tq rows
// against one K/V block of tk rows, per head b of batch (batch and heads
// flattened); q [tq, dh], k [tk, dh], v [tk, dv], out [tq, dv] per head,
// row-major, heads back to back. Row i of Q is at global position qpos[i]
// (q0 + i when qpos is null), row j of K at kpos[j] (k0 + j); with causal
// set, row i sees key j only when its position is at most row i's. A row
// that sees no key gets output 0 and lse −Inf.
//
// Each kernel exists for float32 (_f32) and float64 (_f64): scores, exps,
// sums and the lse are computed in the element type, so a float64 run
// matches the CPU's float64 kernels to float64 rounding. dh, dv ≤ 128.
// The attention kernels run a warp per row (a query row; in the dk/dv
// kernel a key row), 1-D blocks of whole warps, any grid (warps stride
// over the rows); keys (or queries) are taken 32 at a time, a lane each,
// straight from global memory (the rows are short and cached), so no
// block-wide shared memory or barrier is needed: each warp's probabilities
// pass through its own row of a small __shared__ array.

#define LOOM_BA_DMAX 128
#define LOOM_BA_WARPS 32  // the most warps of a block (1024 threads)

template <typename T>
__device__ __forceinline__ T loom_ba_ninf() {
  return -(T)__uint_as_float(0x7f800000u);
}
__device__ __forceinline__ float loom_ba_exp(float x) { return expf(x); }
__device__ __forceinline__ double loom_ba_exp(double x) { return exp(x); }
__device__ __forceinline__ float loom_ba_log(float x) { return logf(x); }
__device__ __forceinline__ double loom_ba_log(double x) { return log(x); }

template <typename T>
__device__ __forceinline__ T loom_ba_warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) {
    const T u = __shfl_xor_sync(0xffffffffu, v, o);
    v = u > v ? u : v;
  }
  return v;
}

// loom_ba_dot returns Σ_c a[c]·b[c] over c < d, in order.
template <typename T>
__device__ __forceinline__ T loom_ba_dot(const T *a, const T *b, int d) {
  T s = 0;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// loom_ba_pos is the global position of row i of a block: pos[i], or
// base + i without a position list.
__device__ __forceinline__ i64 loom_ba_pos(const i64 *pos, i64 base, int i) { return pos != 0 ? pos[i] : base + i; }

// The forward, a warp per query row: an online softmax over the visible
// keys (running max m and sum l, the output rescaled as m grows), then
// out = o/l and lse = m + log l.
template <typename T>
__device__ void loom_ba_fwd(T *out, T *lse, const T *q, const T *k, const T *v, const i64 *qpos, const i64 *kpos,
                            i64 batch, int tq, int tk, int dh, int dv, i64 q0, i64 k0, double scale, int causal) {
  __shared__ T ps[LOOM_BA_WARPS][32];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const T sc = (T)scale, ninf = loom_ba_ninf<T>();
  for (i64 r = (i64)blockIdx.x * warps + w; r < batch * tq; r += (i64)gridDim.x * warps) {
    const i64 b = r / tq;
    const int i = (int)(r % tq);
    const i64 qp = loom_ba_pos(qpos, q0, i);
    const T *qi = q + r * dh, *kb = k + b * tk * dh, *vb = v + b * tk * dv;
    T m = ninf, l = 0, o[LOOM_BA_DMAX / 32] = {0, 0, 0, 0};
    for (int j0 = 0; j0 < tk; j0 += 32) {
      const int j = j0 + (int)lane;
      const bool vis = j < tk && (!causal || loom_ba_pos(kpos, k0, j) <= qp);
      const T s = vis ? sc * loom_ba_dot(qi, kb + (i64)j * dh, dh) : ninf;
      const T tm = loom_ba_warp_max(s);
      if (tm == ninf) continue;  // no key of the tile is visible: the same for the whole warp
      const T mn = tm > m ? tm : m, corr = loom_ba_exp(m - mn);
      const T p = vis ? loom_ba_exp(s - mn) : (T)0;
      l = l * corr + loom_warp_sum(p);
      ps[w][lane] = p;
      __syncwarp();
      const int n = tk - j0 < 32 ? tk - j0 : 32;
      for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
        const int c = (int)lane + 32 * rr;
        if (c >= dv) break;
        T acc = o[rr] * corr;
        for (int jj = 0; jj < n; jj++) acc += ps[w][jj] * vb[(i64)(j0 + jj) * dv + c];
        o[rr] = acc;
      }
      __syncwarp();  // ps is rewritten by the next tile
      m = mn;
    }
    for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
      const int c = (int)lane + 32 * rr;
      if (c < dv) out[r * dv + c] = l > 0 ? o[rr] / l : (T)0;
    }
    if (lane == 0) lse[r] = l > 0 ? m + loom_ba_log(l) : ninf;
  }
}

extern "C" __global__ void loom_block_attn_fwd_f32(float *out, float *lse, const float *q, const float *k,
                                                   const float *v, const i64 *qpos, const i64 *kpos, i64 batch, int tq,
                                                   int tk, int dh, int dv, i64 q0, i64 k0, double scale, int causal) {
  loom_ba_fwd(out, lse, q, k, v, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_fwd_f32)

extern "C" __global__ void loom_block_attn_fwd_f64(double *out, double *lse, const double *q, const double *k,
                                                   const double *v, const i64 *qpos, const i64 *kpos, i64 batch, int tq,
                                                   int tk, int dh, int dv, i64 q0, i64 k0, double scale, int causal) {
  loom_ba_fwd(out, lse, q, k, v, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_fwd_f64)

// The LSE merge, a thread per row of dv columns: with l = log(exp(lse) +
// exp(lse2)), out = exp(lse−l)·out + exp(lse2−l)·o2 and lse = l; a row
// whose two lses are −Inf stays as it is.
template <typename T>
__device__ void loom_ba_merge(T *out, T *lse, const T *o2, const T *lse2, i64 rows, int dv) {
  LOOM_FOR(r, rows) {
    const T l1 = lse[r], l2 = lse2[r], m = l1 > l2 ? l1 : l2;
    if (m == loom_ba_ninf<T>()) continue;
    const T l = m + loom_ba_log(loom_ba_exp(l1 - m) + loom_ba_exp(l2 - m));
    const T a = loom_ba_exp(l1 - l), b = loom_ba_exp(l2 - l);
    for (int c = 0; c < dv; c++) out[r * dv + c] = a * out[r * dv + c] + b * o2[r * dv + c];
    lse[r] = l;
  }
}

extern "C" __global__ void loom_block_attn_merge_f32(float *out, float *lse, const float *o2, const float *lse2,
                                                     i64 rows, int dv) {
  loom_ba_merge(out, lse, o2, lse2, rows, dv);
}
LOOM_KERNEL(loom_block_attn_merge_f32)

extern "C" __global__ void loom_block_attn_merge_f64(double *out, double *lse, const double *o2, const double *lse2,
                                                     i64 rows, int dv) {
  loom_ba_merge(out, lse, o2, lse2, rows, dv);
}
LOOM_KERNEL(loom_block_attn_merge_f64)

// The row dots of the backward, a thread per row: delta = Σ_c dout·out.
template <typename T>
__device__ void loom_ba_rowdots(T *delta, const T *dout, const T *out, i64 rows, int dv) {
  LOOM_FOR(r, rows) delta[r] = loom_ba_dot(dout + r * dv, out + r * dv, dv);
}

extern "C" __global__ void loom_block_attn_rowdots_f32(float *delta, const float *dout, const float *out, i64 rows,
                                                       int dv) {
  loom_ba_rowdots(delta, dout, out, rows, dv);
}
LOOM_KERNEL(loom_block_attn_rowdots_f32)

extern "C" __global__ void loom_block_attn_rowdots_f64(double *delta, const double *dout, const double *out, i64 rows,
                                                       int dv) {
  loom_ba_rowdots(delta, dout, out, rows, dv);
}
LOOM_KERNEL(loom_block_attn_rowdots_f64)

// The backward's query kernel, a warp per query row i: dq_i +=
// scale·Σ_j ds_ij·k_j over the visible keys, with p_ij = exp(scale·q_i·k_j
// − lse_i) and ds_ij = p_ij·(dout_i·v_j − delta_i). A row with lse −Inf
// (it sees no key in any block) adds nothing.
template <typename T>
__device__ void loom_ba_bwd_dq(T *dq, const T *dout, const T *q, const T *k, const T *v, const T *lse, const T *delta,
                               const i64 *qpos, const i64 *kpos, i64 batch, int tq, int tk, int dh, int dv, i64 q0,
                               i64 k0, double scale, int causal) {
  __shared__ T ps[LOOM_BA_WARPS][32];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const T sc = (T)scale, ninf = loom_ba_ninf<T>();
  for (i64 r = (i64)blockIdx.x * warps + w; r < batch * tq; r += (i64)gridDim.x * warps) {
    const T li = lse[r], di = delta[r];
    if (li == ninf) continue;  // the same for the whole warp
    const i64 b = r / tq;
    const int i = (int)(r % tq);
    const i64 qp = loom_ba_pos(qpos, q0, i);
    const T *qi = q + r * dh, *gi = dout + r * dv, *kb = k + b * tk * dh, *vb = v + b * tk * dv;
    T acc[LOOM_BA_DMAX / 32] = {0, 0, 0, 0};
    for (int j0 = 0; j0 < tk; j0 += 32) {
      const int j = j0 + (int)lane;
      T ds = 0;
      if (j < tk && (!causal || loom_ba_pos(kpos, k0, j) <= qp)) {
        const T p = loom_ba_exp(sc * loom_ba_dot(qi, kb + (i64)j * dh, dh) - li);
        ds = p * (loom_ba_dot(gi, vb + (i64)j * dv, dv) - di);
      }
      ps[w][lane] = ds;
      __syncwarp();
      const int n = tk - j0 < 32 ? tk - j0 : 32;
      for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
        const int c = (int)lane + 32 * rr;
        if (c >= dh) break;
        T a = acc[rr];
        for (int jj = 0; jj < n; jj++) a += ps[w][jj] * kb[(i64)(j0 + jj) * dh + c];
        acc[rr] = a;
      }
      __syncwarp();
    }
    for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
      const int c = (int)lane + 32 * rr;
      if (c < dh) dq[r * dh + c] += sc * acc[rr];
    }
  }
}

extern "C" __global__ void loom_block_attn_bwd_dq_f32(float *dq, const float *dout, const float *q, const float *k,
                                                      const float *v, const float *lse, const float *delta,
                                                      const i64 *qpos, const i64 *kpos, i64 batch, int tq, int tk,
                                                      int dh, int dv, i64 q0, i64 k0, double scale, int causal) {
  loom_ba_bwd_dq(dq, dout, q, k, v, lse, delta, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_bwd_dq_f32)

extern "C" __global__ void loom_block_attn_bwd_dq_f64(double *dq, const double *dout, const double *q, const double *k,
                                                      const double *v, const double *lse, const double *delta,
                                                      const i64 *qpos, const i64 *kpos, i64 batch, int tq, int tk,
                                                      int dh, int dv, i64 q0, i64 k0, double scale, int causal) {
  loom_ba_bwd_dq(dq, dout, q, k, v, lse, delta, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_bwd_dq_f64)

// The backward's key kernel, a warp per key row j: dv_j += Σ_i p_ij·dout_i
// and dk_j += scale·Σ_i ds_ij·q_i over the query rows that see key j (and
// see some key: lse_i > −Inf). No atomics: every output row has one
// writer. dk or dv may be null (not wanted).
template <typename T>
__device__ void loom_ba_bwd_dkv(T *dk, T *dv_, const T *dout, const T *q, const T *k, const T *v, const T *lse,
                                const T *delta, const i64 *qpos, const i64 *kpos, i64 batch, int tq, int tk, int dh,
                                int dv, i64 q0, i64 k0, double scale, int causal) {
  __shared__ T ps[LOOM_BA_WARPS][32], dss[LOOM_BA_WARPS][32];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const T sc = (T)scale, ninf = loom_ba_ninf<T>();
  for (i64 r = (i64)blockIdx.x * warps + w; r < batch * tk; r += (i64)gridDim.x * warps) {
    const i64 b = r / tk;
    const int j = (int)(r % tk);
    const i64 kp = loom_ba_pos(kpos, k0, j);
    const T *kj = k + r * dh, *vj = v + r * dv, *qb = q + b * tq * dh, *gb = dout + b * tq * dv;
    T ak[LOOM_BA_DMAX / 32] = {0, 0, 0, 0}, av[LOOM_BA_DMAX / 32] = {0, 0, 0, 0};
    for (int i0 = 0; i0 < tq; i0 += 32) {
      const int i = i0 + (int)lane;
      T p = 0, ds = 0;
      if (i < tq && (!causal || kp <= loom_ba_pos(qpos, q0, i)) && lse[b * tq + i] != ninf) {
        p = loom_ba_exp(sc * loom_ba_dot(qb + (i64)i * dh, kj, dh) - lse[b * tq + i]);
        ds = p * (loom_ba_dot(gb + (i64)i * dv, vj, dv) - delta[b * tq + i]);
      }
      ps[w][lane] = p;
      dss[w][lane] = ds;
      __syncwarp();
      const int n = tq - i0 < 32 ? tq - i0 : 32;
      for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
        const int c = (int)lane + 32 * rr;
        if (c < dv) {
          T a = av[rr];
          for (int ii = 0; ii < n; ii++) a += ps[w][ii] * gb[(i64)(i0 + ii) * dv + c];
          av[rr] = a;
        }
        if (c < dh) {
          T a = ak[rr];
          for (int ii = 0; ii < n; ii++) a += dss[w][ii] * qb[(i64)(i0 + ii) * dh + c];
          ak[rr] = a;
        }
      }
      __syncwarp();
    }
    for (int rr = 0; rr < LOOM_BA_DMAX / 32; rr++) {
      const int c = (int)lane + 32 * rr;
      if (c < dv && dv_ != 0) dv_[r * dv + c] += av[rr];
      if (c < dh && dk != 0) dk[r * dh + c] += sc * ak[rr];
    }
  }
}

extern "C" __global__ void loom_block_attn_bwd_dkv_f32(float *dk, float *dv_, const float *dout, const float *q,
                                                       const float *k, const float *v, const float *lse,
                                                       const float *delta, const i64 *qpos, const i64 *kpos, i64 batch,
                                                       int tq, int tk, int dh, int dv, i64 q0, i64 k0, double scale,
                                                       int causal) {
  loom_ba_bwd_dkv(dk, dv_, dout, q, k, v, lse, delta, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_bwd_dkv_f32)

extern "C" __global__ void loom_block_attn_bwd_dkv_f64(double *dk, double *dv_, const double *dout, const double *q,
                                                       const double *k, const double *v, const double *lse,
                                                       const double *delta, const i64 *qpos, const i64 *kpos,
                                                       i64 batch, int tq, int tk, int dh, int dv, i64 q0, i64 k0,
                                                       double scale, int causal) {
  loom_ba_bwd_dkv(dk, dv_, dout, q, k, v, lse, delta, qpos, kpos, batch, tq, tk, dh, dv, q0, k0, scale, causal);
}
LOOM_KERNEL(loom_block_attn_bwd_dkv_f64)
