// Embedding lookup and its gradient (autograd's embedFwd and embedBwd) for
// a table block holding rows [lo, lo+vl) of d columns, as a vocab-parallel
// rank holds: 1-D blocks, any grid.

// Row i of out becomes table row ids[i] − lo, or zeros when ids[i] is not
// in [lo, lo+vl) (another rank's row). Bit-exact copies.
extern "C" __global__ void loom_embedding_fwd_f32(float *out, const float *table, const i64 *ids, i64 nids, i64 lo,
                                                  i64 vl, i64 d) {
  LOOM_FOR(k, nids * d) {
    const i64 i = k / d, r = ids[i] - lo;
    out[k] = r >= 0 && r < vl ? table[r * d + k % d] : 0.0f;
  }
}
LOOM_KERNEL(loom_embedding_fwd_f32)

// dtable[ids[i] − lo] += g[i] for the ids in [lo, lo+vl), by float32
// atomicAdd: dtable must be zeroed first (loom_fill_f32). Repeated ids add
// in the order the threads run, so the result varies in its last bits.
extern "C" __global__ void loom_embedding_bwd_f32(float *dtable, const float *g, const i64 *ids, i64 nids, i64 lo,
                                                  i64 vl, i64 d) {
  LOOM_FOR(k, nids * d) {
    const i64 i = k / d, r = ids[i] - lo;
    if (r >= 0 && r < vl) atomicAdd(dtable + r * d + k % d, g[k]);
  }
}
LOOM_KERNEL(loom_embedding_bwd_f32)
