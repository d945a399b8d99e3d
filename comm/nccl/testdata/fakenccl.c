// A fake NCCL and CUDA driver for the tests of package nccl, built with
// gcc -shared -fPIC into a temporary folder and loaded as both libnccl.so.2
// and libcuda.so.1 (the driver through device/cuda, which binds more of it
// than NCCL's use needs: what the nccl tests do not use, such as kernels
// and asynchronous copies, returns CUDA_ERROR_NOT_SUPPORTED). It exports
// the entry points the packages bind, with the same C signatures, and
//
//   - records every call with its arguments in a text log (fake_log);
//   - keeps "device memory" in malloc'd blocks and checks that every
//     pointer a call gets lies in a live block;
//   - runs communicators of many ranks inside one process: ranks are
//     threads that call ncclCommInitRankConfig with the same unique id;
//     collectives and send/receive pairs execute (on the host) once every
//     participant has enqueued them and everything before them on each
//     participant's stream has completed, as on a GPU;
//   - models nonblocking communicators: calls return ncclInProgress and the
//     work reaches the stream only after ncclCommGetAsyncError has been
//     polled fake_settle_polls times, so a caller that records its event
//     before the call has settled sees it complete too early;
//   - lets tests inject failures (fake_fail) and asynchronous errors
//     (fake_set_async), and check for leaks (fake_live).
//
// Everything is serialised by one mutex.

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef int ncclResult_t;
typedef unsigned long long CUdeviceptr;
typedef struct { char internal[128]; } ncclUniqueId;

enum {
  ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
  ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7,
};
enum { CUDA_OK = 0, CUDA_INVALID_VALUE = 1, CUDA_OOM = 2, CUDA_INVALID_DEVICE = 101,
       CUDA_INVALID_CONTEXT = 201, CUDA_INVALID_HANDLE = 400, CUDA_NOT_READY = 600,
       CUDA_NOT_SUPPORTED = 801 };

#define EXPORT __attribute__((visibility("default")))
#define INT_MIN_ (-2147483647 - 1)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;

/* ---------- settings and injection ---------- */

static int fake_version_ = 22803;
static int fake_ndev = 8;
static int fake_settle_polls = 2;
static int fake_abort_propagates = 1;
static int fake_abort_delay_us;
static char last_error[512];

struct inject { char name[64]; int rc; int count; };
static struct inject injects[32];
static int ninjects;

static int async_rank = -2, async_rc;

EXPORT void fake_set_version(int v) { pthread_mutex_lock(&mu); fake_version_ = v; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_settle_polls(int n) { pthread_mutex_lock(&mu); fake_settle_polls = n; pthread_mutex_unlock(&mu); }
EXPORT void fake_set_abort_propagates(int on) { pthread_mutex_lock(&mu); fake_abort_propagates = on; pthread_mutex_unlock(&mu); }
// fake_set_abort_delay makes ncclCommAbort take us microseconds before it
// does anything, as a real abort that stops kernels takes a while.
EXPORT void fake_set_abort_delay(int us) { pthread_mutex_lock(&mu); fake_abort_delay_us = us; pthread_mutex_unlock(&mu); }

// fake_fail makes the next count calls of fn (count < 0: every call) return rc.
EXPORT void fake_fail(const char *fn, int rc, int count) {
  pthread_mutex_lock(&mu);
  if (ninjects < 32) {
    snprintf(injects[ninjects].name, sizeof injects[ninjects].name, "%s", fn);
    injects[ninjects].rc = rc;
    injects[ninjects].count = count;
    ninjects++;
  }
  pthread_mutex_unlock(&mu);
}

// fake_set_async makes ncclCommGetAsyncError report rc for the members of
// rank r of every communicator (r = -1: all ranks; rc = 0 clears).
EXPORT void fake_set_async(int r, int rc) {
  pthread_mutex_lock(&mu);
  async_rank = rc ? r : -2;
  async_rc = rc;
  pthread_mutex_unlock(&mu);
}

EXPORT void fake_set_last_error(const char *s) {
  pthread_mutex_lock(&mu);
  snprintf(last_error, sizeof last_error, "%s", s);
  pthread_mutex_unlock(&mu);
}

static int injected(const char *fn) {
  for (int i = 0; i < ninjects; i++) {
    if (strcmp(injects[i].name, fn) != 0 || injects[i].count == 0) continue;
    if (injects[i].count > 0) injects[i].count--;
    return injects[i].rc;
  }
  return 0;
}

/* ---------- log ---------- */

static char *logbuf;
static size_t loglen, logcap;

static void logf_(const char *fmt, ...) {
  char line[2048];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof line) n = sizeof line - 1;
  if (loglen + n + 2 > logcap) {
    size_t cap = logcap ? 2 * logcap : 1 << 16;
    while (cap < loglen + n + 2) cap *= 2;
    char *p = realloc(logbuf, cap);
    if (!p) return;
    logbuf = p;
    logcap = cap;
  }
  memcpy(logbuf + loglen, line, n);
  loglen += n;
  logbuf[loglen++] = '\n';
  logbuf[loglen] = 0;
}

EXPORT void fake_log_clear(void) { pthread_mutex_lock(&mu); loglen = 0; if (logbuf) logbuf[0] = 0; pthread_mutex_unlock(&mu); }
EXPORT size_t fake_log_len(void) { pthread_mutex_lock(&mu); size_t n = loglen; pthread_mutex_unlock(&mu); return n; }
EXPORT size_t fake_log_copy(char *dst, size_t n) {
  pthread_mutex_lock(&mu);
  size_t k = loglen < n ? loglen : n;
  if (k) memcpy(dst, logbuf, k);
  pthread_mutex_unlock(&mu);
  return k;
}

static long async_polls;
EXPORT long fake_async_polls(void) { pthread_mutex_lock(&mu); long n = async_polls; pthread_mutex_unlock(&mu); return n; }

/* ---------- CUDA: contexts, memory ---------- */

struct ctx { int dev; int refs; };
static struct ctx ctxs[64];
static __thread struct ctx *cur_ctx;

#define LOCK pthread_mutex_lock(&mu)
#define UNLOCK pthread_mutex_unlock(&mu)
#define RET(rc) do { int r_ = (rc); UNLOCK; return r_; } while (0)
#define INJECT(fn) do { int rc_ = injected(fn); if (rc_) { logf_("%s injected %d", fn, rc_); RET(rc_); } } while (0)
#define NEED_CTX(fn) do { if (!cur_ctx) { logf_("NOCTX %s", fn); RET(CUDA_INVALID_CONTEXT); } } while (0)

struct alloc { uintptr_t p; size_t n; struct alloc *next; };
static struct alloc *allocs;
static int live_allocs;

// in_alloc reports whether [p, p+n) lies in a live block.
static int in_alloc(uintptr_t p, size_t n) {
  for (struct alloc *a = allocs; a; a = a->next)
    if (p >= a->p && p + n <= a->p + a->n) return 1;
  return 0;
}

EXPORT CUresult cuInit(unsigned flags) {
  LOCK;
  logf_("cuInit flags=%u", flags);
  INJECT("cuInit");
  RET(flags ? CUDA_INVALID_VALUE : CUDA_OK);
}

EXPORT CUresult cuDriverGetVersion(int *v) { *v = 12040; return CUDA_OK; }

EXPORT CUresult cuDeviceGetCount(int *n) { LOCK; INJECT("cuDeviceGetCount"); *n = fake_ndev; RET(CUDA_OK); }

EXPORT CUresult cuDeviceGet(int *dev, int ordinal) {
  LOCK;
  INJECT("cuDeviceGet");
  if (ordinal < 0 || ordinal >= fake_ndev) RET(CUDA_INVALID_DEVICE);
  *dev = ordinal;
  RET(CUDA_OK);
}

