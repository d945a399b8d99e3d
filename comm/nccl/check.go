package nccl

import (
	"context"
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// The fixed-size encoding of a fingerprint that the consistency check
// allgathers through NCCL. Little-endian:
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

var le = binary.LittleEndian

func (c *Comm) fpBytes() int { return fpHeader + siteBytes + reasonBytes + 8*c.size }

// fpRecord is one rank's decoded entry.
type fpRecord struct {
	fp         comm.Fingerprint
	invalid    string
	color, key int
}

func (c *Comm) encodeFP(b []byte, fp comm.Fingerprint, invalid error, color, key int) {
	le.PutUint64(b[0:], fp.Seq)
	b[8], b[9], b[10], b[11] = byte(fp.Op), byte(fp.DType), byte(fp.Reduce), byte(fp.Algorithm)
	le.PutUint64(b[16:], uint64(int64(fp.Count)))
	le.PutUint64(b[24:], uint64(int64(fp.Root)))
	le.PutUint64(b[32:], uint64(int64(color)))
	le.PutUint64(b[40:], uint64(int64(key)))
	copy(b[fpHeader:fpHeader+siteBytes], truncate(fp.Site, siteBytes))
	if invalid != nil {
		b[12] = 1
		copy(b[fpHeader+siteBytes:fpHeader+siteBytes+reasonBytes], truncate(invalid.Error(), reasonBytes))
	}
	if len(fp.SendCounts) == c.size {
		b[13] = 1
		for j, n := range fp.SendCounts {
			le.PutUint64(b[fpHeader+siteBytes+reasonBytes+8*j:], uint64(int64(n)))
		}
	}
}

func (c *Comm) decodeFP(b []byte) fpRecord {
	var r fpRecord
	f := &r.fp
	f.Seq = le.Uint64(b)
	f.Op, f.DType, f.Reduce, f.Algorithm = comm.Op(b[8]), comm.DType(b[9]), comm.ReduceOp(b[10]), comm.Algorithm(b[11])
	f.Count = int(int64(le.Uint64(b[16:])))
	f.Root = int(int64(le.Uint64(b[24:])))
	r.color = int(int64(le.Uint64(b[32:])))
	r.key = int(int64(le.Uint64(b[40:])))
	f.Site = cstring(b[fpHeader : fpHeader+siteBytes])
	if b[12] != 0 {
		r.invalid = cstring(b[fpHeader+siteBytes : fpHeader+siteBytes+reasonBytes])
		if r.invalid == "" {
			r.invalid = "rejected"
		}
	}
	if b[13] != 0 {
		f.SendCounts = make([]int, c.size)
		for j := range f.SendCounts {
			f.SendCounts[j] = int(int64(le.Uint64(b[fpHeader+siteBytes+reasonBytes+8*j:])))
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

// checkFingerprint allgathers this rank's fingerprint of call at seq, with
// its local validation error (invalid) and, for Split, color and key; it
// returns the same verdict on every rank: nil, an ErrInvalid error listing
// the ranks that rejected the call, or a *comm.MismatchError. Neither
// verdict aborts the communicator, and neither takes a sequence number.
func (c *Comm) checkFingerprint(ctx context.Context, seq uint64, call *comm.Call, invalid error, color, key int) error {
	fp := comm.FingerprintOf(seq, call)
	fp.Site = callerSite()
	mine := make([]byte, c.fpBytes())
	c.encodeFP(mine, fp, invalid, color, key)
	all, err := c.exchange(ctx, call.Op, seq, mine)
	if err != nil {
		return err
	}
	e := len(mine)
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
		return c.errorf(call.Op, seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
	}
	for _, r := range recs {
		if !r.fp.Matches(recs[0].fp) {
			fps := make([]comm.Fingerprint, c.size)
			for q := range recs {
				fps[q] = recs[q].fp
			}
			return c.wrap(call.Op, seq, -1, &comm.MismatchError{Calls: fps})
		}
	}
	return nil
}

// checkCounts checks AllToAllV's counts across ranks before data moves:
// every rank allgathers its send and receive counts (and its local
// validation error), so every rank reaches the same verdict: nil, an
// ErrInvalid error listing the ranks that rejected the call, or the
// comm.CheckCounts error listing every disagreeing pair. Neither verdict
// aborts the communicator, and neither takes a sequence number.
func (c *Comm) checkCounts(ctx context.Context, seq uint64, call *comm.Call, invalid error) error {
	p := c.size
	e := 16*p + reasonBytes
	mine := make([]byte, e)
	if invalid == nil {
		for j := range p {
			le.PutUint64(mine[8*j:], uint64(int64(call.SendCounts[j])))
			le.PutUint64(mine[8*(p+j):], uint64(int64(call.RecvCounts[j])))
		}
	} else {
		copy(mine[16*p:], truncate(invalid.Error(), reasonBytes))
		if mine[16*p] == 0 {
			mine[16*p] = '?' // an error with no text still counts
		}
	}
	all, err := c.exchange(ctx, call.Op, seq, mine)
	if err != nil {
		return err
	}
	var bad []string
	send, recv := make([][]int, p), make([][]int, p)
	for q := range p {
		b := all[q*e : (q+1)*e]
		if reason := cstring(b[16*p:]); reason != "" {
			bad = append(bad, fmt.Sprintf("rank %d: %s", q, reason))
		}
		send[q], recv[q] = make([]int, p), make([]int, p)
		for j := range p {
			send[q][j] = int(int64(le.Uint64(b[8*j:])))
			recv[q][j] = int(int64(le.Uint64(b[8*(p+j):])))
		}
	}
	if bad != nil {
		return c.errorf(call.Op, seq, -1, "%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
	}
	if err := comm.CheckCounts(send, recv); err != nil {
		return c.wrap(call.Op, seq, -1, err)
	}
	return nil
}
