// Layout kernels (1-D blocks, any grid): the device forms of placement's
// copyBox and of kernels.NarrowDim, PadDim, ConcatDim, PermuteDims,
// BroadcastDims, SumDims and FillRows. Shapes of up to 6 dims are passed as
// scalar arguments (six sizes, six strides), which the launch path packs
// like any other, so no launch needs a shape array in device memory.
// Copies are bit-exact.

// loom_nd_offset returns the offset Σ idx_d·st_d of the row-major index i of
// a box of nd ≤ 6 dims n (the last dim fastest).
__device__ __forceinline__ i64 loom_nd_offset(i64 i, int nd, const i64 *n, const i64 *st) {
  i64 off = 0;
  for (int d = nd - 1; d >= 0; d--) {
    off += (i % n[d]) * st[d];
    i /= n[d];
  }
  return off;
}

// loom_nd_count returns Π n[0..nd), 1 for nd = 0 (a scalar).
__device__ __forceinline__ i64 loom_nd_count(int nd, const i64 *n) {
  i64 c = 1;
  for (int d = 0; d < nd; d++) c *= n[d];
  return c;
}

// Copies the box of nd ≤ 6 dims of sizes n0..n5 (unused dims: any value)
// from src to dst: element idx of the box is read at src + Σ idx_d·ss_d and
// written at dst + Σ idx_d·ds_d. With the strides of two row-major arrays
// and the box's offsets folded into the pointers it is placement's
// copyBox (and NarrowDim, PadDim after a fill, ConcatDim, one call per
// part); a permuted source stride order is PermuteDims; a source stride 0
// repeats a value, which is BroadcastDims. dst's offsets must be distinct
// (no stride 0 there) and must not overlap src's.
extern "C" __global__ void loom_copy_box_f32(float *dst, const float *src, int nd, i64 n0, i64 n1, i64 n2, i64 n3,
                                             i64 n4, i64 n5, i64 ds0, i64 ds1, i64 ds2, i64 ds3, i64 ds4, i64 ds5,
                                             i64 ss0, i64 ss1, i64 ss2, i64 ss3, i64 ss4, i64 ss5) {
  const i64 n[6] = {n0, n1, n2, n3, n4, n5}, ds[6] = {ds0, ds1, ds2, ds3, ds4, ds5},
            ss[6] = {ss0, ss1, ss2, ss3, ss4, ss5};
  LOOM_FOR(i, loom_nd_count(nd, n)) dst[loom_nd_offset(i, nd, n, ds)] = src[loom_nd_offset(i, nd, n, ss)];
}
LOOM_KERNEL(loom_copy_box_f32)

// out = x of shape s0..s(nd−1) (row-major, nd ≤ 6) with its dims reordered:
// out's dim i is x's dim p_i (kernels.PermuteDims). out is written in
// order, so the writes coalesce and the reads gather.
extern "C" __global__ void loom_permute_nd_f32(float *out, const float *x, int nd, i64 s0, i64 s1, i64 s2, i64 s3,
                                               i64 s4, i64 s5, int p0, int p1, int p2, int p3, int p4, int p5) {
  const i64 s[6] = {s0, s1, s2, s3, s4, s5};
  const int p[6] = {p0, p1, p2, p3, p4, p5};
  i64 in[6], on[6], st[6];
  i64 stride = 1;
  for (int d = nd - 1; d >= 0; d--) {
    in[d] = stride;
    stride *= s[d];
  }
  for (int d = 0; d < nd; d++) {
    on[d] = s[p[d]];
    st[d] = in[p[d]];
  }
  LOOM_FOR(i, loom_nd_count(nd, on)) out[i] = x[loom_nd_offset(i, nd, on, st)];
}
LOOM_KERNEL(loom_permute_nd_f32)

// out = the sum of x (row-major, shape s0..s(nd−1), nd ≤ 6) over the dims
// whose bit is set in the mask reduce, laid out row-major over the others
// (kernels.SumDims). One warp per output element (1-D blocks of whole
// warps), its lanes splitting the reduced elements; double accumulation.
extern "C" __global__ void loom_sum_dims_f32(float *out, const float *x, int nd, i64 s0, i64 s1, i64 s2, i64 s3,
                                             i64 s4, i64 s5, int reduce) {
  const i64 s[6] = {s0, s1, s2, s3, s4, s5};
  // The kept dims' sizes and x's strides on them, then the reduced dims'.
  i64 kn[6], kst[6], rn[6], rst[6];
  int nk = 0, nr = 0;
  i64 stride = 1;
  for (int d = nd - 1; d >= 0; d--) {
    if (reduce >> d & 1) {
      rn[nr] = s[d];
      rst[nr++] = stride;
    } else {
      kn[nk] = s[d];
      kst[nk++] = stride;
    }
    stride *= s[d];
  }
  // Collected last dim first: reverse into row-major order.
  for (int a = 0, b = nk - 1; a < b; a++, b--) {
    i64 t = kn[a]; kn[a] = kn[b]; kn[b] = t;
    t = kst[a]; kst[a] = kst[b]; kst[b] = t;
  }
  for (int a = 0, b = nr - 1; a < b; a++, b--) {
    i64 t = rn[a]; rn[a] = rn[b]; rn[b] = t;
    t = rst[a]; rst[a] = rst[b]; rst[b] = t;
  }
  const i64 kept = loom_nd_count(nk, kn), red = loom_nd_count(nr, rn);
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  // o is the same for the whole warp, so all its lanes meet the shuffles.
  for (i64 o = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; o < kept; o += warps) {
    const i64 base = loom_nd_offset(o, nk, kn, kst);
    double acc = 0;
    for (i64 j = lane; j < red; j += 32) acc += (double)x[base + loom_nd_offset(j, nr, rn, rst)];
    acc = loom_warp_sum(acc);
    if (lane == 0) out[o] = (float)acc;
  }
}
LOOM_KERNEL(loom_sum_dims_f32)

// Every row of out (rows of n) becomes row (kernels.FillRows: Linear's bias
// broadcast, which a GEMM with beta = 1 then adds into).
extern "C" __global__ void loom_fill_rows_f32(float *out, const float *row, i64 rows, i64 n) {
  LOOM_FOR(i, rows * n) out[i] = row[i % n];
}
LOOM_KERNEL(loom_fill_rows_f32)