EXPORT CUresult cuDeviceGetPCIBusId(char *buf, int len, int dev) {
  if (dev < 0 || dev >= fake_ndev) return CUDA_INVALID_DEVICE;
  snprintf(buf, len, "0000:%02X:00.0", 0x10 + 0x10 * dev);
  return CUDA_OK;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(void **pctx, int dev) {
  LOCK;
  logf_("cuDevicePrimaryCtxRetain dev=%d", dev);
  INJECT("cuDevicePrimaryCtxRetain");
  if (dev < 0 || dev >= fake_ndev) RET(CUDA_INVALID_DEVICE);
  ctxs[dev].dev = dev;
  ctxs[dev].refs++;
  *pctx = &ctxs[dev];
  RET(CUDA_OK);
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev) {
  LOCK;
  logf_("cuDevicePrimaryCtxRelease_v2 dev=%d", dev);
  if (dev < 0 || dev >= fake_ndev || ctxs[dev].refs <= 0) RET(CUDA_INVALID_DEVICE);
  ctxs[dev].refs--;
  RET(CUDA_OK);
}

EXPORT CUresult cuCtxSetCurrent(void *ctx) {
  struct ctx *c = ctx;
  if (c && (c < ctxs || c >= ctxs + 64)) return CUDA_INVALID_CONTEXT;
  cur_ctx = c;
  return CUDA_OK;
}

EXPORT CUresult cuCtxSynchronize(void) { LOCK; NEED_CTX("cuCtxSynchronize"); RET(CUDA_OK); }

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  LOCK;
  NEED_CTX("cuMemAlloc_v2");
  INJECT("cuMemAlloc_v2");
  if (n == 0) { logf_("cuMemAlloc_v2 bytes=0 -> invalid"); RET(CUDA_INVALID_VALUE); }
  struct alloc *a = malloc(sizeof *a);
  void *m = malloc(n);
  if (!a || !m) { free(a); free(m); RET(CUDA_OOM); }
  memset(m, 0xA5, n); // not zero: a missing copy shows
  a->p = (uintptr_t)m;
  a->n = n;
  a->next = allocs;
  allocs = a;
  live_allocs++;
  *p = a->p;
  logf_("cuMemAlloc_v2 bytes=%zu -> 0x%llx", n, *p);
  RET(CUDA_OK);
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
  LOCK;
  NEED_CTX("cuMemFree_v2");
  logf_("cuMemFree_v2 ptr=0x%llx", p);
  for (struct alloc **pp = &allocs; *pp; pp = &(*pp)->next) {
    if ((*pp)->p == p) {
      struct alloc *a = *pp;
      *pp = a->next;
      free((void *)a->p);
      free(a);
      live_allocs--;
      RET(CUDA_OK);
    }
  }
  logf_("BADFREE 0x%llx", p);
  RET(CUDA_INVALID_VALUE);
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
  LOCK;
  NEED_CTX("cuMemcpyHtoD_v2");
  logf_("cuMemcpyHtoD_v2 dst=0x%llx bytes=%zu", dst, n);
  INJECT("cuMemcpyHtoD_v2");
  if (!in_alloc(dst, n)) RET(CUDA_INVALID_VALUE);
  memcpy((void *)(uintptr_t)dst, src, n);
  RET(CUDA_OK);
}

EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
  LOCK;
  NEED_CTX("cuMemcpyDtoH_v2");
  logf_("cuMemcpyDtoH_v2 src=0x%llx bytes=%zu", src, n);
  INJECT("cuMemcpyDtoH_v2");
  if (!in_alloc(src, n)) RET(CUDA_INVALID_VALUE);
  memcpy(dst, (void *)(uintptr_t)src, n);
  RET(CUDA_OK);
}

/* Device queries and copies that device/cuda binds beside what NCCL's use
   needs: real where device/cuda's Open and the tests call them, the rest
   CUDA_ERROR_NOT_SUPPORTED. */

static const size_t fake_total_mem = (size_t)80 << 30;

EXPORT CUresult cuDeviceGetName(char *name, int len, int dev) {
  if (dev < 0 || dev >= fake_ndev) return CUDA_INVALID_DEVICE;
  snprintf(name, len, "Fake NCCL GPU %d", dev);
  return CUDA_OK;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  if (dev < 0 || dev >= fake_ndev) return CUDA_INVALID_DEVICE;
  switch (attr) {
  case 16: *v = 132; return CUDA_OK; // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  case 75: *v = 9; return CUDA_OK;   // COMPUTE_CAPABILITY_MAJOR
  case 76: *v = 0; return CUDA_OK;   // COMPUTE_CAPABILITY_MINOR
  }
  return CUDA_NOT_SUPPORTED;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
  if (dev < 0 || dev >= fake_ndev) return CUDA_INVALID_DEVICE;
  *bytes = fake_total_mem;
  return CUDA_OK;
}

EXPORT CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
  LOCK;
  NEED_CTX("cuMemGetInfo_v2");
  size_t used = 0;
  for (struct alloc *a = allocs; a; a = a->next) used += a->n;
  *free_ = fake_total_mem - used;
  *total = fake_total_mem;
  RET(CUDA_OK);
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
  LOCK;
  NEED_CTX("cuMemcpyDtoD_v2");
  logf_("cuMemcpyDtoD_v2 dst=0x%llx src=0x%llx bytes=%zu", dst, src, n);
  if (!in_alloc(dst, n) || !in_alloc(src, n)) RET(CUDA_INVALID_VALUE);
  memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
  RET(CUDA_OK);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
  LOCK;
  NEED_CTX("cuMemsetD8_v2");
  logf_("cuMemsetD8_v2 dst=0x%llx value=%u bytes=%zu", dst, v, n);
  if (!in_alloc(dst, n)) RET(CUDA_INVALID_VALUE);
  memset((void *)(uintptr_t)dst, v, n);
  RET(CUDA_OK);
}

// not_supported logs a call the fake does not model and refuses it.
static CUresult not_supported(const char *fn) {
  LOCK;
  logf_("%s not supported by the fake", fn);
  RET(CUDA_NOT_SUPPORTED);
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
  (void)dst, (void)src, (void)n, (void)s;
  return not_supported("cuMemcpyHtoDAsync_v2");
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
  (void)dst, (void)src, (void)n, (void)s;
  return not_supported("cuMemcpyDtoHAsync_v2");
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
  (void)dst, (void)src, (void)n, (void)s;
  return not_supported("cuMemcpyDtoDAsync_v2");
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *s) {
  (void)dst, (void)v, (void)n, (void)s;
  return not_supported("cuMemsetD8Async");
}
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void *s) {
  (void)dst, (void)v, (void)n, (void)s;
  return not_supported("cuMemsetD32Async");
}
EXPORT CUresult cuModuleLoadData(void **mod, const void *image) {
  (void)mod, (void)image;
  return not_supported("cuModuleLoadData");
}
EXPORT CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
  (void)fn, (void)mod, (void)name;
  return not_supported("cuModuleGetFunction");
}
EXPORT CUresult cuModuleUnload(void *mod) {
  (void)mod;
  return not_supported("cuModuleUnload");
}
EXPORT CUresult cuFuncSetAttribute(void *fn, int attr, int v) {
  (void)fn, (void)attr, (void)v;
  return not_supported("cuFuncSetAttribute");
}
EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                               unsigned smem, void *s, void **params, void **extra) {
  (void)f, (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)smem, (void)s, (void)params, (void)extra;
  return not_supported("cuLaunchKernel");
}
EXPORT CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
  (void)ms, (void)start, (void)end;
  return not_supported("cuEventElapsedTime");
}

static const char *cu_name(CUresult rc) {
  switch (rc) {
  case 0: return "CUDA_SUCCESS";
  case 1: return "CUDA_ERROR_INVALID_VALUE";
  case 2: return "CUDA_ERROR_OUT_OF_MEMORY";
  case 100: return "CUDA_ERROR_NO_DEVICE";
  case 101: return "CUDA_ERROR_INVALID_DEVICE";
  case 201: return "CUDA_ERROR_INVALID_CONTEXT";
  case 400: return "CUDA_ERROR_INVALID_HANDLE";
  case 600: return "CUDA_ERROR_NOT_READY";
  case 700: return "CUDA_ERROR_ILLEGAL_ADDRESS";
  case 801: return "CUDA_ERROR_NOT_SUPPORTED";
  }
  return NULL;
}

EXPORT CUresult cuGetErrorName(CUresult rc, const char **s) {
  *s = cu_name(rc);
  return *s ? CUDA_OK : CUDA_INVALID_VALUE;
}

EXPORT CUresult cuGetErrorString(CUresult rc, const char **s) {
  switch (rc) {
  case 2: *s = "out of memory"; return CUDA_OK;
  case 700: *s = "an illegal memory access was encountered"; return CUDA_OK;
  }
  *s = cu_name(rc);
  return *s ? CUDA_OK : CUDA_INVALID_VALUE;
}

