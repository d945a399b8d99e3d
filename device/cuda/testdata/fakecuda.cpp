// A fake CUDA driver and NVRTC for testing package cuda on machines without
// a GPU. Built by the tests with
//
//	g++ -std=c++20 -shared -fPIC -O1 -I.. -o libfakecuda.so fakecuda.cpp -lpthread
//
// it exports the driver and NVRTC entry points package cuda binds. "Device"
// memory is host memory; cuLaunchKernel runs the real kernels of
// kernels/permute.cu, after the prelude kernels/loom.cuh as on a GPU, under
// testdata/loom_emu.h (blocks one after another, a block's threads as
// fibers with real barriers and shuffles), as every other kernel source
// runs in the tests. Streams queue their work until
// something waits for it (see fake_stream below), events complete in
// their stream's order and time it on a fake clock, and NVRTC counts its
// compilations and reports a version the test sets, for the kernel cache.
// So a Go test exercises the whole path (dlopen, symbol binding, argument
// packing, launch geometry, stream order, size checks, error reporting)
// and the kernels' results.

// Built with -DLOOM_FAKE_DEVICE and linked with fakecublas.cpp, it is the
// whole-device fake of device_fake_test.go: kernels run under
// testdata/loom_emu.h (fibers with real barriers and shuffles) from the
// text of every kernel source, which the test writes to fake_kernels.inc;
// NVRTC's image names the registered kernels its source defines, and a
// module finds only those; a kernel the emulator cannot run makes the next
// synchronising call fail with CUDA_ERROR_LAUNCH_FAILED (fake_last_error
// says why); and cuBLAS's GEMMs run in their stream's order on this
// driver's memory (the hooks at the end).

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "loom_emu.h"
#ifdef LOOM_FAKE_DEVICE
#include "fake_kernels.inc"
#else
// The MoE permute kernels alone, under the prelude every kernel source
// compiles with (as Source() gives it to NVRTC).
#include "kernels/loom.cuh"
#include "kernels/permute.cu"
#endif

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum { CUDA_OK = 0, CUDA_INVALID_VALUE = 1, CUDA_OUT_OF_MEMORY = 2, CUDA_INVALID_HANDLE = 400, CUDA_NOT_READY = 600 };

// Streams are queues of operations that run only when something waits for
// them (a synchronising call, an event wait, a query never does), so that
// work queued on one stream and read through another without an event
// between them reads stale memory, deterministically. The legacy stream
// (handle 0) runs its operations at once.
struct fake_stream;
struct fake_event {
  bool timing;
  bool done = true;       // an event never recorded counts as completed
  bool recorded = false;
  unsigned long long gen = 0;  // records so far; a wait is for the one current at the call
  long long time = 0;     // the fake clock when it completed
  fake_stream *stream = nullptr;
};
struct fake_op {
  std::function<void()> run;  // a kernel, copy or memset; advances the clock
  fake_event *record = nullptr;
  fake_event *wait = nullptr;
  unsigned long long gen = 0;
};
struct fake_stream {
  std::deque<fake_op> q;
};

static std::recursive_mutex mu;             // everything below
static std::map<void *, size_t> live;       // allocations and their sizes
static std::set<fake_stream *> streams;     // live streams
static std::set<fake_event *> eventSet;     // live events
static int ctxRefs;                         // primary context retains minus releases
static int modules;                         // loaded modules
static long long launches;                  // kernels run
static long long compiles;                  // nvrtcCompileProgram calls that compiled
static long long clock_;                    // operations run
static int nvMajor = 12, nvMinor = 4;       // what nvrtcVersion says
static const size_t totalMem = (size_t)1 << 36;
static int sticky;                          // a failed launch's CUresult, returned by synchronising calls
static std::string stickyMsg;               // why

typedef std::lock_guard<std::recursive_mutex> guard;

static void drain(fake_stream *s);

