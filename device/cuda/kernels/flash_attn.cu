// Causal flash attention (the fused form of kernels.CausalAttentionForward
// and Backward): per block b of batch (batch and heads flattened) q and k
// are [t, dh] and v and out [t, dv], row-major, blocks back to back;
// scores s_ij = float32(scale·q_i·k_j) for j ≤ i. The forward streams keys
// and values through shared memory in tiles of 32 with an online softmax
// (running max and sum), so it never writes the t×t matrix; it saves each
// row's log-sum-exp, from which the backward recomputes the probabilities.
// dh, dv ≤ 128. 1-D blocks of 1 to 4 warps, each warp one row (a query
// row, or in the dk/dv kernel a key row); any grid: blocks stride over
// (b, row tile) pairs. float32 throughout (the scores, the exps with expf,
// the sums), so results differ from the CPU's float64 softmax by float32
// roundings.

#define LOOM_FA_TILE 32
#define LOOM_FA_DMAX 128
#define LOOM_FA_WARPS 4

// loom_fa_load copies rows [r0, r0+32) of src [t, d] (rows at or past t as
// zeros) into the tile dst of row pitch LOOM_FA_DMAX+1 (the pad keeps
// lanes reading a column each in different banks); every thread of the
// block takes part.
__device__ __forceinline__ void loom_fa_load(float (*dst)[LOOM_FA_DMAX + 1], const float *src, int r0, int t,
                                             int d) {
  for (int e = threadIdx.x; e < LOOM_FA_TILE * d; e += blockDim.x) {
    const int r = e / d, c = e % d;
    dst[r][c] = r0 + r < t ? src[(i64)(r0 + r) * d + c] : 0.0f;
  }
}

// loom_fa_dot returns Σ_c a[c]·b[c] over c < d, in order.
__device__ __forceinline__ float loom_fa_dot(const float *a, const float *b, int d) {
  float s = 0;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// out = softmax(s)·v per row and lse[b·t + i] = log Σ_{j≤i} exp(s_ij).
extern "C" __global__ void loom_flash_attn_fwd_f32(float *out, float *lse, const float *q, const float *k,
                                                   const float *v, i64 batch, int t, int dh, int dv, float scale) {
  __shared__ float kt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], vt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float qs[LOOM_FA_WARPS][LOOM_FA_DMAX], ps[LOOM_FA_WARPS][LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int i0 = (int)(bt % tiles) * rows, i = i0 + w;
    const float *qb = q + b * t * dh, *kb = k + b * t * dh, *vb = v + b * t * dv;
    if (i < t)
      for (int c = lane; c < dh; c += 32) qs[w][c] = qb[(i64)i * dh + c];
    float m = -__uint_as_float(0x7f800000u), l = 0, o[LOOM_FA_DMAX / 32] = {0, 0, 0, 0};
    const int kend = t < i0 + (int)rows ? t : i0 + (int)rows;  // keys any row of the tile sees
    for (int j0 = 0; j0 < kend; j0 += LOOM_FA_TILE) {
      __syncthreads();  // the previous tile is no longer read
      loom_fa_load(kt, kb, j0, t, dh);
      loom_fa_load(vt, vb, j0, t, dv);
      __syncthreads();
      if (i >= t || j0 > i) continue;  // the same for the whole warp
      const int j = j0 + (int)lane;
      const float s = j <= i ? scale * loom_fa_dot(qs[w], kt[lane], dh) : -__uint_as_float(0x7f800000u);
      const float mn = fmaxf(m, loom_warp_max(s)), corr = expf(m - mn);
      const float p = j <= i ? expf(s - mn) : 0.0f;
      l = l * corr + loom_warp_sum(p);
      ps[w][lane] = p;
      __syncwarp();
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c >= dv) break;
        float acc = o[r] * corr;
        for (int jj = 0; jj < LOOM_FA_TILE; jj++) acc += ps[w][jj] * vt[jj][c];
        o[r] = acc;
      }
      __syncwarp();  // ps is rewritten by the next tile
      m = mn;
    }
    if (i < t) {
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c < dv) out[(b * t + i) * dv + c] = o[r] / l;
      }
      if (lane == 0) lse[b * t + i] = m + logf(l);
    }
  }
}
LOOM_KERNEL(loom_flash_attn_fwd_f32)

