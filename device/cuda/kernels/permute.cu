// loom MoE permute kernels, compiled at run time by NVRTC after the
// prelude loom.cuh, like every kernel source (Source, KernelFile.Source).
//
// Rows are processed by 2-D blocks: threadIdx.x walks the elements (or
// 16-byte words) of a row, threadIdx.y picks one of blockDim.y rows, and
// the grid strides over rows; the gate gradient instead gives each slot a
// warp of a 1-D block. Index maps are int32; -1 marks a pad row or a dead
// slot, exactly as in package kernels' Routing.

// Raw words for the dtype-agnostic row copies: a row of B bytes moves as
// B/16, B/8, B/4 or B words.
struct alignas(16) loom_w16 {
  unsigned long long a, b;
};
typedef unsigned long long loom_w8;
typedef unsigned int loom_w4;
typedef unsigned char loom_w1;

// Row r of dst becomes row idx[r]/div of src, or zeros when idx[r] < 0.
// Permute is idx = RowSlot, div = K; PermuteSlots is div = 1 with
// RowSlot; UnpermuteSlots is div = 1 with SlotRow; the rank/expert chunk
// regrouping is div = 1 with a host-built row map.
template <typename W>
__device__ __forceinline__ void loom_gather(W *__restrict__ dst, const W *__restrict__ src,
                                            const int *__restrict__ idx, int div, i64 rows, i64 words) {
  for (i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.x * blockDim.y) {
    int s = idx[r];
    W *o = dst + r * words;
    if (s < 0) {
      W z{};
      for (i64 i = threadIdx.x; i < words; i += blockDim.x) o[i] = z;
      continue;
    }
    const W *in = src + (i64)(s / div) * words;
    for (i64 i = threadIdx.x; i < words; i += blockDim.x) o[i] = in[i];
  }
}

// V elements of T moved as one load or store: a float4 or double2 where a
// row's width and its pointers allow 16-byte accesses (V = 16/sizeof(T)),
// else the element itself (V = 1).
template <typename T, int V>
struct alignas(sizeof(T) * V) loom_vec {
  T v[V];
};

// Row t of out becomes sum_j gate[t*k+j] * packed[slotRow[t*k+j]] over the
// live slots, in slot order (zero when none is live); gates == 0 weights
// every slot by 1. d is a multiple of V.
template <typename T, int V>
__device__ __forceinline__ void loom_unpermute(T *__restrict__ out, const T *__restrict__ packed,
                                               const T *__restrict__ gates, const int *__restrict__ slotRow,
                                               int k, i64 tokens, i64 d) {
  typedef loom_vec<T, V> Vec;
  const i64 words = d / V;
  const Vec *in = (const Vec *)packed;
  for (i64 t = (i64)blockIdx.x * blockDim.y + threadIdx.y; t < tokens; t += (i64)gridDim.x * blockDim.y) {
    const int *sr = slotRow + t * k;
    Vec *o = (Vec *)out + t * words;
    for (i64 i = threadIdx.x; i < words; i += blockDim.x) {
      Vec acc;
      for (int c = 0; c < V; ++c) acc.v[c] = T(0);
      for (int j = 0; j < k; ++j) {
        int p = sr[j];
        if (p >= 0) {
          T g = gates ? gates[t * k + j] : T(1);
          Vec x = in[(i64)p * words + i];
          for (int c = 0; c < V; ++c) acc.v[c] += g * x.v[c];
        }
      }
      o[i] = acc;
    }
  }
}

// Packed row r of dpacked becomes gates[s] * dout[s/k] for s = rowSlot[r],
// or zeros for a pad row; gates == 0 weights by 1. d is a multiple of V.
template <typename T, int V>
__device__ __forceinline__ void loom_scale_gather(T *__restrict__ dpacked, const T *__restrict__ dout,
                                                  const T *__restrict__ gates, const int *__restrict__ rowSlot,
                                                  int k, i64 rows, i64 d) {
  typedef loom_vec<T, V> Vec;
  const i64 words = d / V;
  for (i64 r = (i64)blockIdx.x * blockDim.y + threadIdx.y; r < rows; r += (i64)gridDim.x * blockDim.y) {
    int s = rowSlot[r];
    Vec *o = (Vec *)dpacked + r * words;
    if (s < 0) {
      Vec z{};
      for (i64 i = threadIdx.x; i < words; i += blockDim.x) o[i] = z;
      continue;
    }
    T g = gates ? gates[s] : T(1);
    const Vec *in = (const Vec *)dout + (i64)(s / k) * words;
    for (i64 i = threadIdx.x; i < words; i += blockDim.x) {
      Vec x = in[i];
      for (int c = 0; c < V; ++c) x.v[c] *= g;
      o[i] = x;
    }
  }
}

// dgates[s] becomes <packed[slotRow[s]], dout[s/k]>, accumulated in
// double, or 0 for a dead slot. One warp per slot (1-D blocks of whole
// warps): each lane sums a strided part of the row, then the warp adds
// the lanes' sums by shuffles. Every lane of a warp takes the same slots,
// so the full-mask shuffles always meet. d is a multiple of V.
template <typename T, int V>
__device__ __forceinline__ void loom_gate_grad(T *__restrict__ dgates, const T *__restrict__ packed,
                                               const T *__restrict__ dout, const int *__restrict__ slotRow,
                                               int k, i64 slots, i64 d) {
  typedef loom_vec<T, V> Vec;
  const i64 words = d / V;
  const unsigned lane = threadIdx.x & 31u;
  const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 s = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; s < slots; s += warps) {
    int p = slotRow[s];
    double acc = 0.0;
    if (p >= 0) {
      const Vec *a = (const Vec *)packed + (i64)p * words;
      const Vec *b = (const Vec *)dout + (s / k) * words;
      for (i64 i = lane; i < words; i += 32) {
        Vec x = a[i], y = b[i];
        for (int c = 0; c < V; ++c) acc += (double)x.v[c] * (double)y.v[c];
      }
    }
    for (unsigned off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) dgates[s] = (T)acc;
  }
}

