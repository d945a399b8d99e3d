//go:build mpi

#include "loom_mpi.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int loom_init_thread(int *provided) {
	return MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
}
int loom_thread_multiple(void) { return MPI_THREAD_MULTIPLE; }
int loom_thread_serialized(void) { return MPI_THREAD_SERIALIZED; }
int loom_thread_funneled(void) { return MPI_THREAD_FUNNELED; }

MPI_Comm loom_comm_world(void) { return MPI_COMM_WORLD; }
MPI_Comm loom_comm_null(void) { return MPI_COMM_NULL; }
int loom_comm_is_null(MPI_Comm c) { return c == MPI_COMM_NULL; }
MPI_Request loom_request_null(void) { return MPI_REQUEST_NULL; }
void *loom_in_place(void) { return MPI_IN_PLACE; }
int loom_undefined(void) { return MPI_UNDEFINED; }
int loom_any_source(void) { return MPI_ANY_SOURCE; }
int loom_success(void) { return MPI_SUCCESS; }
int loom_set_errors_return(MPI_Comm c) { return MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN); }
MPI_Op loom_bor(void) { return MPI_BOR; }

int loom_test_recv(MPI_Request *req, int *flag, int *count, MPI_Datatype dt) {
	MPI_Status st;
	int rc = MPI_Test(req, flag, &st);
	if (rc != MPI_SUCCESS || !*flag) return rc;
	return MPI_Get_count(&st, dt, count);
}

int loom_cancel_wait(MPI_Request *req) {
	int rc = MPI_Cancel(req);
	if (rc != MPI_SUCCESS) return rc;
	return MPI_Wait(req, MPI_STATUS_IGNORE);
}

int loom_tag_ub(void) {
	void *v = NULL;
	int flag = 0;
	if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag) != MPI_SUCCESS || !flag || v == NULL) {
		return 32767; // the minimum the standard guarantees
	}
	return *(int *)v;
}

MPI_Datatype loom_dtype(int code) {
	switch (code) {
	case 1: return MPI_FLOAT;
	case 2: return MPI_DOUBLE;
	case 3: return MPI_UINT16_T;
	case 4: return MPI_UINT16_T;
	case 5: return MPI_INT32_T;
	case 6: return MPI_INT64_T;
	case 7: return MPI_UINT8_T;
	}
	return MPI_DATATYPE_NULL;
}
MPI_Datatype loom_byte(void) { return MPI_BYTE; }
MPI_Datatype loom_int64(void) { return MPI_INT64_T; }
MPI_Datatype loom_int(void) { return MPI_INT; }

// ---- 16-bit floats, bit-exact with package comm's conversions ----

static inline float bf16_to_f32(uint16_t h) {
	uint32_t b = (uint32_t)h << 16;
	float f;
	memcpy(&f, &b, 4);
	return f;
}

unsigned short loom_f32_to_bf16(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	if ((b & 0x7fffffffu) > 0x7f800000u) {
		return (uint16_t)((b >> 16) | 0x40);
	}
	uint32_t rounding = 0x7fffu + ((b >> 16) & 1u);
	return (uint16_t)((b + rounding) >> 16);
}

float loom_f16_to_f32(unsigned short h) {
	uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
	uint32_t exp = ((uint32_t)h >> 10) & 0x1fu;
	uint32_t mant = (uint32_t)h & 0x3ffu;
	uint32_t b;
	if (exp == 0x1f) {
		b = sign | 0x7f800000u | (mant << 13);
	} else if (exp != 0) {
		b = sign | ((exp + 112) << 23) | (mant << 13);
	} else if (mant == 0) {
		b = sign;
	} else {
		uint32_t e = 113;
		while ((mant & 0x400u) == 0) {
			mant <<= 1;
			e--;
		}
		b = sign | (e << 23) | ((mant & 0x3ffu) << 13);
	}
	float f;
	memcpy(&f, &b, 4);
	return f;
}

