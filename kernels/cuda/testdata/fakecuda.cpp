// A fake CUDA driver and NVRTC for testing package cuda on machines without
// a GPU. Built by the tests with
//
//	g++ -std=c++20 -shared -fPIC -O1 -I.. -o libfakecuda.so fakecuda.cpp -lpthread
//
// it exports the driver and NVRTC entry points package cuda binds. "Device"
// memory is host memory; cuLaunchKernel runs the real kernels of
// permute.cu on the CPU: blocks one after another, and the threads of a
// block one after another, or, for the kernels whose warps exchange values
// (__shfl_down_sync), as real threads, each warp's lanes meeting at a
// barrier of their own in every shuffle. So a Go test exercises the
// whole path (dlopen, symbol binding, argument packing, launch geometry,
// size checks, error reporting) and the kernels' results.

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

struct loom_dim3 {
  unsigned x, y, z;
};
static thread_local loom_dim3 threadIdx;
static loom_dim3 blockIdx, blockDim, gridDim;

// One warp of a kernel that shuffles: its 32 lanes run as threads.
struct loom_warp {
  std::barrier<> bar{32};
  unsigned long long value[32];
};
static thread_local loom_warp *loom_this_warp;

// __shfl_down_sync returns lane+off's v (its own past the last lane), as
// on the GPU: every lane publishes v, the warp meets, each reads, and the
// warp meets again before a lane may publish its next value.
template <typename V>
static V __shfl_down_sync(unsigned mask, V v, unsigned off) {
  static_assert(sizeof(V) <= sizeof(unsigned long long));
  if (mask != 0xffffffffu || !loom_this_warp) std::abort();
  loom_warp *w = loom_this_warp;
  unsigned lane = threadIdx.x & 31u;
  std::memcpy(&w->value[lane], &v, sizeof v);
  w->bar.arrive_and_wait();
  V r = v;
  if (lane + off < 32) std::memcpy(&r, &w->value[lane + off], sizeof r);
  w->bar.arrive_and_wait();
  return r;
}

#define __global__
#define __device__
#define __forceinline__ inline

#include "permute.cu"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static std::mutex mu;
static std::set<void *> live;        // allocations
static int ctxRefs;                  // primary context retains minus releases
static int modules;                  // loaded modules
static int events;                   // live events
static long long launches;           // kernels run