// step runs s's first queued operation.
static void step(fake_stream *s) {
  fake_op op = std::move(s->q.front());
  s->q.pop_front();
  if (op.record) {
    if (op.gen == op.record->gen) {
      op.record->done = true;
      op.record->time = clock_;
    }
  } else if (op.wait) {
    fake_event *e = op.wait;
    // Run the recording stream until the awaited record has run.
    while (e->gen == op.gen && !e->done && e->stream && !e->stream->q.empty()) step(e->stream);
  } else {
    op.run();
    clock_++;
  }
}

static void drain(fake_stream *s) {
  while (!s->q.empty()) step(s);
}

// stream returns h as a live stream (nullptr for the legacy stream); ok
// is false for an unknown handle.
static fake_stream *stream(void *h, bool *ok) {
  *ok = true;
  if (!h) return nullptr;
  fake_stream *s = (fake_stream *)h;
  if (!streams.count(s)) *ok = false;
  return s;
}

// enqueue queues f on stream h, or runs it at once on the legacy stream.
static CUresult enqueue(void *h, std::function<void()> f) {
  bool ok;
  fake_stream *s = stream(h, &ok);
  if (!ok) return CUDA_INVALID_HANDLE;
  if (!s) {
    f();
    clock_++;
    return CUDA_OK;
  }
  s->q.push_back(fake_op{std::move(f)});
  return CUDA_OK;
}

extern "C" {

int fake_live_allocs() { guard g(mu); return (int)live.size(); }
int fake_ctx_refs() { guard g(mu); return ctxRefs; }
int fake_modules() { guard g(mu); return modules; }
int fake_events() { guard g(mu); return (int)eventSet.size(); }
int fake_streams() { guard g(mu); return (int)streams.size(); }
long long fake_launches() { guard g(mu); return launches; }
long long fake_compiles() { guard g(mu); return compiles; }
void fake_set_nvrtc_version(int a, int b) { guard g(mu); nvMajor = a; nvMinor = b; }
const char *fake_last_error() { guard g(mu); return stickyMsg.c_str(); }

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
CUresult cuDeviceGetPCIBusId(char *bus, int n, int dev) {
  if (dev != 0) return 101;
  std::snprintf(bus, n, "0000:3B:00.0");
  return 0;
}
CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
  if (dev != 0) return 101;
  *bytes = totalMem;
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
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { guard g(mu); ctxRefs++; *ctx = (void *)0x1000; return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { guard g(mu); ctxRefs--; return ctxRefs < 0 ? 201 : 0; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == (void *)0x1000 ? 0 : 201; }
CUresult cuCtxSynchronize() {
  guard g(mu);
  for (fake_stream *s : streams) drain(s);
  return sticky;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (n == 0) return 1;
  if (n > ((size_t)1 << 36)) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  void *m = std::aligned_alloc(256, (n + 255) / 256 * 256);
  if (!m) return 2;
  std::memset(m, 0xA5, n);  // garbage, as real device memory
  guard g(mu);
  live[m] = n;
  *p = (CUdeviceptr)m;
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  guard g(mu);
  if (!live.erase((void *)p)) return 1;
  std::free((void *)p);
  return 0;
}
CUresult cuMemGetInfo_v2(size_t *free, size_t *total) {
  guard g(mu);
  size_t used = 0;
  for (auto &a : live) used += a.second;
  *free = totalMem - used;
  *total = totalMem;
  return 0;
}
// The synchronous copies run on the legacy stream: at once.
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { guard g(mu); std::memcpy((void *)d, s, n); clock_++; return 0; }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { guard g(mu); std::memcpy(d, (void *)s, n); clock_++; return 0; }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { guard g(mu); std::memmove((void *)d, (void *)s, n); clock_++; return 0; }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { guard g(mu); std::memset((void *)d, v, n); clock_++; return 0; }

// From pageable host memory the driver stages the source before
// returning, so the caller may reuse it: the fake copies it at the call.
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *h) {
  guard g(mu);
  auto staged = std::make_shared<std::vector<char>>((const char *)s, (const char *)s + n);
  return enqueue(h, [d, staged] { std::memcpy((void *)d, staged->data(), staged->size()); });
}
// Into pageable host memory the call returns only once the copy, and the
// stream's work before it, is done.
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, void *h) {
  guard g(mu);
  bool ok;
  fake_stream *st = stream(h, &ok);
  if (!ok) return CUDA_INVALID_HANDLE;
  if (st) drain(st);
  std::memcpy(d, (void *)s, n);
  clock_++;
  return sticky;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *h) {
  guard g(mu);
  return enqueue(h, [=] { std::memmove((void *)d, (void *)s, n); });
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *h) {
  guard g(mu);
  return enqueue(h, [=] { std::memset((void *)d, v, n); });
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void *h) {
  if (d % 4 != 0) return CUDA_INVALID_VALUE;
  guard g(mu);
  return enqueue(h, [=] {
    for (size_t i = 0; i < n; i++) std::memcpy((char *)d + 4 * i, &v, 4);
  });
}

