//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import "unsafe"

// This file holds the few cgo calls that the package's tests need and
// cannot make themselves (cgo is not allowed in _test.go files).

// rawAllReduceSum runs an in-place float32 sum allreduce on c's MPI
// communicator and waits for it, bypassing the backend: tests use it to
// complete, on a peer, a collective that an aborted communicator left
// posted. It uses c's call mode (MPI_Allreduce under WithBlockingCalls,
// else MPI_Iallreduce): MPI never matches a blocking collective with a
// nonblocking one.
func rawAllReduceSum(c *Comm, x []float32) error {
	p := unsafe.Pointer(nil)
	if len(x) > 0 {
		p = unsafe.Pointer(&x[0])
	}
	if c.cfg.blocking {
		return ok(C.loom_allreduce(C.loom_in_place(), p, C.int(len(x)), C.loom_dtype(1), C.loom_op(1, 1), c.h, nil), "MPI_Allreduce")
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	var req C.MPI_Request
	if err := ok(C.loom_allreduce(C.loom_in_place(), p, C.int(len(x)), C.loom_dtype(1), C.loom_op(1, 1), c.h, &req), "MPI_Iallreduce"); err != nil {
		return err
	}
	return ok(C.MPI_Wait(&req, nil), "MPI_Wait")
}

// rawAllReduce runs float32 sum MPI_Allreduce (blocking) or
// MPI_Iallreduce then MPI_Wait (not blocking) of send into recv on c's MPI
// communicator, bypassing the backend: the reference the benchmark test
// compares loom with, on the same buffers.
func rawAllReduce(c *Comm, send, recv []float32, blocking bool) error {
	s, r := unsafe.Pointer(&send[0]), unsafe.Pointer(&recv[0])
	n, dt, op := C.int(len(send)), C.loom_dtype(1), C.loom_op(1, 1)
	if blocking {
		return ok(C.MPI_Allreduce(s, r, n, dt, op, c.h), "MPI_Allreduce")
	}
	var req C.MPI_Request
	if err := ok(C.MPI_Iallreduce(s, r, n, dt, op, c.h, &req), "MPI_Iallreduce"); err != nil {
		return err
	}
	return ok(C.MPI_Wait(&req, nil), "MPI_Wait")
}

// pollNotices picks up a peer's abort notice, if one has arrived, and
// returns c.Err().
func pollNotices(c *Comm) error {
	c.mu.Lock()
	c.pollCtlLocked()
	c.mu.Unlock()
	return c.Err()
}

func cF32ToBF16(f float32) uint16 { return uint16(C.loom_f32_to_bf16(C.float(f))) }
func cF32ToF16(f float32) uint16  { return uint16(C.loom_f32_to_f16(C.float(f))) }
func cF16ToF32(h uint16) float32  { return float32(C.loom_f16_to_f32(C.ushort(h))) }

// orphanCount returns the number of abandoned operations still posted.
func orphanCount(c *Comm) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reapOrphansLocked()
	return len(c.orphans)
}
