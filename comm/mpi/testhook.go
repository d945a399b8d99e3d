//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import "unsafe"

// This file holds the few cgo calls that the package's tests need and
// cannot make themselves (cgo is not allowed in _test.go files).

// rawAllReduceSum runs MPI_Iallreduce (float32, sum) on c's MPI
// communicator and waits for it, bypassing the backend: tests use it to
// complete, on a peer, a collective that an aborted communicator left
// posted. (It must be nonblocking: MPI never matches a blocking collective
// with a nonblocking one.)
func rawAllReduceSum(c *Comm, x []float32) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := unsafe.Pointer(nil)
	if len(x) > 0 {
		p = unsafe.Pointer(&x[0])
	}
	var req C.MPI_Request
	if err := ok(C.MPI_Iallreduce(C.loom_in_place(), p, C.int(len(x)), C.loom_dtype(1), C.loom_op(1, 1), c.h, &req), "MPI_Iallreduce"); err != nil {
		return err
	}
	return ok(C.MPI_Wait(&req, nil), "MPI_Wait")
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