CUresult cuStreamCreate(void **h, unsigned flags) {
  if (flags > 1) return CUDA_INVALID_VALUE;
  guard g(mu);
  fake_stream *s = new fake_stream;
  streams.insert(s);
  *h = s;
  return 0;
}
CUresult cuStreamDestroy_v2(void *h) {
  guard g(mu);
  bool ok;
  fake_stream *s = stream(h, &ok);
  if (!ok || !s) return CUDA_INVALID_HANDLE;
  drain(s);  // queued work still completes
  for (fake_event *e : eventSet)
    if (e->stream == s) e->stream = nullptr;
  streams.erase(s);
  delete s;
  return 0;
}
CUresult cuStreamSynchronize(void *h) {
  guard g(mu);
  bool ok;
  fake_stream *s = stream(h, &ok);
  if (!ok) return CUDA_INVALID_HANDLE;
  if (s) drain(s);
  return sticky;
}
CUresult cuStreamQuery(void *h) {
  guard g(mu);
  bool ok;
  fake_stream *s = stream(h, &ok);
  if (!ok) return CUDA_INVALID_HANDLE;
  return s && !s->q.empty() ? CUDA_NOT_READY : CUDA_OK;
}

static fake_event *event(void *h) {
  fake_event *e = (fake_event *)h;
  return eventSet.count(e) ? e : nullptr;
}

CUresult cuStreamWaitEvent(void *h, void *ev, unsigned flags) {
  guard g(mu);
  bool ok;
  fake_stream *s = stream(h, &ok);
  fake_event *e = event(ev);
  if (!ok || !e) return CUDA_INVALID_HANDLE;
  if (flags != 0) return CUDA_INVALID_VALUE;
  if (!s) {  // the legacy stream waits here and now
    while (!e->done && e->stream && !e->stream->q.empty()) step(e->stream);
    return 0;
  }
  fake_op op;
  op.wait = e;
  op.gen = e->gen;
  s->q.push_back(std::move(op));
  return 0;
}