unsigned short loom_f32_to_f16(float f) {
	uint32_t b;
	memcpy(&b, &f, 4);
	uint16_t sign = (uint16_t)(b >> 16) & 0x8000u;
	int32_t exp = (int32_t)((b >> 23) & 0xffu);
	uint32_t mant = b & 0x7fffffu;
	if (exp == 0xff) {
		/* A NaN stays quiet with its leading payload bits, as in Go's
		   internal/half (and x86's vcvtps2ph), so both backends agree. */
		return mant != 0 ? (uint16_t)(sign | 0x7e00u | (mant >> 13)) : (uint16_t)(sign | 0x7c00u);
	}
	if (exp > 142) {
		return (uint16_t)(sign | 0x7c00u);
	}
	if (exp >= 113) {
		uint32_t h = ((uint32_t)(exp - 112) << 10) | (mant >> 13);
		uint32_t rest = mant & 0x1fffu;
		if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) {
			h++;
		}
		return (uint16_t)(sign | h);
	}
	if (exp >= 102) {
		uint32_t m = mant | 0x800000u;
		uint32_t shift = (uint32_t)(126 - exp);
		uint32_t h = m >> shift;
		uint32_t rest = m & ((1u << shift) - 1u);
		uint32_t half = 1u << (shift - 1);
		if (rest > half || (rest == half && (h & 1u))) {
			h++;
		}
		return (uint16_t)(sign | h);
	}
	return sign;
}

// NaN-propagating min and max, as package comm's kernels do.
static inline float fmin_nan(float x, float y) {
	if (x != x) return x;
	if (y != y || y < x) return y;
	return x;
}
static inline float fmax_nan(float x, float y) {
	if (x != x) return x;
	if (y != y || y > x) return y;
	return x;
}

#define HALF_OP(NAME, WIDEN, NARROW, EXPR)                                      \
	static void NAME(void *in, void *inout, int *len, MPI_Datatype *dt) {   \
		(void)dt;                                                       \
		const uint16_t *a = (const uint16_t *)in;                       \
		uint16_t *b = (uint16_t *)inout;                                \
		int n = *len;                                                   \
		for (int i = 0; i < n; i++) {                                   \
			float x = WIDEN(a[i]), y = WIDEN(b[i]);                 \
			b[i] = NARROW(EXPR);                                    \
		}                                                               \
	}

HALF_OP(bf16_sum, bf16_to_f32, loom_f32_to_bf16, x + y)
HALF_OP(bf16_prod, bf16_to_f32, loom_f32_to_bf16, x * y)
HALF_OP(bf16_min, bf16_to_f32, loom_f32_to_bf16, fmin_nan(x, y))
HALF_OP(bf16_max, bf16_to_f32, loom_f32_to_bf16, fmax_nan(x, y))
HALF_OP(f16_sum, loom_f16_to_f32, loom_f32_to_f16, x + y)
HALF_OP(f16_prod, loom_f16_to_f32, loom_f32_to_f16, x * y)
HALF_OP(f16_min, loom_f16_to_f32, loom_f32_to_f16, fmin_nan(x, y))
HALF_OP(f16_max, loom_f16_to_f32, loom_f32_to_f16, fmax_nan(x, y))

// Open MPI 4.1's vectorised MPI_SUM on MPI_UINT8_T saturates at 255 instead
// of wrapping (op/avx), so uint8 sum and prod use these user operators,
// which wrap modulo 256 like C and comm/local.
static void u8_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
	(void)dt;
	const uint8_t *a = (const uint8_t *)in;
	uint8_t *b = (uint8_t *)inout;
	int n = *len;
	for (int i = 0; i < n; i++) b[i] = (uint8_t)(a[i] + b[i]);
}
static void u8_prod(void *in, void *inout, int *len, MPI_Datatype *dt) {
	(void)dt;
	const uint8_t *a = (const uint8_t *)in;
	uint8_t *b = (uint8_t *)inout;
	int n = *len;
	for (int i = 0; i < n; i++) b[i] = (uint8_t)(a[i] * b[i]);
}
static MPI_Op u8_ops[2];

