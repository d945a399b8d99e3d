// fakecublas.cpp: cuBLAS and cuBLASLt at their C ABI, on the host, for
// the tests of device/cuda's binding (cublas_fake_test.go). The test builds
// it with g++ into a .so and loads it as both libraries.
//
// "Device memory" is host memory from fake_malloc; every operand a GEMM
// reads or writes must lie inside one live block, and every leading
// dimension must cover the rows of its column-major operand, or the call
// fails with CUBLAS_STATUS_INVALID_VALUE (real cuBLAS would read out
// of bounds instead: the fake is stricter on purpose). GEMMs run in double:
// bf16 is widened bit-exactly, TF32 compute rounds the inputs to 10
// mantissa bits (ties to even), results are rounded to C's type. Every
// call goes to a text log of "name key=value ..." lines (fake_log), which
// the tests read to check what the binding passed.
//
// Injection: fake_fail(symbol, status, n) makes the next n calls of symbol
// return status; fake_set_version(lib, major, minor, patch) changes what
// the version probes report; fake_set_heuristic(n) sets how many
// algorithms cublasLtMatmulAlgoGetHeuristic returns (default 1).

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

// Hooks of the whole-device fake: fakecuda.cpp built with LOOM_FAKE_DEVICE
// and linked into the same library defines them, and then device memory
// is the fake driver's allocations and GEMMs run in their stream's order;
// alone, this file keeps its own blocks (fake_malloc) and computes at the
// call.
bool fake_device_in_block(uintptr_t p, size_t bytes) __attribute__((weak));
int fake_device_enqueue(void *stream, std::function<void()> f) __attribute__((weak));

typedef int cublasStatus_t;
enum {
	ST_SUCCESS = 0,
	ST_NOT_INITIALIZED = 1,
	ST_INVALID_VALUE = 7,
	ST_EXECUTION_FAILED = 13,
	ST_NOT_SUPPORTED = 15,
};
enum { R_32F = 0, R_64F = 1, R_16BF = 14 };
enum { COMPUTE_32F = 68, COMPUTE_32F_PEDANTIC = 69, COMPUTE_64F = 70, COMPUTE_32F_FAST_TF32 = 77 };

struct cublasLtMatmulAlgo_t {
	uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
	cublasLtMatmulAlgo_t algo;
	size_t workspaceSize;
	cublasStatus_t state;
	float wavesCount;
	int reserved[4];
};
static_assert(sizeof(cublasLtMatmulAlgo_t) == 64, "cublasLtMatmulAlgo_t is 64 bytes");
static_assert(sizeof(cublasLtMatmulHeuristicResult_t) == 96, "cublasLtMatmulHeuristicResult_t is 96 bytes");

namespace {

std::mutex mu;
std::string logText;
std::map<uintptr_t, size_t> blocks; // fake device memory: address -> bytes
std::map<std::string, std::pair<int, int>> failures; // symbol -> (status, calls left)
std::map<std::string, long> live; // kind -> live objects
int version[3] = {12, 4, 5};
size_t ltVersion = 120405;
int heuristicResults = 1;
const uint64_t algoMagic = 0x6c6f6f6d616c676fULL; // "loomalgo"
const size_t algoWorkspace = 4096;                 // what the fake's algorithm asks for

// logf appends one line to the log.
void logf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void logf(const char* fmt, ...) {
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof buf, fmt, ap);
	va_end(ap);
	logText += buf;
	logText += '\n';
}

// injected returns the status to fail symbol with, or 0.
int injected(const char* symbol) {
	auto it = failures.find(symbol);
	if (it == failures.end() || it->second.second <= 0) return 0;
	it->second.second--;
	return it->second.first;
}

// inBlock reports whether [p, p+bytes) lies in one live block.
bool inBlock(uintptr_t p, size_t bytes) {
	if (fake_device_in_block) return fake_device_in_block(p, bytes);
	auto it = blocks.upper_bound(p);
	if (it == blocks.begin()) return false;
	--it;
	return p >= it->first && p - it->first + bytes <= it->second;
}

size_t typeSize(int t) {
	switch (t) {
	case R_32F: return 4;
	case R_64F: return 8;
	case R_16BF: return 2;
	}
	return 0;
}

