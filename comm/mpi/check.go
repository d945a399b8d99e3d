//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/internal/checkwire"
)

// fingerprintStep allgathers this rank's fingerprint (with its local
// validation error, and for Split its color and key); the next step
// compares them, reaching the same verdict on every rank.
func (c *Comm) fingerprintStep(fp comm.Fingerprint, invalid error, color, key int) step {
	return func(w *work) error {
		e := checkwire.FingerprintSize(c.size)
		mine := scratch(e)
		all := scratch(e * c.size)
		checkwire.PutFingerprint(mine, c.size, fp, invalid, color, key)
		w.use(mine, all)
		if err := ok(C.loom_allgather(ptr(mine), C.int(e), C.loom_byte(), ptr(all), C.int(e), C.loom_byte(), c.h, w.newReq()), w.mpiName("Allgather")+" (consistency check)"); err != nil {
			return err
		}
		verdict := func(w *work) error {
			if err := checkwire.CheckFingerprints(all, c.size); err != nil {
				return c.wrap(w.op, w.seq, -1, err)
			}
			return nil
		}
		w.steps = append([]step{verdict}, w.steps...)
		return nil
	}
}

// countsStep checks AllToAllV's counts across ranks before data moves:
// MPI_Alltoall of the send counts, so every rank learns what each peer
// will send it and compares with its receive counts; then MPI_Allreduce
// (bitwise or) of a verdict flag, so every rank reaches the same verdict.
// On a bad verdict every rank allgathers the count matrices and local
// errors, and returns the same error listing every disagreeing pair; else
// the data step follows.
func (c *Comm) countsStep(invalid error) step {
	const (
		flagInvalid = 1
		flagCounts  = 2
	)
	return func(w *work) error {
		p := c.size
		call := &w.call
		valid := invalid == nil
		sendBuf := make([]int64, p)
		got := make([]int64, p)
		if valid {
			for j := range p {
				sendBuf[j] = int64(call.SendCounts[j])
			}
		}
		sb := int64Bytes(sendBuf)
		gb := int64Bytes(got)
		w.use(sb, gb)
		if err := ok(C.loom_alltoall(ptr(sb), 1, C.loom_int64(), ptr(gb), 1, C.loom_int64(), c.h, w.newReq()), w.mpiName("Alltoall")+" (alltoallv counts)"); err != nil {
			return err
		}
		flags := make([]C.int, 2) // mine, everyone's
		agree := func(w *work) error {
			if !valid {
				flags[0] |= flagInvalid
			} else {
				for j := range p {
					if got[j] != int64(call.RecvCounts[j]) {
						flags[0] |= flagCounts
					}
				}
			}
			fb := unsafe.Slice((*byte)(unsafe.Pointer(&flags[0])), 2*int(unsafe.Sizeof(flags[0])))
			w.use(fb)
			return ok(C.loom_allreduce(unsafe.Pointer(&flags[0]), unsafe.Pointer(&flags[1]), 1, C.loom_int(), C.loom_bor(), c.h, w.newReq()), w.mpiName("Allreduce")+" (alltoallv verdict)")
		}
		decide := func(w *work) error {
			if flags[1] == 0 {
				return w.issue()
			}
			// Slow path: learn every rank's counts and errors, so that the
			// error is the same everywhere and names every bad pair.
			e := checkwire.CountsSize(p)
			mine := scratch(e)
			all := scratch(e * p)
			checkwire.PutCounts(mine, p, call.SendCounts, call.RecvCounts, invalid)
			w.use(mine, all)
			if err := ok(C.loom_allgather(ptr(mine), C.int(e), C.loom_byte(), ptr(all), C.int(e), C.loom_byte(), c.h, w.newReq()), w.mpiName("Allgather")+" (alltoallv counts)"); err != nil {
				return err
			}
			report := func(w *work) error {
				if err := checkwire.CheckCounts(all, p); err != nil {
					return c.wrap(w.op, w.seq, -1, err)
				}
				return c.errorf(w.op, w.seq, -1, "%w: alltoallv counts disagree", comm.ErrInvalid)
			}
			w.steps = append([]step{report}, w.steps...)
			return nil
		}
		w.steps = append([]step{agree, decide}, w.steps...)
		return nil
	}
}

func int64Bytes(x []int64) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 8*len(x))
}
