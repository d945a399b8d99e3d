// loom_emu.h: runs loom's CUDA kernel sources on the CPU, for tests on
// machines without a GPU. The test (emu_kernels_test.go) compiles one
// translation unit with g++ -std=c++20:
//
//	#include "loom_emu.h"
//	<the text of cuda.KernelSource(file) for every kernel file>
//
// into a shared library and calls loom_emu_launch through purego, with Go
// slices as "device" memory.
//
// Model. The blocks of a launch run one after another on the calling OS
// thread; the threads of a block are ucontext fibers, each run until it
// ends or reaches a barrier, so __syncthreads and the warp primitives have
// the GPU's semantics rather than a sequential approximation: a block
// barrier releases when every thread of the block has arrived, a warp
// barrier when all 32 lanes have, and a shuffle returns the value its
// source lane published at the same shuffle. Since a fiber gives up the
// CPU only at a barrier, atomics are plain read-modify-writes, and
// __shared__ variables are function statics: one block at a time uses them.
// A barrier that cannot release (threads of the block ended while others
// wait, lanes of a warp at different barriers, a partial mask or warp)
// stops the launch with an error naming the kernel, where a GPU would hang
// or compute garbage.
#pragma once

#include <ucontext.h>
#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef dim3 uint3;

static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;
static const int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// One block runs at a time and its fibers share the statics.
#define __shared__ static

// The dynamic shared memory of the running launch (sharedMemBytes).
namespace loom_emu {
void *dyn_smem();
}
#define LOOM_DYN_SMEM(T, name) T *name = (T *)loom_emu::dyn_smem()

// Bit casts and correctly rounded arithmetic, as the CUDA intrinsics.
static inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline double __longlong_as_double(long long u) {
  double f;
  std::memcpy(&f, &u, 8);
  return f;
}
// volatile keeps g++ from contracting these into fused multiply-adds, as
// the _rn intrinsics keep NVRTC from doing.
static inline float __fmul_rn(float a, float b) {
  volatile float r = a * b;
  return r;
}
static inline float __fadd_rn(float a, float b) {
  volatile float r = a + b;
  return r;
}
static inline float __fsub_rn(float a, float b) {
  volatile float r = a - b;
  return r;
}
static inline float __fdiv_rn(float a, float b) {
  volatile float r = a / b;
  return r;
}
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }
template <typename T>
static inline T __ldg(const T *p) {
  return *p;
}

// Fibers switch only at barriers, so read-modify-writes are atomic.
template <typename T>
static inline T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
static inline int atomicMax(int *p, int v) {
  int old = *p;
  if (v > old) *p = v;
  return old;
}
static inline unsigned long long atomicMin(unsigned long long *p, unsigned long long v) {
  unsigned long long old = *p;
  if (v < old) *p = v;
  return old;
}

namespace loom_emu {

enum state { runnable, at_block, at_warp, done };

// A fiber: one GPU thread of the running block.
struct fiber {
  ucontext_t ctx;
  uint3 idx;
  state st = runnable;
  unsigned long long val = 0;  // value published at a warp barrier
  unsigned src = 0;            // lane whose value it reads back
  unsigned long long got = 0;  // value read back at release
  int tag = 0;                 // which warp operation it waits in
};

struct launch_state {
  const char *kernel = "";
  void (*thread)(void **) = nullptr;
  void **params = nullptr;
  std::vector<fiber> fibers;
  fiber *cur = nullptr;
  ucontext_t sched;
  std::vector<unsigned char> smem;
  std::string err;
};

static launch_state L;
static std::mutex launch_mu;            // one launch at a time: statics are shared
static const size_t stack_bytes = 64 << 10;
static unsigned char *stacks = nullptr;  // 1024 stacks, mapped once

inline void *dyn_smem() { return L.smem.empty() ? nullptr : L.smem.data(); }

// The values a thread needs while its fiber runs.
inline void enter(fiber *f) {
  L.cur = f;
  threadIdx = f->idx;
}

// yield suspends the running fiber in state s and returns when the
// scheduler resumes it.
inline void yield(state s) {
  fiber *f = L.cur;
  f->st = s;
  // Other fibers read and write shared memory while this one waits: a
  // __shared__ static whose address never escapes could be assumed
  // untouched by the call, so make the barrier a compiler memory barrier
  // too, as __syncthreads is under NVRTC.
  asm volatile("" ::: "memory");
  swapcontext(&f->ctx, &L.sched);
  asm volatile("" ::: "memory");
  enter(f);
}

inline unsigned lane_of(const fiber *f) {
  unsigned lin = f->idx.x + blockDim.x * (f->idx.y + blockDim.y * f->idx.z);
  return lin & 31u;
}

// warp_op publishes v, waits for the other 31 lanes and returns lane src's
// value (v itself when src is out of range: the CUDA rule for shuffles).
template <typename V>
inline V warp_op(unsigned mask, V v, unsigned src, int tag) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable_v<V>);
  fiber *f = L.cur;
  if (mask != 0xffffffffu) {
    if (L.err.empty()) L.err = "a warp operation with a partial mask";
    yield(done);  // never resumed: the launch fails
  }
  unsigned long long u = 0;
  std::memcpy(&u, &v, sizeof v);
  f->val = u;
  f->src = src;
  f->tag = tag;
  yield(at_warp);
  V r;
  std::memcpy(&r, &f->got, sizeof r);
  return r;
}