float bf16ToFloat(uint16_t h) {
	uint32_t b = uint32_t(h) << 16;
	float f;
	memcpy(&f, &b, 4);
	return f;
}

// floatToBF16 rounds to nearest, ties to even, as internal/half does.
uint16_t floatToBF16(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	if ((b & 0x7fffffff) > 0x7f800000) return uint16_t(b >> 16) | 0x40;
	return uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

// tf32 rounds f to 10 mantissa bits, ties to even.
float tf32(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	if ((b & 0x7f800000) != 0x7f800000) b = (b + 0xfff + ((b >> 13) & 1)) & ~0x1fffu;
	memcpy(&f, &b, 4);
	return f;
}

double load(const void* base, int t, size_t i) {
	switch (t) {
	case R_32F: return ((const float*)base)[i];
	case R_64F: return ((const double*)base)[i];
	case R_16BF: return bf16ToFloat(((const uint16_t*)base)[i]);
	}
	return 0;
}

void store(void* base, int t, size_t i, double v) {
	switch (t) {
	case R_32F: ((float*)base)[i] = float(v); break;
	case R_64F: ((double*)base)[i] = v; break;
	case R_16BF: ((uint16_t*)base)[i] = floatToBF16(float(v)); break;
	}
}

// Operand is one column-major matrix of a GEMM.
struct Operand {
	const char* name;
	uintptr_t p;
	int type;
	long long rows, cols, ld, stride;
};

// checkOperand: ld covers the rows and every matrix of the batch lies in
// one live block.
bool checkOperand(const Operand& o, int batch, std::string& why) {
	char buf[256];
	if (o.ld < (o.rows > 1 ? o.rows : 1)) {
		snprintf(buf, sizeof buf, "%s: ld %lld < rows %lld", o.name, o.ld, o.rows);
		why = buf;
		return false;
	}
	if (o.rows == 0 || o.cols == 0) return true;
	size_t es = typeSize(o.type);
	size_t last = size_t((batch - 1) * o.stride + (o.cols - 1) * o.ld + o.rows);
	if (o.p == 0 || !inBlock(o.p, last * es)) {
		snprintf(buf, sizeof buf, "%s: %#lx + %zu bytes is not in a live block", o.name, (unsigned long)o.p, last * es);
		why = buf;
		return false;
	}
	return true;
}

// Gemm is one call after argument parsing, shared by cuBLAS and cuBLASLt.
struct Gemm {
	int ta, tb;
	long long m, n, k;
	Operand a, b, c, d;
	int batch, compute;
	const void *alpha, *beta;
	int epilogue;  // 1 default, 4 bias, 256 bgrada, 512 bgradb
	uintptr_t bias;
	double alphaV, betaV;  // *alpha and *beta, read at the call
};

// validTypes checks the combinations loom uses.
bool validTypes(const Gemm& g) {
	if (g.a.type != g.b.type || g.c.type != g.d.type) return false;
	switch (g.compute) {
	case COMPUTE_32F:
	case COMPUTE_32F_PEDANTIC:
		return (g.a.type == R_32F && g.c.type == R_32F) || (g.a.type == R_16BF && (g.c.type == R_32F || g.c.type == R_16BF));
	case COMPUTE_32F_FAST_TF32: return g.a.type == R_32F && g.c.type == R_32F;
	case COMPUTE_64F: return g.a.type == R_64F && g.c.type == R_64F;
	}
	return false;
}

void compute(const Gemm& g);

// run checks g's operands and computes it, at once or, in the whole-device
// fake, in stream's order; a nonzero status on failure.
int run(Gemm& g, const char* call, void* stream) {
	std::string why;
	if (!validTypes(g)) {
		logf("%s error=types", call);
		return ST_INVALID_VALUE;
	}
	if (g.m < 0 || g.n < 0 || g.k < 0 || g.batch < 1 || !checkOperand(g.a, g.batch, why) || !checkOperand(g.b, g.batch, why) ||
	    !checkOperand(g.c, g.batch, why) || !checkOperand(g.d, g.batch, why)) {
		logf("%s error=%s", call, why.c_str());
		return ST_INVALID_VALUE;
	}
	size_t biasLen = g.epilogue == 4 || g.epilogue == 256 ? g.m : g.epilogue == 512 ? g.n : 0;
	if (biasLen > 0 && (g.bias == 0 || !inBlock(g.bias, biasLen * typeSize(g.d.type)))) {
		logf("%s error=bias %#lx not in a live block", call, (unsigned long)g.bias);
		return ST_INVALID_VALUE;
	}
	bool f64 = g.compute == COMPUTE_64F;
	g.alphaV = f64 ? *(const double*)g.alpha : *(const float*)g.alpha;
	g.betaV = f64 ? *(const double*)g.beta : *(const float*)g.beta;
	g.alpha = g.beta = nullptr;  // host memory of the caller, gone after the call
	if (fake_device_enqueue) {
		Gemm c = g;
		return fake_device_enqueue(stream, [c] { compute(c); }) == 0 ? ST_SUCCESS : ST_EXECUTION_FAILED;
	}
	compute(g);
	return ST_SUCCESS;
}

// compute runs a checked GEMM.
void compute(const Gemm& g) {
	const double alpha = g.alphaV, beta = g.betaV;
	bool round = g.compute == COMPUTE_32F_FAST_TF32;
	auto in = [&](const Operand& o, long long bi, long long r, long long c) {
		double v = load((const void*)o.p, o.type, size_t(bi * o.stride + c * o.ld + r));
		return round ? double(tf32(float(v))) : v;
	};
	for (long long bi = 0; bi < g.batch; bi++) {
		for (long long j = 0; j < g.n; j++) {
			for (long long i = 0; i < g.m; i++) {
				double s = 0;
				for (long long p = 0; p < g.k; p++) {
					double x = g.ta ? in(g.a, bi, p, i) : in(g.a, bi, i, p);
					double y = g.tb ? in(g.b, bi, j, p) : in(g.b, bi, p, j);
					s += x * y;
				}
				double v = alpha * s;
				if (beta != 0) v += beta * load((const void*)g.c.p, g.c.type, size_t(bi * g.c.stride + j * g.c.ld + i));
				if (g.epilogue == 4) v += load((const void*)g.bias, g.d.type, size_t(i));
				store((void*)g.d.p, g.d.type, size_t(bi * g.d.stride + j * g.d.ld + i), v);
			}
		}
	}
	// Bias gradients: sums over k of op(A)'s rows (BGRADA) or op(B)'s
	// columns (BGRADB), unscaled.
	if (g.epilogue == 256) {
		for (long long i = 0; i < g.m; i++) {
			double s = 0;
			for (long long p = 0; p < g.k; p++) s += g.ta ? in(g.a, 0, p, i) : in(g.a, 0, i, p);
			store((void*)g.bias, g.d.type, size_t(i), s);
		}
	} else if (g.epilogue == 512) {
		for (long long j = 0; j < g.n; j++) {
			double s = 0;
			for (long long p = 0; p < g.k; p++) s += g.tb ? in(g.b, 0, j, p) : in(g.b, 0, p, j);
			store((void*)g.bias, g.d.type, size_t(j), s);
		}
	}
}

const char* opName(int op) { return op == 0 ? "N" : op == 1 ? "T" : "?"; }

struct Handle {
	uint64_t magic;
	uintptr_t stream, ws;
	size_t wsBytes;
};
const uint64_t handleMagic = 0x6375626c61730001ULL;
const uint64_t ltHandleMagic = 0x6375626c61730002ULL;

Handle* handleOf(void* h, uint64_t magic) {
	Handle* p = (Handle*)h;
	return p != nullptr && p->magic == magic ? p : nullptr;
}

struct Desc {
	int compute, scale, ta, tb;
	uint32_t epilogue;
	uintptr_t bias;
};
struct Layout {
	int type;
	uint64_t rows, cols;
	int64_t ld;
};
struct Pref {
	uint64_t maxWorkspace;
};

} // namespace