extern "C" {

int fake_live_allocs() { std::lock_guard<std::mutex> g(mu); return (int)live.size(); }
int fake_ctx_refs() { return ctxRefs; }
int fake_modules() { return modules; }
int fake_events() { return events; }
long long fake_launches() { return launches; }

CUresult cuInit(unsigned flags) { return flags == 0 ? 0 : 1; }
CUresult cuDriverGetVersion(int *v) { *v = 12040; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) {
  if (ordinal != 0) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *d = 0;
  return 0;
}
CUresult cuDeviceGetName(char *name, int n, int dev) {
  std::snprintf(name, n, "loom fake GPU");
  return 0;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  switch (attr) {
  case 16: *v = 4; return 0;   // multiprocessors
  case 75: *v = 9; return 0;   // compute capability major
  case 76: *v = 0; return 0;   // minor
  }
  return 1;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { ctxRefs++; *ctx = (void *)0x1000; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { ctxRefs--; return ctxRefs < 0 ? 201 : 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1000 ? 0 : 201; }
CUresult cuCtxSynchronize() { return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (n == 0) return 1;
  if (n > ((size_t)1 << 36)) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  void *m = std::aligned_alloc(256, (n + 255) / 256 * 256);
  if (!m) return 2;
  std::memset(m, 0xA5, n);  // garbage, as real device memory
  std::lock_guard<std::mutex> g(mu);
  live.insert(m);
  *p = (CUdeviceptr)m;
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mu);
  if (!live.erase((void *)p)) return 1;
  std::free((void *)p);
  return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { std::memcpy((void *)d, s, n); return 0; }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { std::memcpy(d, (void *)s, n); return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { std::memmove((void *)d, (void *)s, n); return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { std::memset((void *)d, v, n); return 0; }

// A "function" is a thunk that unpacks kernelParams and runs one thread.
struct fake_fn {
  void (*thread)(void **params);
  bool warps;  // shuffles: run the block's threads concurrently, by warps
};

#define P(i, T) (*(T *)params[i])
static void th_gather16(void **params) { loom_gather_w16(P(0, void *), P(1, void *), P(2, int *), P(3, int), P(4, i64), P(5, i64)); }
static void th_gather8(void **params) { loom_gather_w8(P(0, void *), P(1, void *), P(2, int *), P(3, int), P(4, i64), P(5, i64)); }
static void th_gather4(void **params) { loom_gather_w4(P(0, void *), P(1, void *), P(2, int *), P(3, int), P(4, i64), P(5, i64)); }
static void th_gather1(void **params) { loom_gather_w1(P(0, void *), P(1, void *), P(2, int *), P(3, int), P(4, i64), P(5, i64)); }
#define TYPED(K, T)                                                                                   \
  static void th_##K(void **params) {                                                                 \
    loom_##K(P(0, T *), P(1, T *), P(2, T *), P(3, int *), P(4, int), P(5, i64), P(6, i64));         \
  }
#define TYPED_ALL(SUFFIX, T) TYPED(unpermute_##SUFFIX, T) TYPED(scale_gather_##SUFFIX, T) TYPED(gate_grad_##SUFFIX, T)
TYPED_ALL(f32, float)
TYPED_ALL(f64, double)
TYPED_ALL(f32x4, float)
TYPED_ALL(f64x2, double)

static std::map<std::string, fake_fn> fns = {
    {"loom_gather_w16", {th_gather16, false}},
    {"loom_gather_w8", {th_gather8, false}},
    {"loom_gather_w4", {th_gather4, false}},
    {"loom_gather_w1", {th_gather1, false}},
#define FNS(SUFFIX)                                                                                   \
  {"loom_unpermute_" #SUFFIX, {th_unpermute_##SUFFIX, false}},                                        \
      {"loom_scale_gather_" #SUFFIX, {th_scale_gather_##SUFFIX, false}},                              \
      {"loom_gate_grad_" #SUFFIX, {th_gate_grad_##SUFFIX, true}}
    FNS(f32), FNS(f64), FNS(f32x4), FNS(f64x2),
};

CUresult cuModuleLoadData(void **mod, const void *image) {
  if (std::strncmp((const char *)image, "FAKE", 4) != 0) return 200;  // CUDA_ERROR_INVALID_IMAGE
  modules++;
  *mod = (void *)0x2000;
  return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  auto it = fns.find(name);
  if (it == fns.end()) return 500;  // CUDA_ERROR_NOT_FOUND
  *fn = &it->second;
  return 0;
}
CUresult cuModuleUnload(void *mod) { modules--; return 0; }

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  fake_fn *fn = (fake_fn *)f;
  if (!fn || !params || extra) return 1;
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return 1;
  if ((unsigned long long)bx * by * bz > 1024 || gy > 65535 || gz > 65535 || by > 1024 || bz > 64) return 1;
  if (fn->warps && (by != 1 || bz != 1 || bx % 32 != 0)) return 1;
  launches++;
  gridDim = {gx, gy, gz};
  blockDim = {bx, by, bz};
  for (unsigned b = 0; b < gx; b++) {
    blockIdx = {b, 0, 0};
    if (!fn->warps) {
      for (unsigned y = 0; y < by; y++)
        for (unsigned x = 0; x < bx; x++) {
          threadIdx = {x, y, 0};
          fn->thread(params);
        }
      continue;
    }
    std::vector<loom_warp> warps(bx / 32);
    std::vector<std::thread> ts;
    for (unsigned x = 0; x < bx; x++)
      ts.emplace_back([=, &warps] {
        threadIdx = {x, 0, 0};
        loom_this_warp = &warps[x / 32];
        fn->thread(params);
      });
    for (auto &t : ts) t.join();
  }
  return 0;
}

CUresult cuEventCreate(void **ev, unsigned flags) { events++; *ev = (void *)0x3000; return 0; }
CUresult cuEventRecord(void *ev, void *stream) { return 0; }
CUresult cuEventSynchronize(void *ev) { return 0; }
CUresult cuEventElapsedTime(float *ms, void *a, void *b) { *ms = 0.25f; return 0; }
CUresult cuEventDestroy_v2(void *ev) { events--; return 0; }

CUresult cuGetErrorName(CUresult r, const char **s) {
  switch (r) {
  case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
  case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
  case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
  case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; return 0;
  case 500: *s = "CUDA_ERROR_NOT_FOUND"; return 0;
  }
  return 1;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
  switch (r) {
  case 2: *s = "out of memory"; return 0;
  case 500: *s = "named symbol not found"; return 0;
  }
  return cuGetErrorName(r, s);
}

// NVRTC: "compiles" by checking the options and returning a fake image.
struct fake_prog {
  std::string src, log, image;
};
typedef int nvrtcResult;

nvrtcResult nvrtcVersion(int *a, int *b) { *a = 12; *b = 4; return 0; }
nvrtcResult nvrtcGetNumSupportedArchs(int *n) { *n = 3; return 0; }
nvrtcResult nvrtcGetSupportedArchs(int *a) { a[0] = 75; a[1] = 80; a[2] = 90; return 0; }
nvrtcResult nvrtcCreateProgram(void **prog, const char *src, const char *name, int nh, const char *const *h,
                               const char *const *in) {
  if (!src || nh != 0) return 3;
  *prog = new fake_prog{src, "", ""};
  return 0;
}
nvrtcResult nvrtcCompileProgram(void *prog, int n, const char *const *opts) {
  fake_prog *p = (fake_prog *)prog;
  std::string arch;
  for (int i = 0; i < n; i++) {
    std::string o = opts[i];
    if (o.rfind("--gpu-architecture=", 0) == 0) arch = o.substr(19);
  }
  if (arch.empty()) return 5;  // NVRTC_ERROR_INVALID_OPTION
  if (p->src.find("#error") != std::string::npos) {
    p->log = "fake.cu(1): error: #error directive\n";
    return 6;  // NVRTC_ERROR_COMPILATION
  }
  p->log = "";
  p->image = "FAKE " + arch;
  return 0;
}
nvrtcResult nvrtcGetProgramLogSize(void *prog, size_t *n) { *n = ((fake_prog *)prog)->log.size() + 1; return 0; }
nvrtcResult nvrtcGetProgramLog(void *prog, char *log) {
  std::strcpy(log, ((fake_prog *)prog)->log.c_str());
  return 0;
}
nvrtcResult nvrtcGetPTXSize(void *prog, size_t *n) { *n = ((fake_prog *)prog)->image.size() + 1; return 0; }
nvrtcResult nvrtcGetPTX(void *prog, char *s) { std::strcpy(s, ((fake_prog *)prog)->image.c_str()); return 0; }
nvrtcResult nvrtcGetCUBINSize(void *prog, size_t *n) { *n = ((fake_prog *)prog)->image.size(); return 0; }
nvrtcResult nvrtcGetCUBIN(void *prog, char *s) {
  std::memcpy(s, ((fake_prog *)prog)->image.data(), ((fake_prog *)prog)->image.size());
  return 0;
}
nvrtcResult nvrtcDestroyProgram(void **prog) {
  delete (fake_prog *)*prog;
  *prog = nullptr;
  return 0;
}
const char *nvrtcGetErrorString(nvrtcResult r) {
  switch (r) {
  case 6: return "NVRTC_ERROR_COMPILATION";
  }
  return "NVRTC_ERROR";
}

}  // extern "C"