// half_ops[t][k]: t 0 bfloat16, 1 float16; k 0 sum, 1 prod, 2 min, 3 max.
static MPI_Op half_ops[2][4];
static int half_ops_ready;

int loom_create_half_ops(void) {
	MPI_User_function *fns[2][4] = {
		{bf16_sum, bf16_prod, bf16_min, bf16_max},
		{f16_sum, f16_prod, f16_min, f16_max},
	};
	if (half_ops_ready) return MPI_SUCCESS;
	for (int t = 0; t < 2; t++) {
		for (int k = 0; k < 4; k++) {
			int rc = MPI_Op_create(fns[t][k], 1, &half_ops[t][k]);
			if (rc != MPI_SUCCESS) return rc;
		}
	}
	int rc = MPI_Op_create(u8_sum, 1, &u8_ops[0]);
	if (rc != MPI_SUCCESS) return rc;
	rc = MPI_Op_create(u8_prod, 1, &u8_ops[1]);
	if (rc != MPI_SUCCESS) return rc;
	half_ops_ready = 1;
	return MPI_SUCCESS;
}

void loom_free_half_ops(void) {
	if (!half_ops_ready) return;
	for (int t = 0; t < 2; t++) {
		for (int k = 0; k < 4; k++) {
			MPI_Op_free(&half_ops[t][k]);
		}
	}
	MPI_Op_free(&u8_ops[0]);
	MPI_Op_free(&u8_ops[1]);
	half_ops_ready = 0;
}

MPI_Op loom_op(int op, int dtype) {
	int k;
	switch (op) {
	case 1: case 2: k = 0; break; // sum, avg (divided afterwards)
	case 3: k = 1; break;
	case 4: k = 2; break;
	case 5: k = 3; break;
	default: return MPI_OP_NULL;
	}
	if (dtype == 3 || dtype == 4) {
		if (!half_ops_ready) return MPI_OP_NULL;
		return half_ops[dtype == 3 ? 0 : 1][k];
	}
	if (dtype == 7 && k <= 1) {
		if (!half_ops_ready) return MPI_OP_NULL;
		return u8_ops[k];
	}
	switch (k) {
	case 0: return MPI_SUM;
	case 1: return MPI_PROD;
	case 2: return MPI_MIN;
	default: return MPI_MAX;
	}
}

int loom_error_string(int code, char *buf, int len) {
	char tmp[MPI_MAX_ERROR_STRING];
	int n = 0;
	if (MPI_Error_string(code, tmp, &n) != MPI_SUCCESS) {
		return 0;
	}
	if (n >= len) n = len - 1;
	memcpy(buf, tmp, n);
	buf[n] = 0;
	return n;
}

int loom_test(MPI_Request *req, int *flag) {
	return MPI_Test(req, flag, MPI_STATUS_IGNORE);
}

int loom_testall(int n, MPI_Request *reqs, int *flag) {
	return MPI_Testall(n, reqs, flag, MPI_STATUSES_IGNORE);
}