#define FAIL_IF_INJECTED(sym)            \
	do {                                   \
		int st_ = injected(sym);             \
		if (st_ != 0) {                      \
			logf("%s injected=%d", sym, st_); \
			return st_;                        \
		}                                    \
	} while (0)

extern "C" {

// ---- test controls ----

void* fake_malloc(size_t bytes) {
	std::lock_guard<std::mutex> l(mu);
	void* p = calloc(bytes ? bytes : 1, 1);
	blocks[(uintptr_t)p] = bytes;
	return p;
}

int fake_free(void* p) {
	std::lock_guard<std::mutex> l(mu);
	if (blocks.erase((uintptr_t)p) == 0) return 1;
	free(p);
	return 0;
}

const char* fake_log(void) {
	std::lock_guard<std::mutex> l(mu);
	static std::string copy;
	copy = logText;
	return copy.c_str();
}

void fake_log_reset(void) {
	std::lock_guard<std::mutex> l(mu);
	logText.clear();
}

void fake_fail(const char* symbol, int status, int n) {
	std::lock_guard<std::mutex> l(mu);
	failures[symbol] = {status, n};
}

void fake_set_version(const char* lib, int major, int minor, int patch) {
	std::lock_guard<std::mutex> l(mu);
	if (strcmp(lib, "cublasLt") == 0) {
		ltVersion = size_t(major) * 10000 + size_t(minor) * 100 + size_t(patch);
	} else {
		version[0] = major, version[1] = minor, version[2] = patch;
	}
}

void fake_set_heuristic(int n) {
	std::lock_guard<std::mutex> l(mu);
	heuristicResults = n;
}

long fake_live(const char* kind) {
	std::lock_guard<std::mutex> l(mu);
	return live[kind];
}

int fake_sizeof_heuristic_result(void) { return int(sizeof(cublasLtMatmulHeuristicResult_t)); }

// ---- cuBLAS ----

cublasStatus_t cublasGetProperty(int type, int* value) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasGetProperty");
	if (type < 0 || type > 2 || value == nullptr) return ST_INVALID_VALUE;
	*value = version[type];
	return ST_SUCCESS;
}

