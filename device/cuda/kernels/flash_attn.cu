// Causal flash attention (the fused form of kernels.CausalAttentionForward
// and Backward): per block b of batch (batch and heads flattened) q and k
// are [t, dh] and v and out [t, dv], row-major, blocks back to back;
// scores s_ij = scale·q_i·k_j for j ≤ i. The forward streams keys and
// values through shared memory in tiles of 32 with an online softmax
// (running max and sum), so it never writes the t×t matrix; it saves each
// row's log-sum-exp, from which the backward recomputes the probabilities
// tile by tile. dh, dv ≤ 128. 1-D blocks of 1 to 8 warps, each warp one row
// (a query row, or in the dk/dv kernel a key row), so the rows of a block
// share each K/V (or Q/dO) tile; any grid: blocks stride over (b, row tile)
// pairs. A row tile reads only the key tiles some row of it sees (and the
// dk/dv kernel only the query tiles that see its keys): fully masked tiles
// are skipped, not computed and masked.
//
// Each kernel exists for float32 (_f32) and bfloat16 (_bf16: q, k, v, out,
// dout and the gradients as bit patterns) inputs; the tiles, scores, exps,
// sums and the saved lse are float32 in both, and a bf16 output is rounded
// once at the end. So results differ from the CPU's float64 softmax by
// float32 roundings (and, for bf16, by the one rounding of the output).

#define LOOM_FA_TILE 32
#define LOOM_FA_DMAX 128
#define LOOM_FA_WARPS 8

// Element access for both input types, widening bf16 exactly and rounding
// to nearest even on the way out.
__device__ __forceinline__ float loom_fa_ld(const float *p, i64 i) { return p[i]; }
__device__ __forceinline__ float loom_fa_ld(const unsigned short *p, i64 i) { return loom_bf16_to_f32(p[i]); }
__device__ __forceinline__ void loom_fa_st(float *p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void loom_fa_st(unsigned short *p, i64 i, float v) { p[i] = loom_f32_to_bf16(v); }

// loom_fa_load copies rows [r0, r0+32) of src [t, d] (rows at or past t as
// zeros) into the tile dst of row pitch LOOM_FA_DMAX+1 (the pad keeps
// lanes reading a column each in different banks); every thread of the
// block takes part.
template <typename T>
__device__ __forceinline__ void loom_fa_load(float (*dst)[LOOM_FA_DMAX + 1], const T *src, int r0, int t, int d) {
  for (int e = threadIdx.x; e < LOOM_FA_TILE * d; e += blockDim.x) {
    const int r = e / d, c = e % d;
    dst[r][c] = r0 + r < t ? loom_fa_ld(src, (i64)(r0 + r) * d + c) : 0.0f;
  }
}

// loom_fa_dot returns Σ_c a[c]·b[c] over c < d, in order.
__device__ __forceinline__ float loom_fa_dot(const float *a, const float *b, int d) {
  float s = 0;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// out = softmax(s)·v per row and lse[b·t + i] = log Σ_{j≤i} exp(s_ij).
template <typename T>
__device__ void loom_fa_fwd(T *out, float *lse, const T *q, const T *k, const T *v, i64 batch, int t, int dh, int dv,
                            float scale) {
  __shared__ float kt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], vt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float qs[LOOM_FA_WARPS][LOOM_FA_DMAX], ps[LOOM_FA_WARPS][LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int i0 = (int)(bt % tiles) * rows, i = i0 + w;
    const T *qb = q + b * t * dh, *kb = k + b * t * dh, *vb = v + b * t * dv;
    if (i < t)
      for (int c = lane; c < dh; c += 32) qs[w][c] = loom_fa_ld(qb, (i64)i * dh + c);
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
        if (c < dv) loom_fa_st(out, (b * t + i) * dv + c, o[r] / l);
      }
      if (lane == 0) lse[b * t + i] = m + logf(l);
    }
  }
}