// loom_testall_ctl is one pass of MPI's progress engine over reqs and,
// when ctl is not NULL, the notice receive *ctl: MPI_Testsome over both,
// so that a notice that arrived with the data is seen with it and no
// second pass (which would yield the processor when Open MPI runs
// oversubscribed) is needed to look for one. *flag = 1 when every one of
// reqs has completed (completed requests become MPI_REQUEST_NULL, as
// MPI_Testsome leaves them); *ctlflag = 1 when *ctl has, its status then
// in *st and *ctl MPI_REQUEST_NULL.
int loom_testall_ctl(int n, MPI_Request *reqs, MPI_Request *ctl, int *flag, int *ctlflag, MPI_Status *st) {
	*ctlflag = 0;
	if (ctl == NULL || *ctl == MPI_REQUEST_NULL) {
		return MPI_Testall(n, reqs, flag, MPI_STATUSES_IGNORE);
	}
	enum { small = 8 };
	MPI_Request rs[small + 1];
	int idx[small + 1];
	MPI_Status sts[small + 1];
	MPI_Request *all = rs;
	int *done = idx;
	MPI_Status *stat = sts;
	if (n > small) {
		all = malloc((n + 1) * sizeof *all);
		done = malloc((n + 1) * sizeof *done);
		stat = malloc((n + 1) * sizeof *stat);
		if (all == NULL || done == NULL || stat == NULL) {
			free(all);
			free(done);
			free(stat);
			return MPI_ERR_NO_MEM;
		}
	}
	memcpy(all, reqs, n * sizeof *all);
	all[n] = *ctl;
	int out = 0;
	int rc = MPI_Testsome(n + 1, all, &out, done, stat);
	memcpy(reqs, all, n * sizeof *all);
	*ctl = all[n];
	if (out != MPI_UNDEFINED) {
		for (int i = 0; i < out; i++) {
			if (done[i] == n) {
				*ctlflag = 1;
				*st = stat[i];
			}
		}
	}
	*flag = 1;
	for (int i = 0; i < n; i++) {
		if (reqs[i] != MPI_REQUEST_NULL) *flag = 0;
	}
	if (all != rs) {
		free(all);
		free(done);
		free(stat);
	}
	return rc;
}

// loom_testall_for runs loom_testall_ctl until reqs complete (*flag = 1),
// the notice receive completes (*ctlflag = 1, as loom_testall_ctl), or
// usec microseconds pass: MPI_Wait's loop, bounded so that the caller can
// look at its context in between. Each pass runs MPI's progress engine
// once (which yields the processor when Open MPI runs oversubscribed, as
// MPI_Wait does).
int loom_testall_for(int n, MPI_Request *reqs, MPI_Request *ctl, int *flag, int *ctlflag, MPI_Status *st, int usec) {
	double end = MPI_Wtime() + usec * 1e-6;
	for (int i = 1;; i++) {
		int rc = loom_testall_ctl(n, reqs, ctl, flag, ctlflag, st);
		if (rc != MPI_SUCCESS || *flag || *ctlflag) return rc;
		if ((i & 63) == 0 && MPI_Wtime() >= end) return MPI_SUCCESS;
	}
}

// ---- collectives, blocking when req is NULL ----

int loom_allreduce(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Iallreduce(s, r, n, dt, op, c, req) : MPI_Allreduce(s, r, n, dt, op, c);
}
int loom_bcast(void *b, int n, MPI_Datatype dt, int root, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ibcast(b, n, dt, root, c, req) : MPI_Bcast(b, n, dt, root, c);
}
int loom_reduce(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, int root, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ireduce(s, r, n, dt, op, root, c, req) : MPI_Reduce(s, r, n, dt, op, root, c);
}
int loom_allgather(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Iallgather(s, sn, sdt, r, rn, rdt, c, req) : MPI_Allgather(s, sn, sdt, r, rn, rdt, c);
}
int loom_reduce_scatter_block(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ireduce_scatter_block(s, r, n, dt, op, c, req) : MPI_Reduce_scatter_block(s, r, n, dt, op, c);
}
int loom_gather(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, int root, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Igather(s, sn, sdt, r, rn, rdt, root, c, req) : MPI_Gather(s, sn, sdt, r, rn, rdt, root, c);
}
int loom_scatter(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, int root, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Iscatter(s, sn, sdt, r, rn, rdt, root, c, req) : MPI_Scatter(s, sn, sdt, r, rn, rdt, root, c);
}
int loom_alltoall(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ialltoall(s, sn, sdt, r, rn, rdt, c, req) : MPI_Alltoall(s, sn, sdt, r, rn, rdt, c);
}
int loom_alltoallv(const void *s, const int *sc, const int *sd, MPI_Datatype sdt, void *r, const int *rc, const int *rd, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ialltoallv(s, sc, sd, sdt, r, rc, rd, rdt, c, req) : MPI_Alltoallv(s, sc, sd, sdt, r, rc, rd, rdt, c);
}
int loom_barrier(MPI_Comm c, MPI_Request *req) {
	return req ? MPI_Ibarrier(c, req) : MPI_Barrier(c);
}