CUresult cuEventCreate(void **h, unsigned flags) {
  if (flags != 0 && flags != 2) return CUDA_INVALID_VALUE;  // default, or CU_EVENT_DISABLE_TIMING
  guard g(mu);
  fake_event *e = new fake_event;
  e->timing = flags == 0;
  eventSet.insert(e);
  *h = e;
  return 0;
}
CUresult cuEventRecord(void *ev, void *h) {
  guard g(mu);
  bool ok;
  fake_stream *s = stream(h, &ok);
  fake_event *e = event(ev);
  if (!ok || !e) return CUDA_INVALID_HANDLE;
  e->gen++;
  e->recorded = true;
  e->stream = s;
  if (!s) {
    e->done = true;
    e->time = clock_;
    return 0;
  }
  e->done = false;
  fake_op op;
  op.record = e;
  op.gen = e->gen;
  s->q.push_back(std::move(op));
  return 0;
}
CUresult cuEventQuery(void *ev) {
  guard g(mu);
  fake_event *e = event(ev);
  if (!e) return CUDA_INVALID_HANDLE;
  return e->done ? CUDA_OK : CUDA_NOT_READY;
}
CUresult cuEventSynchronize(void *ev) {
  guard g(mu);
  fake_event *e = event(ev);
  if (!e) return CUDA_INVALID_HANDLE;
  while (!e->done && e->stream && !e->stream->q.empty()) step(e->stream);
  return sticky;
}
// Every operation takes 0.25 ms of fake time.
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
  guard g(mu);
  fake_event *s = event(a), *e = event(b);
  if (!s || !e || !s->timing || !e->timing || !s->recorded || !e->recorded) return CUDA_INVALID_HANDLE;
  if (!s->done || !e->done) return CUDA_NOT_READY;
  *ms = 0.25f * (float)(e->time - s->time);
  return 0;
}
CUresult cuEventDestroy_v2(void *ev) {
  guard g(mu);
  fake_event *e = event(ev);
  if (!e) return CUDA_INVALID_HANDLE;
  // A record still queued keeps its op's pointer: run the stream first.
  if (e->stream) drain(e->stream);
  for (fake_stream *s : streams)
    for (fake_op &op : s->q)
      if (op.wait == e) return CUDA_INVALID_HANDLE;  // the fake does not model destroying awaited events
  eventSet.erase(e);
  delete e;
  return 0;
}

// A "function" is the emulator's kernel of that name (loom_emu.h's
// registry).
struct fake_fn {
  int nparams;  // its arguments, each copied from an 8-byte slot at launch
  int maxDynamicShared = 48 << 10;
  std::string name;
};

static std::map<std::string, fake_fn> fns;  // filled from the emulator's registry at lookup

// function returns the fake_fn of the registered kernel name, or null.
static fake_fn *function(const char *name) {
  auto r = loom_emu::registry().find(name);
  if (r == loom_emu::registry().end()) return nullptr;
  auto it = fns.find(name);
  if (it == fns.end()) it = fns.emplace(name, fake_fn{r->second.nargs, 48 << 10, name}).first;
  return &it->second;
}

#ifdef LOOM_FAKE_DEVICE
// A module: the kernels its source defines.
struct fake_module {
  std::set<std::string> names;
};
static std::set<fake_module *> moduleSet;

CUresult cuModuleLoadData(void **mod, const void *image) {
  const char *img = (const char *)image;
  if (std::strncmp(img, "FAKE", 4) != 0) return 200;  // CUDA_ERROR_INVALID_IMAGE
  guard g(mu);
  fake_module *m = new fake_module;
  const char *p = std::strchr(img, ';');
  while (p) {
    const char *e = std::strchr(p + 1, ';');
    std::string name = e ? std::string(p + 1, e) : std::string(p + 1);
    if (!name.empty()) m->names.insert(name);
    p = e;
  }
  moduleSet.insert(m);
  modules++;
  *mod = m;
  return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  guard g(mu);
  fake_module *m = (fake_module *)mod;
  if (!moduleSet.count(m)) return CUDA_INVALID_HANDLE;
  if (!m->names.count(name)) return 500;  // CUDA_ERROR_NOT_FOUND
  fake_fn *f = function(name);
  if (!f) return 500;
  *fn = f;
  return 0;
}
CUresult cuModuleUnload(void *mod) {
  guard g(mu);
  fake_module *m = (fake_module *)mod;
  if (!moduleSet.erase(m)) return CUDA_INVALID_HANDLE;
  delete m;
  modules--;
  return 0;
}
#else
CUresult cuModuleLoadData(void **mod, const void *image) {
  if (std::strncmp((const char *)image, "FAKE", 4) != 0) return 200;  // CUDA_ERROR_INVALID_IMAGE
  guard g(mu);
  modules++;
  *mod = (void *)0x2000;
  return 0;
}
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  guard g(mu);
  fake_fn *f = function(name);
  if (!f) return 500;  // CUDA_ERROR_NOT_FOUND
  *fn = f;
  return 0;
}
CUresult cuModuleUnload(void *mod) { guard g(mu); modules--; return 0; }
#endif
CUresult cuFuncSetAttribute(void *f, int attr, int v) {
  fake_fn *fn = (fake_fn *)f;
  if (!fn || attr != 8 || v < 0 || v > 227 << 10) return CUDA_INVALID_VALUE;  // H100/H200's opt-in limit
  guard g(mu);
  fn->maxDynamicShared = v;
  return 0;
}

