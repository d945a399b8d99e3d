// Helpers for the cgo binding in package mpi: functions for the handles that
// mpi.h defines as macros (Open MPI's expand to casts of &global, which cgo
// cannot use), and the 16-bit float reduction operators.
#ifndef LOOM_MPI_H
#define LOOM_MPI_H

#include <stdlib.h>
#include <string.h>
#include <mpi.h>

int loom_init_thread(int *provided);
int loom_thread_multiple(void);
int loom_thread_serialized(void);
int loom_thread_funneled(void);

MPI_Comm loom_comm_world(void);
MPI_Comm loom_comm_null(void);
int loom_comm_is_null(MPI_Comm c);
MPI_Request loom_request_null(void);
void *loom_in_place(void);
int loom_undefined(void);
int loom_any_source(void);
int loom_tag_ub(void);
int loom_success(void);
int loom_set_errors_return(MPI_Comm c);
MPI_Op loom_bor(void);
int loom_test_recv(MPI_Request *req, int *flag, int *count, MPI_Datatype dt);
int loom_cancel_wait(MPI_Request *req);

// loom_dtype maps comm.DType codes (1 float32, 2 float64, 3 bfloat16,
// 4 float16, 5 int32, 6 int64, 7 uint8) to MPI datatypes; 16-bit floats
// travel as MPI_UINT16_T.
MPI_Datatype loom_dtype(int code);
MPI_Datatype loom_byte(void);
MPI_Datatype loom_int64(void);
MPI_Datatype loom_int(void);

// loom_op maps comm.ReduceOp codes (1 sum, 3 prod, 4 min, 5 max) and a
// comm.DType code to an MPI_Op: the predefined operator, or for bfloat16
// and float16 a user operator that widens to float32, combines and rounds
// back to nearest even. Avg is reduced as sum; the caller divides.
MPI_Op loom_op(int op, int dtype);
int loom_create_half_ops(void);
void loom_free_half_ops(void);

// Exposed for tests: the C conversions must agree with package comm's.
unsigned short loom_f32_to_bf16(float f);
unsigned short loom_f32_to_f16(float f);
float loom_f16_to_f32(unsigned short h);

// The collectives, each in one function for both forms: with req non-NULL
// the nonblocking call (MPI_Iallreduce...) that posts req, with req NULL
// the blocking one (MPI_Allreduce...), so that one issuing path serves both.
int loom_allreduce(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, MPI_Comm c, MPI_Request *req);
int loom_bcast(void *b, int n, MPI_Datatype dt, int root, MPI_Comm c, MPI_Request *req);
int loom_reduce(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, int root, MPI_Comm c, MPI_Request *req);
int loom_allgather(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req);
int loom_reduce_scatter_block(const void *s, void *r, int n, MPI_Datatype dt, MPI_Op op, MPI_Comm c, MPI_Request *req);
int loom_gather(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, int root, MPI_Comm c, MPI_Request *req);
int loom_scatter(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, int root, MPI_Comm c, MPI_Request *req);
int loom_alltoall(const void *s, int sn, MPI_Datatype sdt, void *r, int rn, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req);
int loom_alltoallv(const void *s, const int *sc, const int *sd, MPI_Datatype sdt, void *r, const int *rc, const int *rd, MPI_Datatype rdt, MPI_Comm c, MPI_Request *req);
int loom_barrier(MPI_Comm c, MPI_Request *req);

int loom_error_string(int code, char *buf, int len);
int loom_test(MPI_Request *req, int *flag);
int loom_testall(int n, MPI_Request *reqs, int *flag);
int loom_testall_ctl(int n, MPI_Request *reqs, MPI_Request *ctl, int *flag, int *ctlflag, MPI_Status *st);
int loom_testall_for(int n, MPI_Request *reqs, MPI_Request *ctl, int *flag, int *ctlflag, MPI_Status *st, int usec);

#endif