// The backward's first kernel, a warp per query row i: dd[b·t + i] = Σ_c
// dout_ic·out_ic (the softmax backward's row sum) and dq_i = scale·Σ_{j≤i}
// ds_ij·k_j with p_ij = exp(s_ij − lse_i), dp_ij = dout_i·v_j and ds_ij =
// p_ij·(dp_ij − dd_i). Run it before loom_flash_attn_bwd_dkv_f32, which
// reads dd.
extern "C" __global__ void loom_flash_attn_bwd_dq_f32(float *dq, float *dd, const float *dout, const float *out,
                                                      const float *lse, const float *q, const float *k,
                                                      const float *v, i64 batch, int t, int dh, int dv, float scale) {
  __shared__ float kt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], vt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float qs[LOOM_FA_WARPS][LOOM_FA_DMAX], gs[LOOM_FA_WARPS][LOOM_FA_DMAX], ps[LOOM_FA_WARPS][LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int i0 = (int)(bt % tiles) * rows, i = i0 + w;
    const float *kb = k + b * t * dh, *vb = v + b * t * dv;
    float di = 0, li = 0, acc[LOOM_FA_DMAX / 32] = {0, 0, 0, 0};
    if (i < t) {
      const i64 row = b * t + i;
      for (int c = lane; c < dh; c += 32) qs[w][c] = q[row * dh + c];
      float part = 0;
      for (int c = lane; c < dv; c += 32) {
        gs[w][c] = dout[row * dv + c];
        part += dout[row * dv + c] * out[row * dv + c];
      }
      di = loom_warp_sum(part);
      li = lse[row];
      if (lane == 0) dd[row] = di;
    }
    const int kend = t < i0 + (int)rows ? t : i0 + (int)rows;
    for (int j0 = 0; j0 < kend; j0 += LOOM_FA_TILE) {
      __syncthreads();
      loom_fa_load(kt, kb, j0, t, dh);
      loom_fa_load(vt, vb, j0, t, dv);
      __syncthreads();
      if (i >= t || j0 > i) continue;
      const int j = j0 + (int)lane;
      float ds = 0;
      if (j <= i) {
        const float p = expf(scale * loom_fa_dot(qs[w], kt[lane], dh) - li);
        ds = p * (loom_fa_dot(gs[w], vt[lane], dv) - di);
      }
      ps[w][lane] = ds;
      __syncwarp();
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c >= dh) break;
        float a = acc[r];
        for (int jj = 0; jj < LOOM_FA_TILE; jj++) a += ps[w][jj] * kt[jj][c];
        acc[r] = a;
      }
      __syncwarp();
    }
    if (i < t)
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c < dh) dq[(b * t + i) * dh + c] = scale * acc[r];
      }
    __syncthreads();  // qs and gs are rewritten by the next tile
  }
}
LOOM_KERNEL(loom_flash_attn_bwd_dq_f32)

// The backward's second kernel, a warp per key row j: dv_j = Σ_{i≥j}
// p_ij·dout_i and dk_j = scale·Σ_{i≥j} ds_ij·q_i, recomputing p and ds from
// lse and the dd of loom_flash_attn_bwd_dq_f32. No atomics: every output
// row has one writer.
extern "C" __global__ void loom_flash_attn_bwd_dkv_f32(float *dk, float *dv_, const float *dout, const float *lse,
                                                       const float *dd, const float *q, const float *k,
                                                       const float *v, i64 batch, int t, int dh, int dv,
                                                       float scale) {
  __shared__ float qt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], gt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float ks[LOOM_FA_WARPS][LOOM_FA_DMAX], vs[LOOM_FA_WARPS][LOOM_FA_DMAX];
  __shared__ float ps[LOOM_FA_WARPS][LOOM_FA_TILE], dss[LOOM_FA_WARPS][LOOM_FA_TILE];
  __shared__ float lt[LOOM_FA_TILE], dt[LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int j0 = (int)(bt % tiles) * rows, j = j0 + w;
    const float *qb = q + b * t * dh, *gb = dout + b * t * dv;
    if (j < t) {
      for (int c = lane; c < dh; c += 32) ks[w][c] = k[(b * t + j) * dh + c];
      for (int c = lane; c < dv; c += 32) vs[w][c] = v[(b * t + j) * dv + c];
    }
    float ak[LOOM_FA_DMAX / 32] = {0, 0, 0, 0}, av[LOOM_FA_DMAX / 32] = {0, 0, 0, 0};
    // Query tiles from the first that reaches the tile's first key.
    for (int i0 = j0 / LOOM_FA_TILE * LOOM_FA_TILE; i0 < t; i0 += LOOM_FA_TILE) {
      __syncthreads();
      loom_fa_load(qt, qb, i0, t, dh);
      loom_fa_load(gt, gb, i0, t, dv);
      for (int e = threadIdx.x; e < LOOM_FA_TILE; e += blockDim.x) {
        lt[e] = i0 + e < t ? lse[b * t + i0 + e] : 0.0f;
        dt[e] = i0 + e < t ? dd[b * t + i0 + e] : 0.0f;
      }
      __syncthreads();
      if (j >= t) continue;
      const int i = i0 + (int)lane;
      float p = 0, ds = 0;
      if (i >= j && i < t) {
        p = expf(scale * loom_fa_dot(qt[lane], ks[w], dh) - lt[lane]);
        ds = p * (loom_fa_dot(gt[lane], vs[w], dv) - dt[lane]);
      }
      ps[w][lane] = p;
      dss[w][lane] = ds;
      __syncwarp();
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c < dv) {
          float a = av[r];
          for (int ii = 0; ii < LOOM_FA_TILE; ii++) a += ps[w][ii] * gt[ii][c];
          av[r] = a;
        }
        if (c < dh) {
          float a = ak[r];
          for (int ii = 0; ii < LOOM_FA_TILE; ii++) a += dss[w][ii] * qt[ii][c];
          ak[r] = a;
        }
      }
      __syncwarp();
    }
    if (j < t)
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c < dv) dv_[(b * t + j) * dv + c] = av[r];
        if (c < dh) dk[(b * t + j) * dh + c] = scale * ak[r];
      }
    __syncthreads();  // ks and vs are rewritten by the next tile
  }
}
LOOM_KERNEL(loom_flash_attn_bwd_dkv_f32)