extern "C" __global__ void loom_flash_attn_fwd_f32(float *out, float *lse, const float *q, const float *k,
                                                   const float *v, i64 batch, int t, int dh, int dv, float scale) {
  loom_fa_fwd(out, lse, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_fwd_f32)

extern "C" __global__ void loom_flash_attn_fwd_bf16(unsigned short *out, float *lse, const unsigned short *q,
                                                    const unsigned short *k, const unsigned short *v, i64 batch, int t,
                                                    int dh, int dv, float scale) {
  loom_fa_fwd(out, lse, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_fwd_bf16)

// The backward's first kernel, a warp per query row i: dd[b·t + i] = Σ_c
// dout_ic·out_ic (the softmax backward's row sum) and dq_i = scale·Σ_{j≤i}
// ds_ij·k_j with p_ij = exp(s_ij − lse_i), dp_ij = dout_i·v_j and ds_ij =
// p_ij·(dp_ij − dd_i). Run it before the dk/dv kernel, which reads dd. dq
// may be null (no query gradient): dd alone is written.
template <typename T>
__device__ void loom_fa_bwd_dq(T *dq, float *dd, const T *dout, const T *out, const float *lse, const T *q, const T *k,
                               const T *v, i64 batch, int t, int dh, int dv, float scale) {
  __shared__ float kt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], vt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float qs[LOOM_FA_WARPS][LOOM_FA_DMAX], gs[LOOM_FA_WARPS][LOOM_FA_DMAX], ps[LOOM_FA_WARPS][LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int i0 = (int)(bt % tiles) * rows, i = i0 + w;
    const T *kb = k + b * t * dh, *vb = v + b * t * dv;
    float di = 0, li = 0, acc[LOOM_FA_DMAX / 32] = {0, 0, 0, 0};
    if (i < t) {
      const i64 row = b * t + i;
      for (int c = lane; c < dh; c += 32) qs[w][c] = loom_fa_ld(q, row * dh + c);
      float part = 0;
      for (int c = lane; c < dv; c += 32) {
        const float g = loom_fa_ld(dout, row * dv + c);
        gs[w][c] = g;
        part += g * loom_fa_ld(out, row * dv + c);
      }
      di = loom_warp_sum(part);
      li = lse[row];
      if (lane == 0) dd[row] = di;
    }
    const int kend = dq == 0 ? 0 : t < i0 + (int)rows ? t : i0 + (int)rows;
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
    if (i < t && dq != 0)
      for (int r = 0; r < LOOM_FA_DMAX / 32; r++) {
        const int c = lane + 32 * r;
        if (c < dh) loom_fa_st(dq, (b * t + i) * dh + c, scale * acc[r]);
      }
    __syncthreads();  // qs and gs are rewritten by the next tile
  }
}

extern "C" __global__ void loom_flash_attn_bwd_dq_f32(float *dq, float *dd, const float *dout, const float *out,
                                                      const float *lse, const float *q, const float *k,
                                                      const float *v, i64 batch, int t, int dh, int dv, float scale) {
  loom_fa_bwd_dq(dq, dd, dout, out, lse, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_bwd_dq_f32)

extern "C" __global__ void loom_flash_attn_bwd_dq_bf16(unsigned short *dq, float *dd, const unsigned short *dout,
                                                       const unsigned short *out, const float *lse,
                                                       const unsigned short *q, const unsigned short *k,
                                                       const unsigned short *v, i64 batch, int t, int dh, int dv,
                                                       float scale) {
  loom_fa_bwd_dq(dq, dd, dout, out, lse, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_bwd_dq_bf16)

// The backward's second kernel, a warp per key row j: dv_j = Σ_{i≥j}
// p_ij·dout_i and dk_j = scale·Σ_{i≥j} ds_ij·q_i, recomputing p and ds from
// lse and the dd of the dq kernel. No atomics: every output row has one
// writer. dk or dv may be null (not wanted).
template <typename T>
__device__ void loom_fa_bwd_dkv(T *dk, T *dv_, const T *dout, const float *lse, const float *dd, const T *q,
                                const T *k, const T *v, i64 batch, int t, int dh, int dv, float scale) {
  __shared__ float qt[LOOM_FA_TILE][LOOM_FA_DMAX + 1], gt[LOOM_FA_TILE][LOOM_FA_DMAX + 1];
  __shared__ float ks[LOOM_FA_WARPS][LOOM_FA_DMAX], vs[LOOM_FA_WARPS][LOOM_FA_DMAX];
  __shared__ float ps[LOOM_FA_WARPS][LOOM_FA_TILE], dss[LOOM_FA_WARPS][LOOM_FA_TILE];
  __shared__ float lt[LOOM_FA_TILE], dt[LOOM_FA_TILE];
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, rows = blockDim.x >> 5;
  const i64 tiles = (t + rows - 1) / rows;
  for (i64 bt = blockIdx.x; bt < batch * tiles; bt += gridDim.x) {
    const i64 b = bt / tiles;
    const int j0 = (int)(bt % tiles) * rows, j = j0 + w;
    const T *qb = q + b * t * dh, *gb = dout + b * t * dv;
    if (j < t) {
      for (int c = lane; c < dh; c += 32) ks[w][c] = loom_fa_ld(k, (b * t + j) * dh + c);
      for (int c = lane; c < dv; c += 32) vs[w][c] = loom_fa_ld(v, (b * t + j) * dv + c);
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
        if (c < dv && dv_ != 0) loom_fa_st(dv_, (b * t + j) * dv + c, av[r]);
        if (c < dh && dk != 0) loom_fa_st(dk, (b * t + j) * dh + c, scale * ak[r]);
      }
    __syncthreads();  // ks and vs are rewritten by the next tile
  }
}

extern "C" __global__ void loom_flash_attn_bwd_dkv_f32(float *dk, float *dv_, const float *dout, const float *lse,
                                                       const float *dd, const float *q, const float *k,
                                                       const float *v, i64 batch, int t, int dh, int dv,
                                                       float scale) {
  loom_fa_bwd_dkv(dk, dv_, dout, lse, dd, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_bwd_dkv_f32)

extern "C" __global__ void loom_flash_attn_bwd_dkv_bf16(unsigned short *dk, unsigned short *dv_,
                                                        const unsigned short *dout, const float *lse, const float *dd,
                                                        const unsigned short *q, const unsigned short *k,
                                                        const unsigned short *v, i64 batch, int t, int dh, int dv,
                                                        float scale) {
  loom_fa_bwd_dkv(dk, dv_, dout, lse, dd, q, k, v, batch, t, dh, dv, scale);
}
LOOM_KERNEL(loom_flash_attn_bwd_dkv_bf16)