inline void fiber_main() {
  L.thread(L.params);
  L.cur->st = done;
  swapcontext(&L.cur->ctx, &L.sched);
  std::abort();  // an ended fiber resumed: a bug of this file, never silent
}

// release_warps frees every warp whose 32 lanes wait at the same warp
// operation and reports whether it freed any; a warp whose lanes wait at
// different operations, or are partly ended, is an error.
inline bool release_warps() {
  bool any = false;
  size_t n = L.fibers.size();
  for (size_t w = 0; w < n; w += 32) {
    size_t end = w + 32 < n ? w + 32 : n;
    size_t waiting = 0;
    for (size_t i = w; i < end; i++)
      if (L.fibers[i].st == at_warp) waiting++;
    if (waiting == 0) continue;
    if (end - w != 32) {
      L.err = "a warp operation in a warp of " + std::to_string(end - w) + " threads (blocks must be whole warps)";
      return false;
    }
    if (waiting != 32) continue;
    int tag = L.fibers[w].tag;
    for (size_t i = w; i < end; i++)
      if (L.fibers[i].tag != tag) {
        L.err = "lanes of a warp wait at different warp operations";
        return false;
      }
    for (size_t i = w; i < end; i++) {
      fiber &f = L.fibers[i];
      f.got = f.src < 32 ? L.fibers[w + f.src].val : f.val;
      f.st = runnable;
    }
    any = true;
  }
  return any;
}

// run_block runs the fibers of one block to their end.
inline bool run_block() {
  for (;;) {
    bool ran = false;
    for (fiber &f : L.fibers) {
      if (f.st != runnable) continue;
      ran = true;
      enter(&f);
      swapcontext(&L.sched, &f.ctx);
      if (!L.err.empty()) return false;
    }
    if (ran) continue;
    size_t ended = 0, atBlock = 0;
    for (fiber &f : L.fibers) {
      ended += f.st == done;
      atBlock += f.st == at_block;
    }
    if (ended == L.fibers.size()) return true;
    if (release_warps()) continue;
    if (!L.err.empty()) return false;
    if (atBlock + ended == L.fibers.size() && ended == 0) {
      for (fiber &f : L.fibers)
        if (f.st == at_block) f.st = runnable;
      continue;
    }
    L.err = "a divergent barrier: " + std::to_string(atBlock) + " threads wait in __syncthreads, " +
            std::to_string(ended) + " have ended, " + std::to_string(L.fibers.size() - ended - atBlock) +
            " wait in warp operations";
    return false;
  }
}

// Registered kernels: a thunk that unpacks cuLaunchKernel's void**
// argument array by the kernel's C signature, and the argument count.
struct kernel {
  void (*thread)(void **);
  int nargs;
};
inline std::map<std::string, kernel> &registry() {
  static std::map<std::string, kernel> r;
  return r;
}

template <auto F>
struct thunk;
template <typename... A, void (*F)(A...)>
struct thunk<F> {
  template <size_t... I>
  static void call(void **p, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<A> *>(p[I])...);
  }
  static void run(void **p) { call(p, std::index_sequence_for<A...>{}); }
  static constexpr int nargs = sizeof...(A);
};

struct registrar {
  registrar(const char *name, void (*thread)(void **), int nargs) { registry()[name] = {thread, nargs}; }
};

}  // namespace loom_emu

#define LOOM_KERNEL(name) \
  static loom_emu::registrar loom_emu_reg_##name(#name, loom_emu::thunk<&name>::run, loom_emu::thunk<&name>::nargs);

