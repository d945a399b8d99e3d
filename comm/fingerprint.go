package comm

import (
	"fmt"
	"strings"
)

// Fingerprint is what a rank issued at one point of a communicator's
// sequence. Ranks compare fingerprints before a collective to turn a
// mismatched program into an error instead of a hang or wrong data.
type Fingerprint struct {
	Seq       uint64
	Op        Op
	DType     DType
	Count     int // per-rank count as Call.Count defines it
	Root      int
	Reduce    ReduceOp
	Algorithm Algorithm
	// SendCounts are AllToAllV's per-peer send counts.
	SendCounts []int
	// Site is the caller's file:line, recorded when the consistency check is on.
	Site string
}

// FingerprintOf describes call c issued at sequence number seq.
func FingerprintOf(seq uint64, c *Call) Fingerprint {
	f := Fingerprint{Seq: seq, Op: c.Op, Count: c.Count(), Root: -1, Algorithm: c.Algorithm}
	switch {
	case c.Send != nil:
		f.DType = c.Send.DType()
	case c.Recv != nil:
		f.DType = c.Recv.DType()
	}
	if c.Op.Rooted() {
		f.Root = c.Root
	}
	if c.Op.Reduces() {
		f.Reduce = c.Reduce
	}
	if c.Op == OpAllToAllV {
		f.SendCounts = c.SendCounts
		f.Count = 0
	}
	if c.Op == OpBarrier || c.Op == OpSplit {
		f.DType, f.Count = 0, 0
	}
	return f
}

// Matches reports whether two ranks' fingerprints describe the same
// collective. Per-rank facts (AllToAllV send counts, the call site) are not
// compared; AllToAllV counts are checked pairwise by CheckCounts.
func (f Fingerprint) Matches(g Fingerprint) bool {
	return f.Seq == g.Seq && f.Op == g.Op && f.DType == g.DType && f.Count == g.Count &&
		f.Root == g.Root && f.Reduce == g.Reduce && f.Algorithm == g.Algorithm
}

// String formats the fingerprint for error messages.
func (f Fingerprint) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v #%d", f.Op, f.Seq)
	if f.DType != 0 {
		fmt.Fprintf(&b, " %v", f.DType)
	}
	if f.Op != OpBarrier && f.Op != OpSplit && f.Op != OpAllToAllV {
		fmt.Fprintf(&b, " count=%d", f.Count)
	}
	if f.Root >= 0 {
		fmt.Fprintf(&b, " root=%d", f.Root)
	}
	if f.Reduce != 0 {
		fmt.Fprintf(&b, " op=%v", f.Reduce)
	}
	if f.Algorithm != Auto {
		fmt.Fprintf(&b, " algo=%v", f.Algorithm)
	}
	if f.SendCounts != nil {
		fmt.Fprintf(&b, " send_counts=%v", f.SendCounts)
	}
	if f.Site != "" {
		fmt.Fprintf(&b, " at %s", f.Site)
	}
	return b.String()
}

// CheckCounts verifies AllToAllV counts across ranks: send[i][j], what rank
// i sends to rank j, must equal recv[j][i], what j expects from i. It
// returns nil or an error listing every disagreeing pair.
func CheckCounts(send, recv [][]int) error {
	var bad []string
	for i := range send {
		for j := range send[i] {
			if j < len(recv) && i < len(recv[j]) && send[i][j] != recv[j][i] {
				bad = append(bad, fmt.Sprintf("rank %d sends %d elements to rank %d, which expects %d", i, send[i][j], j, recv[j][i]))
			}
		}
	}
	if bad == nil {
		return nil
	}
	if len(bad) > 8 {
		bad = append(bad[:8], fmt.Sprintf("and %d more", len(bad)-8))
	}
	return fmt.Errorf("%w: alltoallv counts disagree: %s", ErrInvalid, strings.Join(bad, "; "))
}