/* ---------- streams, events and the execution model ---------- */

struct op;
struct comm;

// A part is one participant's share of an op: one rank's collective call,
// or the send or the receive of a pair.
struct part {
  struct op *op;
  struct comm *c;
  struct stream *s;
  int entry; // index of its entry on s, -1 until posted
  int posted, done;
  uintptr_t send, recv;
  size_t count;
  int dt, redop, root, peer;
  int color, key;
  struct comm *newcomm;
};

// An entry is what one enqueue (a call, or a group) put on a stream.
struct entry { struct part **parts; int nparts; };

struct stream {
  struct entry *entries;
  int n, cap;
  int done_prefix;
  int live;
  unsigned flags;
  struct stream *next;
};

struct event { struct stream *s; int mark; int live; struct event *next; };

static struct stream *streams;
static struct event *events;
static int live_streams, live_events;

enum { K_ALLREDUCE, K_BCAST, K_REDUCE, K_ALLGATHER, K_REDSCAT, K_ALLTOALL, K_GATHER, K_SCATTER, K_P2P, K_SPLIT };

struct group {
  unsigned char id[128];
  int nranks, joined;
  struct comm **members;
  long *sends, *recvs; // per (src,dst): p2p operations posted so far
  int broken;
  struct group *next;
};

struct op {
  int kind;
  struct group *g;
  long seq;     // collective sequence, or p2p index on its channel
  int src, dst; // p2p channel
  int nparts, nreg;
  struct part *parts;
  int executed, dead;
  struct op *next;
};

struct comm {
  struct group *g;
  int rank, nranks, dev;
  int blocking;
  int state;     // what ncclCommGetAsyncError reports when nothing is pending
  int ready;     // joined (init) or split computed
  int polls;     // polls left before pending entries are posted
  struct part **unposted[16]; // entries waiting for the settle polls
  int nunposted_parts[16];
  struct stream *unposted_stream[16];
  int nunposted;
  long coll_seq;
  int aborted, destroyed;
  struct comm *next;
};

static struct group *groups;
static struct op *ops;
static struct comm *comms;
static int live_comms;

static struct stream *find_stream(uintptr_t h) {
  for (struct stream *s = streams; s; s = s->next)
    if ((uintptr_t)s == h && s->live) return s;
  return NULL;
}

static struct comm *find_comm(uintptr_t h) {
  for (struct comm *c = comms; c; c = c->next)
    if ((uintptr_t)c == h) return c;
  return NULL;
}

static int entry_done(struct entry *e) {
  for (int i = 0; i < e->nparts; i++)
    if (!e->parts[i]->done) return 0;
  return 1;
}

static void advance_prefix(struct stream *s) {
  while (s->done_prefix < s->n && entry_done(&s->entries[s->done_prefix])) s->done_prefix++;
}

static void post_entry(struct stream *s, struct part **parts, int n) {
  if (s->n == s->cap) {
    s->cap = s->cap ? 2 * s->cap : 16;
    s->entries = realloc(s->entries, s->cap * sizeof *s->entries);
  }
  struct entry *e = &s->entries[s->n];
  e->parts = malloc(n * sizeof *parts);
  memcpy(e->parts, parts, n * sizeof *parts);
  e->nparts = n;
  for (int i = 0; i < n; i++) {
    parts[i]->posted = 1;
    parts[i]->entry = s->n;
  }
  s->n++;
}

static int ready_part(struct part *p) {
  if (!p->posted) return 0;
  if (!p->s) return 1;
  advance_prefix(p->s);
  return p->s->done_prefix >= p->entry;
}

/* ---------- element arithmetic ---------- */

static int esize(int dt) {
  switch (dt) {
  case 0: case 1: return 1;
  case 2: case 3: return 4;
  case 4: case 5: return 8;
  case 6: return 2;
  case 7: return 4;
  case 8: return 8;
  case 9: return 2;
  }
  return 0;
}

static float h2f(uint16_t h) {
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, f;
  if (e == 0) {
    if (m == 0) f = s;
    else {
      e = 127 - 15 + 1;
      while (!(m & 0x400)) { m <<= 1; e--; }
      m &= 0x3ff;
      f = s | (e << 23) | (m << 13);
    }
  } else if (e == 31) f = s | 0x7f800000 | (m << 13);
  else f = s | ((e + 127 - 15) << 23) | (m << 13);
  float r;
  memcpy(&r, &f, 4);
  return r;
}

static uint16_t f2h(float x) {
  uint32_t f;
  memcpy(&f, &x, 4);
  uint32_t s = (f >> 16) & 0x8000, m = f & 0x7fffff;
  int e = (f >> 23) & 0xff;
  if (e == 255) return s | 0x7c00 | (m ? 0x200 : 0);
  int ne = e - 127 + 15;
  if (ne >= 31) return s | 0x7c00;
  if (ne <= 0) {
    if (ne < -10) return s;
    m |= 0x800000;
    int shift = 14 - ne;
    uint32_t hm = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (hm & 1))) hm++;
    return s | hm;
  }
  uint32_t hm = m >> 13, rem = m & 0x1fff;
  uint16_t h = s | (ne << 10) | hm;
  if (rem > 0x1000 || (rem == 0x1000 && (hm & 1))) h++;
  return h;
}

static float b2f(uint16_t b) { uint32_t f = (uint32_t)b << 16; float r; memcpy(&r, &f, 4); return r; }

static uint16_t f2b(float x) {
  uint32_t f;
  memcpy(&f, &x, 4);
  if ((f & 0x7fffffff) > 0x7f800000) return (f >> 16) | 0x40;
  f += 0x7fff + ((f >> 16) & 1);
  return f >> 16;
}

#define COMBINE(a, b, op) ((op) == 0 ? (a) + (b) : (op) == 1 ? (a) * (b) : (op) == 2 ? ((a) > (b) ? (a) : (b)) : (op) == 3 ? ((a) < (b) ? (a) : (b)) : (a) + (b))

// reduce_into combines x into acc element-wise, rounding to the type after
// every step as a GPU reduction does.
static void reduce_into(void *acc, const void *x, size_t n, int dt, int op) {
  for (size_t i = 0; i < n; i++) {
    switch (dt) {
    case 0: { int8_t *a = acc; const int8_t *b = x;
      a[i] = (op == 0 || op == 4) ? (int8_t)((uint8_t)a[i] + (uint8_t)b[i]) : op == 1 ? (int8_t)((uint8_t)a[i] * (uint8_t)b[i]) : COMBINE(a[i], b[i], op); break; }
    case 1: { uint8_t *a = acc; const uint8_t *b = x; a[i] = (uint8_t)COMBINE(a[i], b[i], op); break; }
    case 2: { int32_t *a = acc; const int32_t *b = x;
      a[i] = (op == 0 || op == 4) ? (int32_t)((uint32_t)a[i] + (uint32_t)b[i]) : op == 1 ? (int32_t)((uint32_t)a[i] * (uint32_t)b[i]) : COMBINE(a[i], b[i], op); break; }
    case 3: { uint32_t *a = acc; const uint32_t *b = x; a[i] = COMBINE(a[i], b[i], op); break; }
    case 4: { int64_t *a = acc; const int64_t *b = x;
      a[i] = (op == 0 || op == 4) ? (int64_t)((uint64_t)a[i] + (uint64_t)b[i]) : op == 1 ? (int64_t)((uint64_t)a[i] * (uint64_t)b[i]) : COMBINE(a[i], b[i], op); break; }
    case 5: { uint64_t *a = acc; const uint64_t *b = x; a[i] = COMBINE(a[i], b[i], op); break; }
    case 6: { uint16_t *a = acc; const uint16_t *b = x; float u = h2f(a[i]), v = h2f(b[i]); a[i] = f2h(COMBINE(u, v, op)); break; }
    case 7: { float *a = acc; const float *b = x; a[i] = COMBINE(a[i], b[i], op); break; }
    case 8: { double *a = acc; const double *b = x; a[i] = COMBINE(a[i], b[i], op); break; }
    case 9: { uint16_t *a = acc; const uint16_t *b = x; float u = b2f(a[i]), v = b2f(b[i]); a[i] = f2b(COMBINE(u, v, op)); break; }
    }
  }
}