struct loom_dim3 {
  unsigned x, y, z;
};

// run executes one launch under the emulator; a failure is kept for the
// next synchronising call.
static void run(fake_fn *fn, loom_dim3 grid, loom_dim3 block, unsigned shared, std::vector<unsigned long long> &vals) {
  std::vector<void *> params(vals.size());
  for (size_t i = 0; i < vals.size(); i++) params[i] = &vals[i];
  launches++;
  if (loom_emu_launch(fn->name.c_str(), grid.x, grid.y, grid.z, block.x, block.y, block.z, shared, params.data(),
                      (int)params.size()) != 0 &&
      sticky == 0) {
    sticky = 719;  // CUDA_ERROR_LAUNCH_FAILED
    stickyMsg = loom_emu_error();
  }
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void *stream, void **params, void **extra) {
  fake_fn *fn = (fake_fn *)f;
  if (!fn || !params || extra) return 1;
  if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0) return 1;
  if ((unsigned long long)bx * by * bz > 1024 || gy > 65535 || gz > 65535 || by > 1024 || bz > 64) return 1;
  guard g(mu);
  if ((int)shared > fn->maxDynamicShared) return 1;
  // The driver copies the argument values at launch: the caller's array
  // may be gone by the time the kernel runs.
  auto vals = std::make_shared<std::vector<unsigned long long>>(fn->nparams);
  for (int i = 0; i < fn->nparams; i++) std::memcpy(&(*vals)[i], params[i], 8);
  loom_dim3 grid{gx, gy, gz}, block{bx, by, bz};
  return enqueue(stream, [fn, grid, block, shared, vals] { run(fn, grid, block, shared, *vals); });
}

CUresult cuGetErrorName(CUresult r, const char **s) {
  switch (r) {
  case 1: *s = "CUDA_ERROR_INVALID_VALUE"; return 0;
  case 2: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0;
  case 101: *s = "CUDA_ERROR_INVALID_DEVICE"; return 0;
  case 200: *s = "CUDA_ERROR_INVALID_IMAGE"; return 0;
  case 500: *s = "CUDA_ERROR_NOT_FOUND"; return 0;
  case 719: *s = "CUDA_ERROR_LAUNCH_FAILED"; return 0;
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

nvrtcResult nvrtcVersion(int *a, int *b) {
  guard g(mu);
  *a = nvMajor;
  *b = nvMinor;
  return 0;
}
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
#ifdef LOOM_FAKE_DEVICE
  // Name the registered kernels the source defines, for cuModuleGetFunction.
  for (auto &k : loom_emu::registry())
    if (p->src.find(k.first + "(") != std::string::npos) p->image += ";" + k.first;
  p->image.push_back('\0');  // a cubin's size is its own; the module reads up to here
#endif
  guard g(mu);
  compiles++;
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

#ifdef LOOM_FAKE_DEVICE
// The hooks of fakecublas.cpp.
bool fake_device_in_block(uintptr_t p, size_t bytes) {
  guard g(mu);
  auto it = live.upper_bound((void *)p);
  if (it == live.begin()) return false;
  --it;
  uintptr_t base = (uintptr_t)it->first;
  return p >= base && p - base + bytes <= it->second;
}
int fake_device_enqueue(void *stream, std::function<void()> f) {
  guard g(mu);
  return enqueue(stream, std::move(f));
}
#endif
