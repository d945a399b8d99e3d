//go:build mpi

package mpi

/*
#include "loom_mpi.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
)

// The fixed-size encoding of a fingerprint that the consistency check
// allgathers. Little-endian:
//
//	0   seq        uint64
//	8   op, dtype, reduce op, algorithm, invalid, has send counts (1 byte each)
//	16  count      int64
//	24  root       int64
//	32  color      int64 (Split)
//	40  key        int64 (Split)
//	64  site       [siteBytes]byte, NUL-padded
//	    reason     [reasonBytes]byte, why the call was rejected locally
//	    counts     size × int64, AllToAllV's send counts
const (
	fpHeader    = 64
	siteBytes   = 160
	reasonBytes = 240
)

func (c *Comm) fpBytes() int { return fpHeader + siteBytes + reasonBytes + 8*c.size }

// fpRecord is one rank's decoded entry.
type fpRecord struct {
	fp         comm.Fingerprint
	invalid    string
	color, key int
}

func (c *Comm) encodeFP(b []byte, fp comm.Fingerprint, invalid error, color, key int) {
	putU64(b[0:], fp.Seq)
	b[8], b[9], b[10], b[11] = byte(fp.Op), byte(fp.DType), byte(fp.Reduce), byte(fp.Algorithm)
	putU64(b[16:], uint64(int64(fp.Count)))
	putU64(b[24:], uint64(int64(fp.Root)))
	putU64(b[32:], uint64(int64(color)))
	putU64(b[40:], uint64(int64(key)))
	copy(b[fpHeader:fpHeader+siteBytes], truncate(fp.Site, siteBytes))
	if invalid != nil {
		b[12] = 1
		copy(b[fpHeader+siteBytes:fpHeader+siteBytes+reasonBytes], truncate(invalid.Error(), reasonBytes))
	}
	if fp.SendCounts != nil && len(fp.SendCounts) == c.size {
		b[13] = 1
		for j, n := range fp.SendCounts {
			putU64(b[fpHeader+siteBytes+reasonBytes+8*j:], uint64(int64(n)))
		}
	}
}

func (c *Comm) decodeFP(b []byte) fpRecord {
	var r fpRecord
	f := &r.fp
	f.Seq = getU64(b)
	f.Op, f.DType, f.Reduce, f.Algorithm = comm.Op(b[8]), comm.DType(b[9]), comm.ReduceOp(b[10]), comm.Algorithm(b[11])
	f.Count = int(int64(getU64(b[16:])))
	f.Root = int(int64(getU64(b[24:])))
	r.color = int(int64(getU64(b[32:])))
	r.key = int(int64(getU64(b[40:])))
	f.Site = cstring(b[fpHeader : fpHeader+siteBytes])
	if b[12] != 0 {
		r.invalid = cstring(b[fpHeader+siteBytes : fpHeader+siteBytes+reasonBytes])
	}
	if b[13] != 0 {
		f.SendCounts = make([]int, c.size)
		for j := range f.SendCounts {
			f.SendCounts[j] = int(int64(getU64(b[fpHeader+siteBytes+reasonBytes+8*j:])))
		}
	}
	return r
}

// truncate cuts s to fit n bytes with a NUL left over.
func truncate(s string, n int) string {
	if len(s) >= n {
		return s[:n-1]
	}
	return s
}

func cstring(b []byte) string {
	for i, x := range b {
		if x == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// fingerprintStep allgathers this rank's fingerprint (with its local
// validation error, and for Split its color and key); the next step
// compares them, reaching the same verdict on every rank.
func (c *Comm) fingerprintStep(fp comm.Fingerprint, invalid error, color, key int) step {
	return func(w *work) error {
		e := c.fpBytes()
		mine := scratch(e)
		all := scratch(e * c.size)
		c.encodeFP(mine, fp, invalid, color, key)
		w.use(mine, all)
		if err := ok(C.MPI_Iallgather(ptr(mine), C.int(e), C.loom_byte(), ptr(all), C.int(e), C.loom_byte(), c.h, w.newReq()), "MPI_Iallgather (consistency check)"); err != nil {
			return err
		}
		verdict := func(w *work) error {
			recs := make([]fpRecord, c.size)
			for q := range recs {
				recs[q] = c.decodeFP(all[q*e : (q+1)*e])
			}
			var bad []string
			for q, r := range recs {
				if r.invalid != "" {
					bad = append(bad, fmt.Sprintf("rank %d: %s", q, r.invalid))
				}
			}
			if bad != nil {
				return c.errorf(w.op, w.seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
			}
			for _, r := range recs {
				if !r.fp.Matches(recs[0].fp) {
					fps := make([]comm.Fingerprint, c.size)
					for q := range recs {
						fps[q] = recs[q].fp
					}
					return c.wrap(w.op, w.seq, -1, &comm.MismatchError{Calls: fps})
				}
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
		if err := ok(C.MPI_Ialltoall(ptr(sb), 1, C.loom_int64(), ptr(gb), 1, C.loom_int64(), c.h, w.newReq()), "MPI_Ialltoall (alltoallv counts)"); err != nil {
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
			return ok(C.MPI_Iallreduce(unsafe.Pointer(&flags[0]), unsafe.Pointer(&flags[1]), 1, C.loom_int(), C.loom_bor(), c.h, w.newReq()), "MPI_Iallreduce (alltoallv verdict)")
		}
		decide := func(w *work) error {
			if flags[1] == 0 {
				return w.issue()
			}
			// Slow path: learn every rank's counts and errors, so that the
			// error is the same everywhere and names every bad pair.
			e := 16*p + reasonBytes
			mine := scratch(e)
			all := scratch(e * p)
			if valid {
				for j := range p {
					putU64(mine[8*j:], uint64(int64(call.SendCounts[j])))
					putU64(mine[8*(p+j):], uint64(int64(call.RecvCounts[j])))
				}
			} else {
				copy(mine[16*p:], truncate(invalid.Error(), reasonBytes))
				if mine[16*p] == 0 {
					mine[16*p] = '?' // an error with no text still counts
				}
			}
			w.use(mine, all)
			if err := ok(C.MPI_Iallgather(ptr(mine), C.int(e), C.loom_byte(), ptr(all), C.int(e), C.loom_byte(), c.h, w.newReq()), "MPI_Iallgather (alltoallv counts)"); err != nil {
				return err
			}
			report := func(w *work) error {
				var bad []string
				send, recv := make([][]int, p), make([][]int, p)
				for q := range p {
					b := all[q*e : (q+1)*e]
					if reason := cstring(b[16*p:]); reason != "" {
						bad = append(bad, fmt.Sprintf("rank %d: %s", q, reason))
					}
					send[q], recv[q] = make([]int, p), make([]int, p)
					for j := range p {
						send[q][j] = int(int64(getU64(b[8*j:])))
						recv[q][j] = int(int64(getU64(b[8*(p+j):])))
					}
				}
				if bad != nil {
					return c.errorf(w.op, w.seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
				}
				if err := comm.CheckCounts(send, recv); err != nil {
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