// divide applies ncclAvg's final division by the number of ranks.
static void divide(void *acc, size_t n, int dt, int p) {
  for (size_t i = 0; i < n; i++) {
    switch (dt) {
    case 0: ((int8_t *)acc)[i] /= p; break;
    case 1: ((uint8_t *)acc)[i] /= p; break;
    case 2: ((int32_t *)acc)[i] /= p; break;
    case 3: ((uint32_t *)acc)[i] /= p; break;
    case 4: ((int64_t *)acc)[i] /= p; break;
    case 5: ((uint64_t *)acc)[i] /= p; break;
    case 6: ((uint16_t *)acc)[i] = f2h(h2f(((uint16_t *)acc)[i]) / p); break;
    case 7: ((float *)acc)[i] /= p; break;
    case 8: ((double *)acc)[i] /= p; break;
    case 9: ((uint16_t *)acc)[i] = f2b(b2f(((uint16_t *)acc)[i]) / p); break;
    }
  }
}

static void *dup(uintptr_t p, size_t n) {
  void *m = malloc(n ? n : 1);
  if (n) memcpy(m, (void *)p, n);
  return m;
}

/* ---------- execution ---------- */

static void split_execute(struct op *o);

static void mismatch(struct op *o, const char *why) {
  logf_("MISMATCH %s", why);
  snprintf(last_error, sizeof last_error, "fake: mismatched operation: %s", why);
  o->g->broken = 1;
  for (int i = 0; i < o->g->nranks; i++)
    if (o->g->members[i]) o->g->members[i]->state = ncclInvalidUsage;
}

static void execute(struct op *o) {
  int p = o->nparts;
  struct part *P = o->parts;
  if (o->kind == K_SPLIT) { split_execute(o); return; }
  if (o->kind == K_P2P) {
    struct part *s = &P[0], *r = &P[1];
    if (s->count != r->count || s->dt != r->dt) {
      char why[160];
      snprintf(why, sizeof why, "send of %zu (type %d) from rank %d to rank %d received as %zu (type %d)",
               s->count, s->dt, o->src, o->dst, r->count, r->dt);
      mismatch(o, why);
      return;
    }
    if (s->count) memmove((void *)r->recv, (void *)s->send, s->count * esize(s->dt));
    return;
  }
  for (int i = 1; i < p; i++) {
    if (P[i].count != P[0].count || P[i].dt != P[0].dt || P[i].redop != P[0].redop || P[i].root != P[0].root) {
      char why[160];
      snprintf(why, sizeof why, "kind %d: rank 0 count=%zu dt=%d op=%d root=%d, rank %d count=%zu dt=%d op=%d root=%d",
               o->kind, P[0].count, P[0].dt, P[0].redop, P[0].root, i, P[i].count, P[i].dt, P[i].redop, P[i].root);
      mismatch(o, why);
      return;
    }
  }
  size_t n = P[0].count, es = esize(P[0].dt);
  int dt = P[0].dt, op = P[0].redop, root = P[0].root;
  void **in = calloc(p, sizeof *in);
  switch (o->kind) {
  case K_ALLREDUCE: case K_REDUCE: {
    for (int q = 0; q < p; q++) in[q] = dup(P[q].send, n * es);
    for (int q = 1; q < p; q++) reduce_into(in[0], in[q], n, dt, op);
    if (op == 4) divide(in[0], n, dt, p);
    for (int r = 0; r < p; r++)
      if (o->kind == K_ALLREDUCE || r == root) memcpy((void *)P[r].recv, in[0], n * es);
    break;
  }
  case K_BCAST:
    in[0] = dup(P[root].send, n * es);
    for (int r = 0; r < p; r++) memcpy((void *)P[r].recv, in[0], n * es);
    break;
  case K_ALLGATHER: case K_GATHER:
    for (int q = 0; q < p; q++) in[q] = dup(P[q].send, n * es);
    for (int r = 0; r < p; r++) {
      if (o->kind == K_GATHER && r != root) continue;
      for (int q = 0; q < p; q++) memcpy((char *)P[r].recv + q * n * es, in[q], n * es);
    }
    break;
  case K_REDSCAT:
    for (int q = 0; q < p; q++) in[q] = dup(P[q].send, p * n * es);
    for (int r = 0; r < p; r++) {
      void *acc = dup((uintptr_t)in[0] + r * n * es, n * es);
      for (int q = 1; q < p; q++) reduce_into(acc, (char *)in[q] + r * n * es, n, dt, op);
      if (op == 4) divide(acc, n, dt, p);
      memcpy((void *)P[r].recv, acc, n * es);
      free(acc);
    }
    break;
  case K_ALLTOALL:
    for (int q = 0; q < p; q++) in[q] = dup(P[q].send, p * n * es);
    for (int r = 0; r < p; r++)
      for (int q = 0; q < p; q++) memcpy((char *)P[r].recv + q * n * es, (char *)in[q] + r * n * es, n * es);
    break;
  case K_SCATTER:
    in[0] = dup(P[root].send, p * n * es);
    for (int r = 0; r < p; r++) memcpy((void *)P[r].recv, (char *)in[0] + r * n * es, n * es);
    break;
  }
  for (int q = 0; q < p; q++) free(in[q]);
  free(in);
}

// progress executes every op whose parts are all enqueued and unblocked,
// until nothing changes. An executed op leaves the ops list, which would
// otherwise grow with every call and make each call cost more than the
// last; nothing can join it again, and its parts stay allocated because
// stream entries point at them.
static void progress(void) {
  int changed = 1;
  while (changed) {
    changed = 0;
    for (struct op **pp = &ops; *pp;) {
      struct op *o = *pp;
      int ok = !o->dead && o->nreg == o->nparts;
      for (int i = 0; i < o->nparts && ok; i++) ok = ready_part(&o->parts[i]);
      if (!ok) {
        pp = &o->next;
        continue;
      }
      execute(o);
      o->executed = 1;
      for (int i = 0; i < o->nparts; i++) o->parts[i].done = 1;
      changed = 1;
      *pp = o->next;
      o->next = NULL;
    }
  }
  pthread_cond_broadcast(&cv);
}

EXPORT CUresult cuStreamCreate(void **ps, unsigned flags) {
  LOCK;
  NEED_CTX("cuStreamCreate");
  INJECT("cuStreamCreate");
  struct stream *s = calloc(1, sizeof *s);
  s->live = 1;
  s->flags = flags;
  s->next = streams;
  streams = s;
  live_streams++;
  *ps = s;
  logf_("cuStreamCreate flags=%u -> 0x%lx", flags, (unsigned long)(uintptr_t)s);
  RET(CUDA_OK);
}

EXPORT CUresult cuStreamDestroy_v2(void *h) {
  LOCK;
  NEED_CTX("cuStreamDestroy_v2");
  logf_("cuStreamDestroy_v2 stream=0x%lx", (unsigned long)(uintptr_t)h);
  struct stream *s = find_stream((uintptr_t)h);
  if (!s) RET(CUDA_INVALID_HANDLE);
  s->live = 0;
  live_streams--;
  RET(CUDA_OK);
}

static int stream_idle(struct stream *s) { advance_prefix(s); return s->done_prefix >= s->n; }

static int wait_until(int (*cond)(void *), void *arg) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += 20;
  while (!cond(arg))
    if (pthread_cond_timedwait(&cv, &mu, &ts) != 0) return 0;
  return 1;
}

static int stream_idle_v(void *s) { return stream_idle(s); }

EXPORT CUresult cuStreamSynchronize(void *h) {
  LOCK;
  struct stream *s = find_stream((uintptr_t)h);
  if (!s) RET(CUDA_INVALID_HANDLE);
  RET(wait_until(stream_idle_v, s) ? CUDA_OK : 999);
}

EXPORT CUresult cuStreamQuery(void *h) {
  LOCK;
  struct stream *s = find_stream((uintptr_t)h);
  if (!s) RET(CUDA_INVALID_HANDLE);
  RET(stream_idle(s) ? CUDA_OK : CUDA_NOT_READY);
}

EXPORT CUresult cuStreamWaitEvent(void *s, void *e, unsigned flags) {
  LOCK;
  logf_("cuStreamWaitEvent stream=0x%lx event=0x%lx flags=%u", (unsigned long)(uintptr_t)s, (unsigned long)(uintptr_t)e, flags);
  RET(CUDA_OK);
}

