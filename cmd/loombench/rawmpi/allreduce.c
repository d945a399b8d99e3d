/*
 * allreduce.c: the raw Open MPI reference for loombench -backend mpi.
 *
 * It times MPI_Allreduce (float32, sum, out of place), or with -nb
 * MPI_Iallreduce then MPI_Wait (what loom's default, nonblocking call mode
 * issues), exactly as loombench
 * times an operation: warmup iterations, then timed iterations, each timed
 * on every rank; an iteration counts as the slowest rank's time (an
 * MPI_Allreduce of the times with MPI_MAX after the loop), and the result
 * is the median over iterations. Rank 0 prints one line per size:
 *
 *   raw-mpi allreduce <nranks> <bytes> <median_us>
 *
 * Build and run (compare_mpi.sh does both):
 *   mpicc -O2 -o /tmp/rawmpi cmd/loombench/rawmpi/allreduce.c
 *   mpirun -np 4 /tmp/rawmpi 20 5 1048576 67108864
 * Arguments: [-page] [-nb] iterations, warmup, then sizes in bytes.
 *
 * Buffers come from malloc, or with -page on page boundaries, as Go's
 * allocator places large buffers (loombench's among them). The placement
 * matters: with both buffers page aligned, Open MPI's 64 MiB allreduce on
 * two processes here runs about 30% slower than on malloc's buffers
 * (which start 16 bytes past a page), so only -page compares like with
 * like.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

// alloc returns n bytes (at least 1) from malloc, or page aligned.
static void *alloc(size_t n, int page) {
	void *p = NULL;
	if (n == 0) n = 1;
	if (!page) return malloc(n);
	if (posix_memalign(&p, (size_t)sysconf(_SC_PAGESIZE), n) != 0) return NULL;
	return p;
}

static int cmp(const void *a, const void *b) {
	double x = *(const double *)a, y = *(const double *)b;
	return (x > y) - (x < y);
}

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	int rank, size;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	int page = 0, nb = 0;
	for (; argc > 1 && argv[1][0] == '-'; argv++, argc--) {
		if (strcmp(argv[1], "-page") == 0) {
			page = 1;
		} else if (strcmp(argv[1], "-nb") == 0) {
			nb = 1;
		} else {
			break;
		}
	}
	if (argc < 4) {
		if (rank == 0)
			fprintf(stderr, "usage: %s [-page] [-nb] iters warmup bytes...\n", argv[0]);
		MPI_Finalize();
		return 2;
	}
	int iters = atoi(argv[1]), warmup = atoi(argv[2]);
	if (iters < 1 || warmup < 0) {
		if (rank == 0)
			fprintf(stderr, "bad iters or warmup\n");
		MPI_Finalize();
		return 2;
	}
	double *t = malloc(sizeof(double) * iters);
	for (int a = 3; a < argc; a++) {
		long bytes = atol(argv[a]);
		int n = (int)(bytes / 4);
		float *send = alloc(sizeof(float) * n, page);
		float *recv = alloc(sizeof(float) * n, page);
		if (!send || !recv || !t) {
			fprintf(stderr, "out of memory\n");
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		for (int i = 0; i < n; i++)
			send[i] = (float)(i % 7);
		for (int i = 0; i < warmup + iters; i++) {
			double t0 = MPI_Wtime();
			if (nb) {
				MPI_Request req;
				MPI_Iallreduce(send, recv, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, &req);
				MPI_Wait(&req, MPI_STATUS_IGNORE);
			} else {
				MPI_Allreduce(send, recv, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
			}
			if (i >= warmup)
				t[i - warmup] = MPI_Wtime() - t0;
		}
		MPI_Allreduce(MPI_IN_PLACE, t, iters, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
		qsort(t, iters, sizeof(double), cmp);
		double med = iters % 2 ? t[iters / 2] : (t[iters / 2 - 1] + t[iters / 2]) / 2;
		if (rank == 0)
			printf("raw-mpi %s %d %ld %.1f\n", nb ? "iallreduce" : "allreduce", size, bytes, med * 1e6);
		free(send);
		free(recv);
	}
	free(t);
	MPI_Finalize();
	return 0;
}