// The row gathers, by the size of the word they copy.
extern "C" __global__ void loom_gather_w16(void *dst, const void *src, const int *idx, int div, i64 rows, i64 words) {
  loom_gather<loom_w16>((loom_w16 *)dst, (const loom_w16 *)src, idx, div, rows, words);
}
LOOM_KERNEL(loom_gather_w16)
extern "C" __global__ void loom_gather_w8(void *dst, const void *src, const int *idx, int div, i64 rows, i64 words) {
  loom_gather<loom_w8>((loom_w8 *)dst, (const loom_w8 *)src, idx, div, rows, words);
}
LOOM_KERNEL(loom_gather_w8)
extern "C" __global__ void loom_gather_w4(void *dst, const void *src, const int *idx, int div, i64 rows, i64 words) {
  loom_gather<loom_w4>((loom_w4 *)dst, (const loom_w4 *)src, idx, div, rows, words);
}
LOOM_KERNEL(loom_gather_w4)
extern "C" __global__ void loom_gather_w1(void *dst, const void *src, const int *idx, int div, i64 rows, i64 words) {
  loom_gather<loom_w1>((loom_w1 *)dst, (const loom_w1 *)src, idx, div, rows, words);
}
LOOM_KERNEL(loom_gather_w1)

// Each typed kernel is defined for an element type and a vector width:
// the suffix is f32 and f64 (V = 1), f32x4 and f64x2 (16-byte accesses).
extern "C" __global__ void loom_unpermute_f32(
    float *out, const float *packed, const float *gates, const int *slotRow, int k, i64 tokens, i64 d) {
  loom_unpermute<float, 1>(out, packed, gates, slotRow, k, tokens, d);
}
LOOM_KERNEL(loom_unpermute_f32)
extern "C" __global__ void loom_unpermute_f32x4(
    float *out, const float *packed, const float *gates, const int *slotRow, int k, i64 tokens, i64 d) {
  loom_unpermute<float, 4>(out, packed, gates, slotRow, k, tokens, d);
}
LOOM_KERNEL(loom_unpermute_f32x4)
extern "C" __global__ void loom_unpermute_f64(
    double *out, const double *packed, const double *gates, const int *slotRow, int k, i64 tokens, i64 d) {
  loom_unpermute<double, 1>(out, packed, gates, slotRow, k, tokens, d);
}
LOOM_KERNEL(loom_unpermute_f64)
extern "C" __global__ void loom_unpermute_f64x2(
    double *out, const double *packed, const double *gates, const int *slotRow, int k, i64 tokens, i64 d) {
  loom_unpermute<double, 2>(out, packed, gates, slotRow, k, tokens, d);
}
LOOM_KERNEL(loom_unpermute_f64x2)
extern "C" __global__ void loom_scale_gather_f32(
    float *dpacked, const float *dout, const float *gates, const int *rowSlot, int k, i64 rows, i64 d) {
  loom_scale_gather<float, 1>(dpacked, dout, gates, rowSlot, k, rows, d);
}
LOOM_KERNEL(loom_scale_gather_f32)
extern "C" __global__ void loom_scale_gather_f32x4(
    float *dpacked, const float *dout, const float *gates, const int *rowSlot, int k, i64 rows, i64 d) {
  loom_scale_gather<float, 4>(dpacked, dout, gates, rowSlot, k, rows, d);
}
LOOM_KERNEL(loom_scale_gather_f32x4)
extern "C" __global__ void loom_scale_gather_f64(
    double *dpacked, const double *dout, const double *gates, const int *rowSlot, int k, i64 rows, i64 d) {
  loom_scale_gather<double, 1>(dpacked, dout, gates, rowSlot, k, rows, d);
}
LOOM_KERNEL(loom_scale_gather_f64)
extern "C" __global__ void loom_scale_gather_f64x2(
    double *dpacked, const double *dout, const double *gates, const int *rowSlot, int k, i64 rows, i64 d) {
  loom_scale_gather<double, 2>(dpacked, dout, gates, rowSlot, k, rows, d);
}
LOOM_KERNEL(loom_scale_gather_f64x2)
extern "C" __global__ void loom_gate_grad_f32(
    float *dgates, const float *packed, const float *dout, const int *slotRow, int k, i64 slots, i64 d) {
  loom_gate_grad<float, 1>(dgates, packed, dout, slotRow, k, slots, d);
}
LOOM_KERNEL(loom_gate_grad_f32)
extern "C" __global__ void loom_gate_grad_f32x4(
    float *dgates, const float *packed, const float *dout, const int *slotRow, int k, i64 slots, i64 d) {
  loom_gate_grad<float, 4>(dgates, packed, dout, slotRow, k, slots, d);
}
LOOM_KERNEL(loom_gate_grad_f32x4)
extern "C" __global__ void loom_gate_grad_f64(
    double *dgates, const double *packed, const double *dout, const int *slotRow, int k, i64 slots, i64 d) {
  loom_gate_grad<double, 1>(dgates, packed, dout, slotRow, k, slots, d);
}
LOOM_KERNEL(loom_gate_grad_f64)
extern "C" __global__ void loom_gate_grad_f64x2(
    double *dgates, const double *packed, const double *dout, const int *slotRow, int k, i64 slots, i64 d) {
  loom_gate_grad<double, 2>(dgates, packed, dout, slotRow, k, slots, d);
}
LOOM_KERNEL(loom_gate_grad_f64x2)