static struct event *find_event(uintptr_t h) {
  for (struct event *e = events; e; e = e->next)
    if ((uintptr_t)e == h && e->live) return e;
  return NULL;
}

EXPORT CUresult cuEventCreate(void **pe, unsigned flags) {
  LOCK;
  NEED_CTX("cuEventCreate");
  INJECT("cuEventCreate");
  struct event *e = calloc(1, sizeof *e);
  e->live = 1;
  e->next = events;
  events = e;
  live_events++;
  *pe = e;
  logf_("cuEventCreate flags=%u -> 0x%lx", flags, (unsigned long)(uintptr_t)e);
  RET(CUDA_OK);
}

EXPORT CUresult cuEventRecord(void *h, void *sh) {
  LOCK;
  NEED_CTX("cuEventRecord");
  logf_("cuEventRecord event=0x%lx stream=0x%lx", (unsigned long)(uintptr_t)h, (unsigned long)(uintptr_t)sh);
  INJECT("cuEventRecord");
  struct event *e = find_event((uintptr_t)h);
  struct stream *s = find_stream((uintptr_t)sh);
  if (!e || !s) RET(CUDA_INVALID_HANDLE);
  e->s = s;
  e->mark = s->n;
  RET(CUDA_OK);
}

static int event_done(struct event *e) {
  if (!e->s) return 1;
  advance_prefix(e->s);
  return e->s->done_prefix >= e->mark;
}

static int event_done_v(void *e) { return event_done(e); }

EXPORT CUresult cuEventQuery(void *h) {
  LOCK;
  NEED_CTX("cuEventQuery");
  INJECT("cuEventQuery");
  struct event *e = find_event((uintptr_t)h);
  if (!e) RET(CUDA_INVALID_HANDLE);
  progress();
  RET(event_done(e) ? CUDA_OK : CUDA_NOT_READY);
}

EXPORT CUresult cuEventSynchronize(void *h) {
  LOCK;
  struct event *e = find_event((uintptr_t)h);
  if (!e) RET(CUDA_INVALID_HANDLE);
  RET(wait_until(event_done_v, e) ? CUDA_OK : 999);
}

EXPORT CUresult cuEventDestroy_v2(void *h) {
  LOCK;
  NEED_CTX("cuEventDestroy_v2");
  logf_("cuEventDestroy_v2 event=0x%lx", (unsigned long)(uintptr_t)h);
  struct event *e = find_event((uintptr_t)h);
  if (!e) RET(CUDA_INVALID_HANDLE);
  e->live = 0;
  live_events--;
  RET(CUDA_OK);
}

/* ---------- ncclConfig_t layouts, as in nccl.h of each release ---------- */

#define CFG_V21400 size_t size; unsigned int magic; unsigned int version; int blocking;
#define CFG_V21700 CFG_V21400 int cgaClusterSize; int minCTAs; int maxCTAs; const char *netName;
#define CFG_V21800 CFG_V21700 int splitShare;
#define CFG_V22600 CFG_V21800 int trafficClass;
#define CFG_V22700 CFG_V22600 const char *commName; int collnetEnable; int CTAPolicy; int shrinkShare; int nvlsCTAs;
#define CFG_V22800 CFG_V22700 int nChannelsPerNetPeer; int nvlinkCentricSched;
#define CFG_V22900 CFG_V22800 int graphUsageMode; int numRmaCtx;
#define CFG_V23000 CFG_V22900 int maxP2pPeers;
#define CFG_V23005 CFG_V23000 int graphStreamOrdering;

typedef struct { CFG_V21400 } cfg21400;
typedef struct { CFG_V21700 } cfg21700;
typedef struct { CFG_V21800 } cfg21800;
typedef struct { CFG_V22600 } cfg22600;
typedef struct { CFG_V22700 } cfg22700;
typedef struct { CFG_V22800 } cfg22800;
typedef struct { CFG_V22900 } cfg22900;
typedef struct { CFG_V23000 } cfg23000;
typedef struct { CFG_V23005 } cfg23005;

// fake_cfg_sizeof returns sizeof(ncclConfig_t) as compiled for the layout
// of NCCL version v (a layout version above), or 0.
EXPORT long fake_cfg_sizeof(int v) {
  switch (v) {
  case 21400: return sizeof(cfg21400);
  case 21700: return sizeof(cfg21700);
  case 21800: return sizeof(cfg21800);
  case 22600: return sizeof(cfg22600);
  case 22700: return sizeof(cfg22700);
  case 22800: return sizeof(cfg22800);
  case 22900: return sizeof(cfg22900);
  case 23000: return sizeof(cfg23000);
  case 23005: return sizeof(cfg23005);
  }
  return 0;
}

#define OFF(T, f) if (strcmp(name, #f) == 0) return offsetof(T, f)
#define OFFS_21400(T) OFF(T, size); OFF(T, magic); OFF(T, version); OFF(T, blocking)
#define OFFS_21700(T) OFFS_21400(T); OFF(T, cgaClusterSize); OFF(T, minCTAs); OFF(T, maxCTAs); OFF(T, netName)
#define OFFS_21800(T) OFFS_21700(T); OFF(T, splitShare)
#define OFFS_22600(T) OFFS_21800(T); OFF(T, trafficClass)
#define OFFS_22700(T) OFFS_22600(T); OFF(T, commName); OFF(T, collnetEnable); OFF(T, CTAPolicy); OFF(T, shrinkShare); OFF(T, nvlsCTAs)
#define OFFS_22800(T) OFFS_22700(T); OFF(T, nChannelsPerNetPeer); OFF(T, nvlinkCentricSched)
#define OFFS_22900(T) OFFS_22800(T); OFF(T, graphUsageMode); OFF(T, numRmaCtx)
#define OFFS_23000(T) OFFS_22900(T); OFF(T, maxP2pPeers)
#define OFFS_23005(T) OFFS_23000(T); OFF(T, graphStreamOrdering)

// fake_cfg_offsetof returns offsetof(ncclConfig_t, name) in the layout of
// version v, or -1 when that layout has no such field.
EXPORT long fake_cfg_offsetof(int v, const char *name) {
  switch (v) {
  case 21400: OFFS_21400(cfg21400); break;
  case 21700: OFFS_21700(cfg21700); break;
  case 21800: OFFS_21800(cfg21800); break;
  case 22600: OFFS_22600(cfg22600); break;
  case 22700: OFFS_22700(cfg22700); break;
  case 22800: OFFS_22800(cfg22800); break;
  case 22900: OFFS_22900(cfg22900); break;
  case 23000: OFFS_23000(cfg23000); break;
  case 23005: OFFS_23005(cfg23005); break;
  }
  return -1;
}

// layout_of returns the layout version of a release (the newest layout
// at or below it).
static int layout_of(int v) {
  static const int ls[] = {23005, 23000, 22900, 22800, 22700, 22600, 21800, 21700, 21400};
  for (int i = 0; i < 9; i++)
    if (v >= ls[i]) return ls[i];
  return 0;
}

/* ---------- NCCL ---------- */

static const char *nccl_names[] = {"no error", "unhandled cuda error", "unhandled system error", "internal error",
                                   "invalid argument", "invalid usage", "remote process exited or there was a network error",
                                   "NCCL operation in progress", "operation timed out"};

EXPORT const char *ncclGetErrorString(ncclResult_t r) {
  if (r >= 0 && r <= 8) return nccl_names[r];
  return "unknown result code";
}

EXPORT const char *ncclGetLastError(void *comm) { (void)comm; return last_error; }

EXPORT ncclResult_t ncclGetVersion(int *v) { LOCK; INJECT("ncclGetVersion"); *v = fake_version_; RET(ncclSuccess); }

static long uid_counter;

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  LOCK;
  INJECT("ncclGetUniqueId");
  uid_counter++;
  for (int i = 0; i < 128; i++) id->internal[i] = (char)((uid_counter * 31 + i * 7 + 1) & 0xff);
  memcpy(id->internal, &uid_counter, sizeof uid_counter);
  logf_("ncclGetUniqueId -> %ld", uid_counter);
  RET(ncclSuccess);
}

static void hex(char *dst, const void *src, size_t n) {
  static const char digits[] = "0123456789abcdef";
  const unsigned char *s = src;
  for (size_t i = 0; i < n; i++) {
    dst[2 * i] = digits[s[i] >> 4];
    dst[2 * i + 1] = digits[s[i] & 15];
  }
  dst[2 * n] = 0;
}

