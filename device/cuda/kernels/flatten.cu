// Bucket flattening (the DDP gradient buckets, parallel/ddp.go fill, and
// FSDP's staging copies, parallel/fsdp_gather.go toStage/fromStage): copy a
// list of float32 buffers into one flat buffer and back, in one launch, with
// an optional scale and an optional float32↔bfloat16 cast. The list is a
// table in device memory of nbuf triples (i64): the buffer's device
// address, its element offset in the flat buffer and its length; buffers
// may sit anywhere in the flat buffer (gaps are not touched) but must not
// overlap. 2-D grids: the y blocks split the buffers, the x blocks and
// threads each buffer's elements; any grid. The scale multiplies as
// kernels do (one float32 product, __fmul_rn), and 1 copies bit for bit.

// loom_scaled returns v·scale, or v itself when scale is 1 (a NaN's
// payload survives, as a copy keeps it).
__device__ __forceinline__ float loom_scaled(float v, float scale) { return scale == 1.0f ? v : __fmul_rn(v, scale); }

// flat[off_b + i] = scale·buf_b[i] for every buffer b of the table; flat is
// float32, or bfloat16 (rounded to nearest even after the scale) when bf16
// is not 0.
extern "C" __global__ void loom_flatten_f32(void *flat, const i64 *table, int nbuf, int bf16, float scale) {
  for (int b = blockIdx.y; b < nbuf; b += gridDim.y) {
    const float *src = reinterpret_cast<const float *>(table[3 * b]);
    const i64 off = table[3 * b + 1], n = table[3 * b + 2];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
      const float v = loom_scaled(src[i], scale);
      if (bf16)
        static_cast<unsigned short *>(flat)[off + i] = loom_f32_to_bf16(v);
      else
        static_cast<float *>(flat)[off + i] = v;
    }
  }
}
LOOM_KERNEL(loom_flatten_f32)

// buf_b[i] = scale·flat[off_b + i] for every buffer b of the table, flat
// being float32, or bfloat16 (widened exactly, then scaled) when bf16 is
// not 0.
extern "C" __global__ void loom_unflatten_f32(const void *flat, const i64 *table, int nbuf, int bf16, float scale) {
  for (int b = blockIdx.y; b < nbuf; b += gridDim.y) {
    float *dst = reinterpret_cast<float *>(table[3 * b]);
    const i64 off = table[3 * b + 1], n = table[3 * b + 2];
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
      const float v = bf16 ? loom_bf16_to_f32(static_cast<const unsigned short *>(flat)[off + i])
                           : static_cast<const float *>(flat)[off + i];
      dst[i] = loom_scaled(v, scale);
    }
  }
}
LOOM_KERNEL(loom_unflatten_f32)
