// loom.cuh: the prelude of every loom kernel source. Package cuda prepends
// it to each kernels/*.cu (KernelFile.Source), so the sources include no
// header and NVRTC needs no CUDA toolkit headers; the emulator
// (testdata/loom_emu.h) defines the CUDA built-ins and LOOM_KERNEL before
// it, so the same text also compiles as C++ on the CPU.
//
// Conventions of the kernels: every kernel is extern "C" (its name needs no
// lowering) and followed by LOOM_KERNEL(name); sizes and indices are i64;
// loops are grid-stride, so any grid covers any size; bfloat16 values are
// their bit patterns in unsigned short; sums accumulate in double where
// package kernels' CPU code does, since these kernels are memory bound.

// The emulator compiles every file's Source in one translation unit.
#ifndef LOOM_CUH
#define LOOM_CUH

typedef long long i64;

#ifndef LOOM_KERNEL
// Under NVRTC the marker is empty; the emulator registers the kernel.
#define LOOM_KERNEL(name)
#endif

#ifndef LOOM_DYN_SMEM
// name points at the launch's dynamic shared memory (sharedMemBytes),
// 8-byte aligned.
#define LOOM_DYN_SMEM(T, name)                        \
  extern __shared__ unsigned long long loom_dyn_smem[]; \
  T *name = reinterpret_cast<T *>(loom_dyn_smem)
#endif

// LOOM_FOR(i, n) visits i = 0..n−1, strided over every thread of the grid
// (1-D blocks).
#define LOOM_FOR(i, n) \
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)

// loom_f32_to_bf16 rounds f to bfloat16, to nearest with ties to even; a NaN
// stays a NaN with its quiet bit set (internal/half.ToBFloat16, bit for bit).
__device__ __forceinline__ unsigned short loom_f32_to_bf16(float f) {
  unsigned b = __float_as_uint(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);
  return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// loom_bf16_to_f32 widens a bfloat16 exactly.
__device__ __forceinline__ float loom_bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// loom_warp_sum returns the sum of v over the 32 lanes of the warp, to every
// lane (butterfly: every lane adds the same values in the same order).
template <typename T>
__device__ __forceinline__ T loom_warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// loom_warp_max returns the maximum of v over the warp, to every lane.
__device__ __forceinline__ float loom_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// loom_block_sum returns the sum of v over a 1-D block of whole warps, to
// every thread; buf is __shared__ scratch of 32 values. Every thread of the
// block must call it.
template <typename T>
__device__ __forceinline__ T loom_block_sum(T v, T *buf) {
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = loom_warp_sum(v);
  __syncthreads();  // buf may still be read by a previous call
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  return loom_warp_sum(lane < warps ? buf[lane] : T(0));
}

#endif  // LOOM_CUH