static int comm_ok(struct comm *c, const char *fn) {
  if (!c) { logf_("BADCOMM %s", fn); snprintf(last_error, sizeof last_error, "%s: invalid communicator", fn); return 0; }
  if (c->destroyed) { logf_("USE-AFTER-FREE %s", fn); return 0; }
  return 1;
}

static struct comm *new_comm(int blocking) {
  struct comm *c = calloc(1, sizeof *c);
  c->blocking = blocking;
  c->state = ncclInProgress;
  c->polls = fake_settle_polls;
  c->dev = cur_ctx ? cur_ctx->dev : -1;
  c->next = comms;
  comms = c;
  live_comms++;
  return c;
}

static int comm_ready_v(void *c) { return ((struct comm *)c)->ready; }

static ncclResult_t init_rank(void **out, int nranks, const ncclUniqueId *id, int rank, const void *cfgp, const char *fn) {
  char idhex[257], cfghex[1024] = "null";
  hex(idhex, id, 128);
  int blocking = 1;
  if (cfgp) {
    size_t size;
    memcpy(&size, cfgp, sizeof size);
    unsigned magic, version;
    memcpy(&magic, (const char *)cfgp + 8, 4);
    memcpy(&version, (const char *)cfgp + 12, 4);
    if (size > 256) size = 256;
    hex(cfghex, cfgp, size);
    logf_("%s nranks=%d rank=%d id=%s config=%s", fn, nranks, rank, idhex, cfghex);
    if (magic != 0xcafebeef) {
      snprintf(last_error, sizeof last_error, "%s: config not initialized via NCCL_CONFIG_INITIALIZER", fn);
      return ncclInvalidArgument;
    }
    // As NCCL: copy min(size, our sizeof); fields newer than version are defaults.
    long mine = fake_cfg_sizeof(layout_of(fake_version_));
    int b;
    memcpy(&b, (const char *)cfgp + 16, 4);
    if (size >= 20 && mine >= 20 && (int)version >= 21400) blocking = b;
    if (blocking != 0 && blocking != 1 && blocking != INT_MIN_) {
      snprintf(last_error, sizeof last_error, "%s: invalid blocking %d", fn, blocking);
      return ncclInvalidArgument;
    }
    if (blocking == INT_MIN_) blocking = 1;
  } else {
    logf_("%s nranks=%d rank=%d id=%s config=null", fn, nranks, rank, idhex);
  }
  if (!cur_ctx) { logf_("NOCTX %s", fn); return ncclUnhandledCudaError; }
  if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  struct group *g;
  for (g = groups; g; g = g->next)
    if (memcmp(g->id, id, 128) == 0) break;
  if (!g) {
    g = calloc(1, sizeof *g);
    memcpy(g->id, id, 128);
    g->nranks = nranks;
    g->members = calloc(nranks, sizeof *g->members);
    g->sends = calloc((size_t)nranks * nranks, sizeof(long));
    g->recvs = calloc((size_t)nranks * nranks, sizeof(long));
    g->next = groups;
    groups = g;
  }
  if (g->nranks != nranks || g->members[rank]) {
    snprintf(last_error, sizeof last_error, "%s: rank %d of %d joins a group of %d twice or with another size", fn, rank, nranks, g->nranks);
    return ncclInvalidUsage;
  }
  struct comm *c = new_comm(blocking);
  c->g = g;
  c->rank = rank;
  c->nranks = nranks;
  g->members[rank] = c;
  g->joined++;
  *out = c;
  if (g->joined == nranks) {
    for (int i = 0; i < nranks; i++) g->members[i]->ready = 1;
    pthread_cond_broadcast(&cv);
  }
  if (blocking) {
    if (!wait_until(comm_ready_v, c)) return ncclSystemError;
    c->state = ncclSuccess;
    return ncclSuccess;
  }
  return ncclInProgress;
}

EXPORT ncclResult_t ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, void *cfg) {
  LOCK;
  INJECT("ncclCommInitRankConfig");
  RET(init_rank(comm, nranks, &id, rank, cfg, "ncclCommInitRankConfig"));
}

EXPORT ncclResult_t ncclCommInitRankScalable(void **comm, int nranks, int rank, int nid, ncclUniqueId *ids, void *cfg) {
  LOCK;
  logf_("ncclCommInitRankScalable nId=%d", nid);
  INJECT("ncclCommInitRankScalable");
  if (nid < 1) RET(ncclInvalidArgument);
  RET(init_rank(comm, nranks, &ids[0], rank, cfg, "ncclCommInitRankScalable"));
}

EXPORT ncclResult_t ncclCommCount(void *h, int *n) {
  LOCK;
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommCount")) RET(ncclInvalidArgument);
  *n = c->nranks;
  RET(ncclSuccess);
}

EXPORT ncclResult_t ncclCommUserRank(void *h, int *r) {
  LOCK;
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommUserRank")) RET(ncclInvalidArgument);
  *r = c->rank;
  RET(ncclSuccess);
}

// post_pending moves c's settled entries onto their streams.
static void post_pending(struct comm *c) {
  for (int i = 0; i < c->nunposted; i++) {
    post_entry(c->unposted_stream[i], c->unposted[i], c->nunposted_parts[i]);
    free(c->unposted[i]);
  }
  c->nunposted = 0;
}

EXPORT ncclResult_t ncclCommGetAsyncError(void *h, ncclResult_t *st) {
  LOCK;
  async_polls++;
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommGetAsyncError")) RET(ncclInvalidArgument);
  if (async_rank != -2 && (async_rank == -1 || async_rank == c->rank)) {
    *st = async_rc;
    RET(ncclSuccess);
  }
  if (c->state == ncclInProgress) {
    if (c->ready && --c->polls <= 0) {
      post_pending(c);
      c->state = ncclSuccess;
      progress();
    }
    *st = c->state;
    RET(ncclSuccess);
  }
  if (c->g && c->g->broken && fake_abort_propagates && c->state == ncclSuccess) {
    snprintf(last_error, sizeof last_error, "fake: a peer aborted");
    *st = ncclRemoteError;
    RET(ncclSuccess);
  }
  *st = c->state;
  RET(ncclSuccess);
}

/* groups of calls (ncclGroupStart/End), per thread */

static __thread int group_depth;
static __thread struct part *group_parts[1024];
static __thread int group_nparts;

// enqueue puts parts (all of one comm and stream) on the stream: now for a
// blocking communicator, after the settle polls for a nonblocking one.
static ncclResult_t enqueue(struct comm *c, struct stream *s, struct part **parts, int n) {
  if (c->blocking) {
    post_entry(s, parts, n);
    progress();
    return ncclSuccess;
  }
  if (c->nunposted == 16) return ncclInternalError;
  c->unposted[c->nunposted] = malloc(n * sizeof *parts);
  memcpy(c->unposted[c->nunposted], parts, n * sizeof *parts);
  c->nunposted_parts[c->nunposted] = n;
  c->unposted_stream[c->nunposted] = s;
  c->nunposted++;
  c->state = ncclInProgress;
  c->polls = fake_settle_polls;
  return ncclInProgress;
}

static struct op *find_or_add_op(int kind, struct group *g, long seq, int src, int dst, int nparts) {
  for (struct op *o = ops; o; o = o->next)
    if (o->g == g && o->seq == seq && o->src == src && o->dst == dst && (o->kind == K_P2P) == (kind == K_P2P)) return o;
  struct op *o = calloc(1, sizeof *o);
  o->kind = kind;
  o->g = g;
  o->seq = seq;
  o->src = src;
  o->dst = dst;
  o->nparts = nparts;
  o->parts = calloc(nparts, sizeof *o->parts);
  struct op **pp = &ops; // append: execution follows issue order
  while (*pp) pp = &(*pp)->next;
  *pp = o;
  return o;
}

static ncclResult_t submit(struct part *pt) {
  if (group_depth > 0) {
    if (group_nparts == 1024) return ncclInternalError;
    group_parts[group_nparts++] = pt;
    return ncclSuccess;
  }
  return enqueue(pt->c, pt->s, &pt, 1);
}

