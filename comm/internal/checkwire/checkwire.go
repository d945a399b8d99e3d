// Package checkwire is the wire format of the consistency check that the
// comm/nccl and comm/mpi backends run before a collective. Every rank
// encodes a fixed-size record of the call it is about to issue, the
// backend allgathers the records, and every rank decodes all of them and
// reaches the same verdict. AllToAllV's counts are checked the same way
// with a second record.
//
// The fingerprint record, little-endian:
//
//	0   seq        uint64
//	8   op, dtype, reduce op, algorithm, invalid, has send counts (1 byte each)
//	16  count      int64
//	24  root       int64
//	32  color      int64 (Split)
//	40  key        int64 (Split)
//	64  site       [160]byte, NUL-padded
//	224 reason     [240]byte, NUL-padded: why the call was rejected locally
//	464 counts     size × int64, AllToAllV's send counts
//
// The counts record of a communicator of size ranks:
//
//	0        send counts  size × int64
//	8*size   recv counts  size × int64
//	16*size  reason       [240]byte, NUL-padded; non-empty when the call
//	                      was rejected locally (the counts are then zero)
package checkwire

import (
	"encoding/binary"
	"fmt"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

const (
	header      = 64
	siteBytes   = 160
	reasonBytes = 240
)

// FingerprintSize returns the size of one rank's fingerprint record in a
// communicator of size ranks.
func FingerprintSize(size int) int { return header + siteBytes + reasonBytes + 8*size }

// PutFingerprint encodes into b, which holds FingerprintSize(size) zero
// bytes, the fingerprint fp of a call, the error that rejected the call on
// this rank (nil when it passed local validation) and, for Split, the
// color and key. The site and reason are cut to fit.
func PutFingerprint(b []byte, size int, fp comm.Fingerprint, invalid error, color, key int) {
	binary.LittleEndian.PutUint64(b[0:], fp.Seq)
	b[8], b[9], b[10], b[11] = byte(fp.Op), byte(fp.DType), byte(fp.Reduce), byte(fp.Algorithm)
	binary.LittleEndian.PutUint64(b[16:], uint64(int64(fp.Count)))
	binary.LittleEndian.PutUint64(b[24:], uint64(int64(fp.Root)))
	binary.LittleEndian.PutUint64(b[32:], uint64(int64(color)))
	binary.LittleEndian.PutUint64(b[40:], uint64(int64(key)))
	copy(b[header:header+siteBytes], truncate(fp.Site, siteBytes))
	if invalid != nil {
		b[12] = 1
		copy(b[header+siteBytes:header+siteBytes+reasonBytes], truncate(invalid.Error(), reasonBytes))
	}
	if len(fp.SendCounts) == size {
		b[13] = 1
		for j, n := range fp.SendCounts {
			binary.LittleEndian.PutUint64(b[header+siteBytes+reasonBytes+8*j:], uint64(int64(n)))
		}
	}
}

// Entry is one rank's decoded fingerprint record.
type Entry struct {
	// Fingerprint is the call the rank is about to issue.
	Fingerprint comm.Fingerprint
	// Invalid says why the rank rejected the call locally; "" when it did
	// not ("rejected" when its error had no text).
	Invalid string
	// Color and Key are Split's arguments; 0 for other calls.
	Color, Key int
}

// ParseFingerprint decodes a record that PutFingerprint encoded for a
// communicator of size ranks.
func ParseFingerprint(b []byte, size int) Entry {
	var e Entry
	f := &e.Fingerprint
	f.Seq = binary.LittleEndian.Uint64(b)
	f.Op, f.DType, f.Reduce, f.Algorithm = comm.Op(b[8]), comm.DType(b[9]), comm.ReduceOp(b[10]), comm.Algorithm(b[11])
	f.Count = int(int64(binary.LittleEndian.Uint64(b[16:])))
	f.Root = int(int64(binary.LittleEndian.Uint64(b[24:])))
	e.Color = int(int64(binary.LittleEndian.Uint64(b[32:])))
	e.Key = int(int64(binary.LittleEndian.Uint64(b[40:])))
	f.Site = cstring(b[header : header+siteBytes])
	if b[12] != 0 {
		e.Invalid = cstring(b[header+siteBytes : header+siteBytes+reasonBytes])
		if e.Invalid == "" {
			e.Invalid = "rejected"
		}
	}
	if b[13] != 0 {
		f.SendCounts = make([]int, size)
		for j := range f.SendCounts {
			f.SendCounts[j] = int(int64(binary.LittleEndian.Uint64(b[header+siteBytes+reasonBytes+8*j:])))
		}
	}
	return e
}

// CheckFingerprints decodes the size records of all, the allgather of every
// rank's PutFingerprint record, and returns the verdict, the same on every
// rank: nil, an error wrapping comm.ErrInvalid that lists the ranks that
// rejected the call, or a *comm.MismatchError with every rank's
// fingerprint.
func CheckFingerprints(all []byte, size int) error {
	n := FingerprintSize(size)
	entries := make([]Entry, size)
	for q := range entries {
		entries[q] = ParseFingerprint(all[q*n:(q+1)*n], size)
	}
	var bad []string
	for q, e := range entries {
		if e.Invalid != "" {
			bad = append(bad, fmt.Sprintf("rank %d: %s", q, e.Invalid))
		}
	}
	if bad != nil {
		return rejected(bad)
	}
	for _, e := range entries {
		if !e.Fingerprint.Matches(entries[0].Fingerprint) {
			fps := make([]comm.Fingerprint, size)
			for q := range entries {
				fps[q] = entries[q].Fingerprint
			}
			return &comm.MismatchError{Calls: fps}
		}
	}
	return nil
}

// CountsSize returns the size of one rank's counts record in a
// communicator of size ranks.
func CountsSize(size int) int { return 16*size + reasonBytes }

// PutCounts encodes into b, which holds CountsSize(size) zero bytes,
// AllToAllV's send and receive counts (size each), or, when invalid is not
// nil, why the call was rejected on this rank; the counts are then not
// read, as they may be malformed.
func PutCounts(b []byte, size int, send, recv []int, invalid error) {
	p := size
	if invalid != nil {
		copy(b[16*p:], truncate(invalid.Error(), reasonBytes))
		if b[16*p] == 0 {
			b[16*p] = '?' // an error with no text still counts
		}
		return
	}
	for j := range p {
		binary.LittleEndian.PutUint64(b[8*j:], uint64(int64(send[j])))
		binary.LittleEndian.PutUint64(b[8*(p+j):], uint64(int64(recv[j])))
	}
}

// CheckCounts decodes the size records of all, the allgather of every
// rank's PutCounts record, and returns the verdict, the same on every rank:
// nil, an error wrapping comm.ErrInvalid that lists the ranks that rejected
// the call, or comm.CheckCounts's error listing every pair of ranks that
// disagree.
func CheckCounts(all []byte, size int) error {
	n := CountsSize(size)
	var bad []string
	send, recv := make([][]int, size), make([][]int, size)
	for q := range size {
		b := all[q*n : (q+1)*n]
		if reason := cstring(b[16*size:]); reason != "" {
			bad = append(bad, fmt.Sprintf("rank %d: %s", q, reason))
		}
		send[q], recv[q] = make([]int, size), make([]int, size)
		for j := range size {
			send[q][j] = int(int64(binary.LittleEndian.Uint64(b[8*j:])))
			recv[q][j] = int(int64(binary.LittleEndian.Uint64(b[8*(size+j):])))
		}
	}
	if bad != nil {
		return rejected(bad)
	}
	return comm.CheckCounts(send, recv)
}

// rejected is the verdict when ranks rejected the call locally.
func rejected(bad []string) error {
	return fmt.Errorf("%w: call rejected before any data moved: %s", comm.ErrInvalid, strings.Join(bad, "; "))
}

// truncate cuts s to fit n bytes with a NUL left over.
func truncate(s string, n int) string {
	if len(s) >= n {
		return s[:n-1]
	}
	return s
}

// cstring returns b up to its first NUL.
func cstring(b []byte) string {
	for i, x := range b {
		if x == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}