const char* cublasGetStatusName(cublasStatus_t s) {
	switch (s) {
	case 0: return "CUBLAS_STATUS_SUCCESS";
	case 1: return "CUBLAS_STATUS_NOT_INITIALIZED";
	case 3: return "CUBLAS_STATUS_ALLOC_FAILED";
	case 7: return "CUBLAS_STATUS_INVALID_VALUE";
	case 13: return "CUBLAS_STATUS_EXECUTION_FAILED";
	case 15: return "CUBLAS_STATUS_NOT_SUPPORTED";
	}
	return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t s) {
	switch (s) {
	case 7: return "an unsupported value or parameter was passed to the function";
	case 13: return "the GPU program failed to execute";
	case 15: return "the functionality requested is not supported";
	}
	return "unknown error";
}

cublasStatus_t cublasCreate_v2(void** h) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasCreate_v2");
	Handle* p = new Handle{handleMagic, 0, 0, 0};
	*h = p;
	live["cublas_handle"]++;
	logf("cublasCreate_v2 handle=%p", (void*)p);
	return ST_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(void* h) {
	std::lock_guard<std::mutex> l(mu);
	Handle* p = handleOf(h, handleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasDestroy_v2 handle=%p", h);
	p->magic = 0;
	delete p;
	live["cublas_handle"]--;
	return ST_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(void* h, void* stream) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasSetStream_v2");
	Handle* p = handleOf(h, handleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	p->stream = (uintptr_t)stream;
	logf("cublasSetStream_v2 handle=%p stream=%#lx", h, (unsigned long)p->stream);
	return ST_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(void* h, void* ws, size_t bytes) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasSetWorkspace_v2");
	Handle* p = handleOf(h, handleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	if (bytes > 0 && !inBlock((uintptr_t)ws, bytes)) return ST_INVALID_VALUE;
	p->ws = (uintptr_t)ws, p->wsBytes = bytes;
	logf("cublasSetWorkspace_v2 handle=%p ws=%#lx bytes=%zu", h, (unsigned long)p->ws, bytes);
	return ST_SUCCESS;
}

// colMajor builds the operands of a cuBLAS GEMM, which are column-major:
// A is m×k (k×m transposed), B k×n (n×k), C m×n.
static Gemm colMajor(int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda, long long sa,
                     const void* B, int bt, int ldb, long long sb, const void* beta, void* C, int ct, int ldc, long long sc,
                     int batch, int compute) {
	Gemm g{};
	g.ta = ta, g.tb = tb, g.m = m, g.n = n, g.k = k;
	g.a = {"A", (uintptr_t)A, at, ta ? k : m, ta ? m : k, lda, sa};
	g.b = {"B", (uintptr_t)B, bt, tb ? n : k, tb ? k : n, ldb, sb};
	g.c = {"C", (uintptr_t)C, ct, m, n, ldc, sc};
	g.d = g.c;
	g.batch = batch, g.compute = compute, g.alpha = alpha, g.beta = beta, g.epilogue = 1;
	return g;
}

static std::string scalars(int compute, const void* alpha, const void* beta) {
	char buf[128];
	if (compute == COMPUTE_64F) {
		snprintf(buf, sizeof buf, "alpha=%.17g beta=%.17g", *(const double*)alpha, *(const double*)beta);
	} else {
		snprintf(buf, sizeof buf, "alpha=%.9g beta=%.9g", *(const float*)alpha, *(const float*)beta);
	}
	return buf;
}

cublasStatus_t cublasGemmEx(void* h, int transa, int transb, int m, int n, int k, const void* alpha, const void* A, int Atype,
                            int lda, const void* B, int Btype, int ldb, const void* beta, void* C, int Ctype, int ldc,
                            int computeType, int algo) {
	std::lock_guard<std::mutex> l(mu);
	Handle* p = handleOf(h, handleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasGemmEx handle=%p stream=%#lx transa=%s transb=%s m=%d n=%d k=%d lda=%d ldb=%d ldc=%d Atype=%d Btype=%d "
	     "Ctype=%d compute=%d algo=%d %s A=%p B=%p C=%p",
	     h, (unsigned long)p->stream, opName(transa), opName(transb), m, n, k, lda, ldb, ldc, Atype, Btype, Ctype, computeType,
	     algo, scalars(computeType, alpha, beta).c_str(), A, B, (void*)C);
	FAIL_IF_INJECTED("cublasGemmEx");
	if (transa < 0 || transa > 1 || transb < 0 || transb > 1 || algo != -1) return ST_INVALID_VALUE;
	Gemm g = colMajor(transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType);
	return run(g, "cublasGemmEx", (void*)p->stream);
}

cublasStatus_t cublasGemmStridedBatchedEx(void* h, int transa, int transb, int m, int n, int k, const void* alpha, const void* A,
                                          int Atype, int lda, long long strideA, const void* B, int Btype, int ldb,
                                          long long strideB, const void* beta, void* C, int Ctype, int ldc, long long strideC,
                                          int batchCount, int computeType, int algo) {
	std::lock_guard<std::mutex> l(mu);
	Handle* p = handleOf(h, handleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasGemmStridedBatchedEx handle=%p stream=%#lx transa=%s transb=%s m=%d n=%d k=%d lda=%d ldb=%d ldc=%d "
	     "strideA=%lld strideB=%lld strideC=%lld batch=%d Atype=%d Btype=%d Ctype=%d compute=%d algo=%d %s A=%p B=%p C=%p",
	     h, (unsigned long)p->stream, opName(transa), opName(transb), m, n, k, lda, ldb, ldc, strideA, strideB, strideC,
	     batchCount, Atype, Btype, Ctype, computeType, algo, scalars(computeType, alpha, beta).c_str(), A, B, (void*)C);
	FAIL_IF_INJECTED("cublasGemmStridedBatchedEx");
	if (transa < 0 || transa > 1 || transb < 0 || transb > 1 || algo != -1 || strideA < 0 || strideB < 0 || strideC < 0)
		return ST_INVALID_VALUE;
	Gemm g = colMajor(transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta, C, Ctype, ldc,
	                  strideC, batchCount, computeType);
	return run(g, "cublasGemmStridedBatchedEx", (void*)p->stream);
}

// ---- cuBLASLt ----

size_t cublasLtGetVersion(void) {
	std::lock_guard<std::mutex> l(mu);
	return ltVersion;
}

const char* cublasLtGetStatusName(cublasStatus_t s) { return cublasGetStatusName(s); }
const char* cublasLtGetStatusString(cublasStatus_t s) { return cublasGetStatusString(s); }

cublasStatus_t cublasLtCreate(void** h) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasLtCreate");
	Handle* p = new Handle{ltHandleMagic, 0, 0, 0};
	*h = p;
	live["lt_handle"]++;
	logf("cublasLtCreate handle=%p", (void*)p);
	return ST_SUCCESS;
}

cublasStatus_t cublasLtDestroy(void* h) {
	std::lock_guard<std::mutex> l(mu);
	Handle* p = handleOf(h, ltHandleMagic);
	if (p == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasLtDestroy handle=%p", h);
	p->magic = 0;
	delete p;
	live["lt_handle"]--;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(Desc** d, int compute, int scale) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasLtMatmulDescCreate");
	*d = new Desc{compute, scale, 0, 0, 1, 0};
	live["lt_desc"]++;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(Desc* d) {
	std::lock_guard<std::mutex> l(mu);
	delete d;
	live["lt_desc"]--;
	return ST_SUCCESS;
}

// cublasLtMatmulDescSetAttribute checks sizeInBytes against the
// attribute's C type, as cuBLASLt does.
cublasStatus_t cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasLtMatmulDescSetAttribute");
	auto want = [&](size_t n) { return size == n && buf != nullptr; };
	switch (attr) {
	case 0: if (!want(4)) return ST_INVALID_VALUE; d->compute = *(const int*)buf; break;
	case 1: if (!want(4)) return ST_INVALID_VALUE; d->scale = *(const int*)buf; break;
	case 3: if (!want(4)) return ST_INVALID_VALUE; d->ta = *(const int*)buf; break;
	case 4: if (!want(4)) return ST_INVALID_VALUE; d->tb = *(const int*)buf; break;
	case 7: if (!want(4)) return ST_INVALID_VALUE; d->epilogue = *(const uint32_t*)buf; break;
	case 8: if (!want(sizeof(void*))) return ST_INVALID_VALUE; d->bias = *(const uintptr_t*)buf; break;
	default: return ST_INVALID_VALUE;
	}
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutCreate(Layout** lay, int type, uint64_t rows, uint64_t cols, int64_t ld) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasLtMatrixLayoutCreate");
	if (typeSize(type) == 0) return ST_INVALID_VALUE;
	*lay = new Layout{type, rows, cols, ld};
	live["lt_layout"]++;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(Layout* lay) {
	std::lock_guard<std::mutex> l(mu);
	delete lay;
	live["lt_layout"]--;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(Pref** p) {
	std::lock_guard<std::mutex> l(mu);
	FAIL_IF_INJECTED("cublasLtMatmulPreferenceCreate");
	*p = new Pref{0};
	live["lt_pref"]++;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(Pref* p) {
	std::lock_guard<std::mutex> l(mu);
	delete p;
	live["lt_pref"]--;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(Pref* p, int attr, const void* buf, size_t size) {
	std::lock_guard<std::mutex> l(mu);
	if (attr != 1 || size != 8 || buf == nullptr) return ST_INVALID_VALUE;
	p->maxWorkspace = *(const uint64_t*)buf;
	return ST_SUCCESS;
}

static bool knownEpilogue(uint32_t e) { return e == 1 || e == 4 || e == 256 || e == 512; }

// layoutShape checks that a layout's rows/cols are what the transposes
// and the C/D layout imply.
static bool layoutsAgree(const Desc* d, const Layout* a, const Layout* b, const Layout* c) {
	uint64_t m = c->rows, n = c->cols;
	uint64_t k = d->ta ? a->rows : a->cols;
	uint64_t am = d->ta ? a->cols : a->rows;
	uint64_t bk = d->tb ? b->cols : b->rows, bn = d->tb ? b->rows : b->cols;
	return am == m && bk == k && bn == n;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(void* h, Desc* desc, Layout* a, Layout* b, Layout* c, Layout* d, Pref* pref,
                                              int requested, cublasLtMatmulHeuristicResult_t* results, int* returned) {
	std::lock_guard<std::mutex> l(mu);
	if (handleOf(h, ltHandleMagic) == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasLtMatmulAlgoGetHeuristic epilogue=%u maxWorkspace=%llu requested=%d", desc->epilogue,
	     (unsigned long long)pref->maxWorkspace, requested);
	FAIL_IF_INJECTED("cublasLtMatmulAlgoGetHeuristic");
	if (requested < 1 || results == nullptr || returned == nullptr || !layoutsAgree(desc, a, b, c) || c->rows != d->rows ||
	    c->cols != d->cols || c->ld != d->ld)
		return ST_INVALID_VALUE;
	if (!knownEpilogue(desc->epilogue)) return ST_NOT_SUPPORTED;
	int n = 0;
	if (pref->maxWorkspace >= algoWorkspace) {
		for (; n < requested && n < heuristicResults; n++) {
			cublasLtMatmulHeuristicResult_t r{};
			r.algo.data[0] = algoMagic;
			r.algo.data[1] = uint64_t(n);
			r.workspaceSize = algoWorkspace;
			r.state = ST_SUCCESS;
			r.wavesCount = 1;
			results[n] = r;
		}
	}
	*returned = n;
	return ST_SUCCESS;
}

cublasStatus_t cublasLtMatmul(void* h, Desc* desc, const void* alpha, const void* A, Layout* al, const void* B, Layout* bl,
                              const void* beta, const void* C, Layout* cl, void* D, Layout* dl, const cublasLtMatmulAlgo_t* algo,
                              void* ws, size_t wsBytes, void* stream) {
	std::lock_guard<std::mutex> l(mu);
	if (handleOf(h, ltHandleMagic) == nullptr) return ST_NOT_INITIALIZED;
	logf("cublasLtMatmul stream=%#lx transa=%s transb=%s m=%llu n=%llu k=%llu lda=%lld ldb=%lld ldc=%lld ldd=%lld Atype=%d "
	     "Btype=%d Ctype=%d Dtype=%d compute=%d scale=%d epilogue=%u bias=%p ws=%p wsBytes=%zu %s A=%p B=%p C=%p D=%p",
	     (unsigned long)(uintptr_t)stream, opName(desc->ta), opName(desc->tb), (unsigned long long)cl->rows,
	     (unsigned long long)cl->cols, (unsigned long long)(desc->ta ? al->rows : al->cols), (long long)al->ld,
	     (long long)bl->ld, (long long)cl->ld, (long long)dl->ld, al->type, bl->type, cl->type, dl->type, desc->compute,
	     desc->scale, desc->epilogue, (void*)desc->bias, ws, wsBytes, scalars(desc->compute, alpha, beta).c_str(), A, B, C, D);
	FAIL_IF_INJECTED("cublasLtMatmul");
	if (algo == nullptr || algo->data[0] != algoMagic || !layoutsAgree(desc, al, bl, cl)) return ST_INVALID_VALUE;
	if (wsBytes < algoWorkspace || !inBlock((uintptr_t)ws, wsBytes)) {
		logf("cublasLtMatmul error=workspace");
		return ST_INVALID_VALUE;
	}
	if ((desc->compute == COMPUTE_64F) != (desc->scale == R_64F)) return ST_INVALID_VALUE;
	if (!knownEpilogue(desc->epilogue)) return ST_NOT_SUPPORTED;
	Gemm g{};
	g.ta = desc->ta, g.tb = desc->tb;
	g.m = (long long)cl->rows, g.n = (long long)cl->cols;
	g.k = (long long)(desc->ta ? al->rows : al->cols);
	g.a = {"A", (uintptr_t)A, al->type, (long long)al->rows, (long long)al->cols, al->ld, 0};
	g.b = {"B", (uintptr_t)B, bl->type, (long long)bl->rows, (long long)bl->cols, bl->ld, 0};
	g.c = {"C", (uintptr_t)C, cl->type, (long long)cl->rows, (long long)cl->cols, cl->ld, 0};
	g.d = {"D", (uintptr_t)D, dl->type, (long long)dl->rows, (long long)dl->cols, dl->ld, 0};
	g.batch = 1, g.compute = desc->compute, g.alpha = alpha, g.beta = beta;
	g.epilogue = int(desc->epilogue), g.bias = desc->bias;
	return run(g, "cublasLtMatmul", stream);
}

} // extern "C"