static ncclResult_t collective(int kind, const char *fn, uintptr_t send, uintptr_t recv, size_t count, int dt, int redop,
                               int root, void *comm, void *stream, size_t send_elems, size_t recv_elems, int recv_on_root_only) {
  struct comm *c = find_comm((uintptr_t)comm);
  if (!comm_ok(c, fn)) return ncclInvalidArgument;
  if (c->aborted) { logf_("USE-AFTER-ABORT %s", fn); return ncclInvalidArgument; }
  struct stream *s = find_stream((uintptr_t)stream);
  if (!s) { snprintf(last_error, sizeof last_error, "%s: invalid stream", fn); return ncclInvalidArgument; }
  if (dt < 0 || dt > 11) { snprintf(last_error, sizeof last_error, "%s: invalid type %d", fn, dt); return ncclInvalidArgument; }
  if (redop < 0 || redop > 4) { snprintf(last_error, sizeof last_error, "%s: invalid operation %d", fn, redop); return ncclInvalidArgument; }
  if (root < 0 || root >= c->nranks) { snprintf(last_error, sizeof last_error, "%s: invalid root %d", fn, root); return ncclInvalidArgument; }
  size_t es = esize(dt);
  int need_send = send_elems > 0 && (kind != K_SCATTER && kind != K_BCAST ? 1 : c->rank == root);
  int need_recv = recv_elems > 0 && (!recv_on_root_only || c->rank == root);
  if ((need_send && !in_alloc(send, send_elems * es)) || (need_recv && !in_alloc(recv, recv_elems * es))) {
    snprintf(last_error, sizeof last_error, "%s: invalid device pointer (send 0x%lx, recv 0x%lx)", fn, (unsigned long)send, (unsigned long)recv);
    return ncclInvalidArgument;
  }
  long seq = ++c->coll_seq;
  struct op *o = find_or_add_op(kind, c->g, seq, -1, -1, c->nranks);
  if (o->kind != kind) {
    mismatch(o, "ranks issued different collectives");
    return ncclInvalidUsage;
  }
  struct part *pt = &o->parts[c->rank];
  pt->op = o;
  pt->c = c;
  pt->s = s;
  pt->entry = -1;
  pt->send = send;
  pt->recv = recv;
  pt->count = count;
  pt->dt = dt;
  pt->redop = redop;
  pt->root = root;
  o->nreg++;
  return submit(pt);
}

#define PTR(p) (unsigned long)(uintptr_t)(p)

EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, int dt, int op, void *comm, void *stream) {
  LOCK;
  logf_("ncclAllReduce send=0x%lx recv=0x%lx count=%zu dt=%d op=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, op, PTR(comm), PTR(stream));
  INJECT("ncclAllReduce");
  RET(collective(K_ALLREDUCE, "ncclAllReduce", (uintptr_t)send, (uintptr_t)recv, count, dt, op, 0, comm, stream, count, count, 0));
}

EXPORT ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, int dt, int root, void *comm, void *stream) {
  LOCK;
  logf_("ncclBroadcast send=0x%lx recv=0x%lx count=%zu dt=%d root=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, root, PTR(comm), PTR(stream));
  INJECT("ncclBroadcast");
  RET(collective(K_BCAST, "ncclBroadcast", (uintptr_t)send, (uintptr_t)recv, count, dt, 0, root, comm, stream, count, count, 0));
}

EXPORT ncclResult_t ncclReduce(const void *send, void *recv, size_t count, int dt, int op, int root, void *comm, void *stream) {
  LOCK;
  logf_("ncclReduce send=0x%lx recv=0x%lx count=%zu dt=%d op=%d root=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, op, root, PTR(comm), PTR(stream));
  INJECT("ncclReduce");
  RET(collective(K_REDUCE, "ncclReduce", (uintptr_t)send, (uintptr_t)recv, count, dt, op, root, comm, stream, count, count, 1));
}

static int nranks_of(void *comm) {
  struct comm *c = find_comm((uintptr_t)comm);
  return c && !c->destroyed ? c->nranks : 1;
}

EXPORT ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, int dt, void *comm, void *stream) {
  LOCK;
  logf_("ncclAllGather send=0x%lx recv=0x%lx count=%zu dt=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, PTR(comm), PTR(stream));
  INJECT("ncclAllGather");
  RET(collective(K_ALLGATHER, "ncclAllGather", (uintptr_t)send, (uintptr_t)recv, count, dt, 0, 0, comm, stream, count, count * nranks_of(comm), 0));
}

EXPORT ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, int dt, int op, void *comm, void *stream) {
  LOCK;
  logf_("ncclReduceScatter send=0x%lx recv=0x%lx count=%zu dt=%d op=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, op, PTR(comm), PTR(stream));
  INJECT("ncclReduceScatter");
  RET(collective(K_REDSCAT, "ncclReduceScatter", (uintptr_t)send, (uintptr_t)recv, count, dt, op, 0, comm, stream, count * nranks_of(comm), count, 0));
}

EXPORT ncclResult_t ncclAlltoAll(const void *send, void *recv, size_t count, int dt, void *comm, void *stream) {
  LOCK;
  logf_("ncclAlltoAll send=0x%lx recv=0x%lx count=%zu dt=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, PTR(comm), PTR(stream));
  INJECT("ncclAlltoAll");
  int p = nranks_of(comm);
  RET(collective(K_ALLTOALL, "ncclAlltoAll", (uintptr_t)send, (uintptr_t)recv, count, dt, 0, 0, comm, stream, count * p, count * p, 0));
}

EXPORT ncclResult_t ncclGather(const void *send, void *recv, size_t count, int dt, int root, void *comm, void *stream) {
  LOCK;
  logf_("ncclGather send=0x%lx recv=0x%lx count=%zu dt=%d root=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, root, PTR(comm), PTR(stream));
  INJECT("ncclGather");
  RET(collective(K_GATHER, "ncclGather", (uintptr_t)send, (uintptr_t)recv, count, dt, 0, root, comm, stream, count, count * nranks_of(comm), 1));
}

EXPORT ncclResult_t ncclScatter(const void *send, void *recv, size_t count, int dt, int root, void *comm, void *stream) {
  LOCK;
  logf_("ncclScatter send=0x%lx recv=0x%lx count=%zu dt=%d root=%d comm=0x%lx stream=0x%lx", PTR(send), PTR(recv), count, dt, root, PTR(comm), PTR(stream));
  INJECT("ncclScatter");
  RET(collective(K_SCATTER, "ncclScatter", (uintptr_t)send, (uintptr_t)recv, count, dt, 0, root, comm, stream, count * nranks_of(comm), count, 0));
}

static ncclResult_t p2p(int is_send, const char *fn, uintptr_t buf, size_t count, int dt, int peer, void *comm, void *stream) {
  struct comm *c = find_comm((uintptr_t)comm);
  if (!comm_ok(c, fn)) return ncclInvalidArgument;
  if (c->aborted) { logf_("USE-AFTER-ABORT %s", fn); return ncclInvalidArgument; }
  struct stream *s = find_stream((uintptr_t)stream);
  if (!s) return ncclInvalidArgument;
  if (dt < 0 || dt > 11 || peer < 0 || peer >= c->nranks) {
    snprintf(last_error, sizeof last_error, "%s: invalid type %d or peer %d", fn, dt, peer);
    return ncclInvalidArgument;
  }
  if (count > 0 && !in_alloc(buf, count * esize(dt))) {
    snprintf(last_error, sizeof last_error, "%s: invalid device pointer 0x%lx", fn, (unsigned long)buf);
    return ncclInvalidArgument;
  }
  int src = is_send ? c->rank : peer, dst = is_send ? peer : c->rank;
  struct group *g = c->g;
  long *k = is_send ? &g->sends[src * g->nranks + dst] : &g->recvs[src * g->nranks + dst];
  struct op *o = find_or_add_op(K_P2P, g, (*k)++, src, dst, 2);
  struct part *pt = &o->parts[is_send ? 0 : 1];
  pt->op = o;
  pt->c = c;
  pt->s = s;
  pt->entry = -1;
  if (is_send) pt->send = buf; else pt->recv = buf;
  pt->count = count;
  pt->dt = dt;
  pt->peer = peer;
  o->nreg++;
  return submit(pt);
}

EXPORT ncclResult_t ncclSend(const void *buf, size_t count, int dt, int peer, void *comm, void *stream) {
  LOCK;
  logf_("ncclSend buf=0x%lx count=%zu dt=%d peer=%d comm=0x%lx stream=0x%lx", PTR(buf), count, dt, peer, PTR(comm), PTR(stream));
  INJECT("ncclSend");
  RET(p2p(1, "ncclSend", (uintptr_t)buf, count, dt, peer, comm, stream));
}

EXPORT ncclResult_t ncclRecv(void *buf, size_t count, int dt, int peer, void *comm, void *stream) {
  LOCK;
  logf_("ncclRecv buf=0x%lx count=%zu dt=%d peer=%d comm=0x%lx stream=0x%lx", PTR(buf), count, dt, peer, PTR(comm), PTR(stream));
  INJECT("ncclRecv");
  RET(p2p(0, "ncclRecv", (uintptr_t)buf, count, dt, peer, comm, stream));
}

EXPORT ncclResult_t ncclGroupStart(void) {
  LOCK;
  logf_("ncclGroupStart");
  INJECT("ncclGroupStart");
  group_depth++;
  RET(ncclSuccess);
}

EXPORT ncclResult_t ncclGroupEnd(void) {
  LOCK;
  logf_("ncclGroupEnd");
  if (group_depth <= 0) RET(ncclInvalidUsage);
  if (--group_depth > 0) RET(ncclSuccess);
  int rc = injected("ncclGroupEnd");
  if (rc) {
    logf_("ncclGroupEnd injected %d", rc);
    group_nparts = 0;
    RET(rc);
  }
  // One entry per (comm, stream), in first-appearance order.
  ncclResult_t res = ncclSuccess;
  int used[1024] = {0};
  for (int i = 0; i < group_nparts; i++) {
    if (used[i]) continue;
    struct part *batch[1024];
    int n = 0;
    for (int j = i; j < group_nparts; j++) {
      if (!used[j] && group_parts[j]->c == group_parts[i]->c && group_parts[j]->s == group_parts[i]->s) {
        batch[n++] = group_parts[j];
        used[j] = 1;
      }
    }
    ncclResult_t r = enqueue(batch[0]->c, batch[0]->s, batch, n);
    if (r != ncclSuccess) res = r;
  }
  group_nparts = 0;
  RET(res);
}

static void split_execute(struct op *o) {
  int p = o->nparts;
  struct group *parent = o->g;
  int *done = calloc(p, sizeof *done);
  for (int i = 0; i < p; i++) {
    if (done[i] || o->parts[i].color < 0) continue;
    int color = o->parts[i].color, n = 0;
    int order[256];
    for (int j = 0; j < p; j++)
      if (!done[j] && o->parts[j].color == color) { order[n++] = j; done[j] = 1; }
    for (int a = 1; a < n; a++) // insertion sort by (key, parent rank)
      for (int b = a; b > 0; b--) {
        struct part *x = &o->parts[order[b - 1]], *y = &o->parts[order[b]];
        if (x->key > y->key || (x->key == y->key && order[b - 1] > order[b])) {
          int t = order[b - 1]; order[b - 1] = order[b]; order[b] = t;
        } else break;
      }
    struct group *g = calloc(1, sizeof *g);
    memset(g->id, 0xff, 128);
    g->nranks = n;
    g->joined = n;
    g->members = calloc(n, sizeof *g->members);
    g->sends = calloc((size_t)n * n, sizeof(long));
    g->recvs = calloc((size_t)n * n, sizeof(long));
    g->next = groups;
    groups = g;
    for (int r = 0; r < n; r++) {
      struct comm *nc = o->parts[order[r]].newcomm;
      nc->g = g;
      nc->rank = r;
      nc->nranks = n;
      nc->ready = 1;
      g->members[r] = nc;
    }
  }
  (void)parent;
  free(done);
}

EXPORT ncclResult_t ncclCommSplit(void *h, int color, int key, void **newcomm, void *cfg) {
  LOCK;
  logf_("ncclCommSplit comm=0x%lx color=%d key=%d config=0x%lx", PTR(h), color, key, PTR(cfg));
  INJECT("ncclCommSplit");
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommSplit")) RET(ncclInvalidArgument);
  if (color < -1) RET(ncclInvalidArgument);
  long seq = ++c->coll_seq;
  struct op *o = find_or_add_op(K_SPLIT, c->g, seq, -1, -1, c->nranks);
  struct part *pt = &o->parts[c->rank];
  pt->op = o;
  pt->c = c;
  pt->posted = 1; // not on a stream
  pt->color = color;
  pt->key = key;
  pt->newcomm = NULL;
  *newcomm = NULL;
  if (color >= 0) {
    struct comm *nc = new_comm(c->blocking);
    nc->dev = c->dev;
    pt->newcomm = nc;
    *newcomm = nc;
  }
  o->nreg++;
  progress();
  if (c->blocking && pt->newcomm) {
    if (!wait_until(comm_ready_v, pt->newcomm)) RET(ncclSystemError);
    pt->newcomm->state = ncclSuccess;
  }
  RET(c->blocking ? ncclSuccess : ncclInProgress);
}

// cancel_parts marks c's unfinished work done (its kernels are gone).
static void cancel_parts(struct comm *c) {
  for (struct op *o = ops; o; o = o->next) {
    if (o->executed) continue;
    for (int i = 0; i < o->nparts; i++) {
      if (o->parts[i].c == c && !o->parts[i].done) {
        o->parts[i].done = 1;
        o->dead = 1;
      }
    }
  }
  c->nunposted = 0;
}

EXPORT ncclResult_t ncclCommAbort(void *h) {
  pthread_mutex_lock(&mu);
  int delay = fake_abort_delay_us;
  pthread_mutex_unlock(&mu);
  if (delay > 0) {
    struct timespec ts = {delay / 1000000, (long)(delay % 1000000) * 1000};
    nanosleep(&ts, NULL);
  }
  LOCK;
  logf_("ncclCommAbort comm=0x%lx", PTR(h));
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommAbort")) RET(ncclInvalidArgument);
  c->aborted = 1;
  c->destroyed = 1;
  live_comms--;
  if (c->g) c->g->broken = 1;
  cancel_parts(c);
  progress();
  RET(ncclSuccess);
}

EXPORT ncclResult_t ncclCommFinalize(void *h) {
  LOCK;
  logf_("ncclCommFinalize comm=0x%lx", PTR(h));
  INJECT("ncclCommFinalize");
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommFinalize")) RET(ncclInvalidArgument);
  if (c->blocking) RET(ncclSuccess);
  c->state = ncclInProgress;
  c->polls = fake_settle_polls;
  RET(ncclInProgress);
}

EXPORT ncclResult_t ncclCommDestroy(void *h) {
  LOCK;
  logf_("ncclCommDestroy comm=0x%lx", PTR(h));
  struct comm *c = find_comm((uintptr_t)h);
  if (!comm_ok(c, "ncclCommDestroy")) RET(ncclInvalidArgument);
  for (struct op *o = ops; o; o = o->next)
    for (int i = 0; i < o->nparts; i++)
      if (o->parts[i].c == c && !o->parts[i].done && !o->dead) logf_("DESTROY-PENDING comm=0x%lx", PTR(h));
  c->destroyed = 1;
  live_comms--;
  RET(ncclSuccess);
}

// fake_live reports live resources: what = "allocs", "streams", "events",
// "comms", "ctxrefs".
EXPORT int fake_live(const char *what) {
  LOCK;
  int n = -1;
  if (!strcmp(what, "allocs")) n = live_allocs;
  else if (!strcmp(what, "streams")) n = live_streams;
  else if (!strcmp(what, "events")) n = live_events;
  else if (!strcmp(what, "comms")) n = live_comms;
  else if (!strcmp(what, "ctxrefs")) { n = 0; for (int i = 0; i < 64; i++) n += ctxs[i].refs; }
  UNLOCK;
  return n;
}

// fake_reset clears the log, injections and settings (not live objects).
EXPORT void fake_reset(void) {
  LOCK;
  loglen = 0;
  if (logbuf) logbuf[0] = 0;
  ninjects = 0;
  async_rank = -2;
  fake_version_ = 22803;
  fake_settle_polls = 2;
  fake_abort_propagates = 1;
  fake_abort_delay_us = 0;
  last_error[0] = 0;
  async_polls = 0;
  UNLOCK;
}