// Warp primitives (width 32).
template <typename V>
static inline V __shfl_down_sync(unsigned mask, V v, unsigned delta) {
  unsigned lane = loom_emu::lane_of(loom_emu::L.cur);
  return loom_emu::warp_op(mask, v, lane + delta, 1);
}
template <typename V>
static inline V __shfl_xor_sync(unsigned mask, V v, unsigned m) {
  unsigned lane = loom_emu::lane_of(loom_emu::L.cur);
  return loom_emu::warp_op(mask, v, lane ^ m, 2);
}
static inline void __syncwarp(unsigned mask = 0xffffffffu) { loom_emu::warp_op(mask, 0, 32, 3); }
static inline void __syncthreads() { loom_emu::yield(loom_emu::at_block); }

// Results of loom_emu_launch.
enum {
  LOOM_EMU_OK = 0,
  LOOM_EMU_NO_KERNEL = 1,    // no kernel of that name is registered
  LOOM_EMU_BAD_NARGS = 2,    // the argument count is not the kernel's
  LOOM_EMU_BAD_GEOMETRY = 3, // a zero or too large grid or block
  LOOM_EMU_FAILED = 4,       // a barrier that cannot release (loom_emu_error says which)
};

extern "C" {

// loom_emu_error returns the message of the last failed launch.
const char *loom_emu_error() { return loom_emu::L.err.c_str(); }

// loom_emu_has reports whether a kernel of that name is registered.
int loom_emu_has(const char *name) { return loom_emu::registry().count(name) ? 1 : 0; }

// loom_emu_launch runs kernel name over the grid, with sharedMemBytes of
// dynamic shared memory and args as cuLaunchKernel's kernelParams (nargs
// of them), and returns one of the LOOM_EMU_ codes.
int loom_emu_launch(const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                    unsigned smem, void **args, int nargs) {
  using namespace loom_emu;
  std::lock_guard<std::mutex> g(launch_mu);
  L.err.clear();
  auto it = registry().find(name);
  if (it == registry().end()) {
    L.err = std::string("no kernel ") + name;
    return LOOM_EMU_NO_KERNEL;
  }
  if (nargs != it->second.nargs) {
    L.err = std::string(name) + " takes " + std::to_string(it->second.nargs) + " arguments, not " + std::to_string(nargs);
    return LOOM_EMU_BAD_NARGS;
  }
  unsigned long long threads = (unsigned long long)bx * by * bz;
  if (!gx || !gy || !gz || !threads || threads > 1024 || bz > 64 || gy > 65535 || gz > 65535 || smem > (228u << 10)) {
    L.err = std::string(name) + ": bad launch geometry";
    return LOOM_EMU_BAD_GEOMETRY;
  }
  if (!stacks) {
    void *m = mmap(nullptr, 1024 * stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      L.err = "mapping fiber stacks failed";
      return LOOM_EMU_FAILED;
    }
    stacks = (unsigned char *)m;
  }
  L.kernel = name;
  L.thread = it->second.thread;
  L.params = args;
  L.smem.assign(smem, 0xA5);  // garbage, as on a GPU
  gridDim = dim3(gx, gy, gz);
  blockDim = dim3(bx, by, bz);
  L.fibers.assign(threads, fiber{});
  for (unsigned z = 0; z < gz; z++)
    for (unsigned y = 0; y < gy; y++)
      for (unsigned x = 0; x < gx; x++) {
        blockIdx = uint3(x, y, z);
        size_t i = 0;
        for (unsigned tz = 0; tz < bz; tz++)
          for (unsigned ty = 0; ty < by; ty++)
            for (unsigned tx = 0; tx < bx; tx++, i++) {
              fiber &f = L.fibers[i];
              f = fiber{};
              f.idx = uint3(tx, ty, tz);
              getcontext(&f.ctx);
              f.ctx.uc_stack.ss_sp = stacks + i * stack_bytes;
              f.ctx.uc_stack.ss_size = stack_bytes;
              f.ctx.uc_link = nullptr;
              makecontext(&f.ctx, fiber_main, 0);
            }
        if (!run_block()) {
          L.err = std::string(name) + " (block " + std::to_string(x) + "," + std::to_string(y) + "," +
                  std::to_string(z) + "): " + L.err;
          return LOOM_EMU_FAILED;
        }
      }
  return LOOM_EMU_OK;
}

}  // extern "C"
