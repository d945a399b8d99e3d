package kernels

import (
	"errors"
	"fmt"
	"sort"
)

// Segmented permute kernels: the same row movement as Permute, Unpermute
// and UnpermuteBackward, with the packed rows of each expert in a buffer of
// its own. With ranks that share memory (comm.SharedMemory), an expert's
// rank gathers its rows straight from the token ranks' inputs
// ([PermuteExpert]), and a token rank combines straight from the experts'
// outputs ([UnpermuteSegments]); in the combine's backward the expert's
// rank gathers the gate-scaled gradient rows and computes its slots' gate
// gradient against the rows it holds ([UnpermuteBackwardExpert]). Each row
// moves once, with no send buffer packed and no received buffer regrouped.

// packedRows locates packed rows of width d: in one buffer (flat), or in
// segs, where segs[e] holds expert e's rows [Offsets[e], Offsets[e+1]) and
// owner[p] is the expert whose segment holds row p.
type packedRows[T Float] struct {
	flat  []T
	segs  [][]T
	owner []int32
	d     int
}

// row returns packed row p; offsets are the Routing's.
func (s packedRows[T]) row(p int, offsets []int) []T {
	d := s.d
	if s.segs == nil {
		return s.flat[p*d : p*d+d]
	}
	e := s.owner[p]
	i := p - offsets[e]
	return s.segs[e][i*d : i*d+d]
}

// rowOwners returns, for every packed row of r, the expert that owns it:
// one pass of sequential stores per call. A search of Offsets for every
// row mispredicts its branches on routed (random) rows; it cost about half
// as much as moving a cached row of 256 float32.
func rowOwners(r *Routing) []int32 {
	owner := make([]int32, r.Rows())
	for e := range r.Experts {
		seg := owner[r.Offsets[e]:r.Offsets[e+1]]
		for i := range seg {
			seg[i] = int32(e)
		}
	}
	return owner
}

// checkSegments checks that segs holds every expert's packed rows.
func checkSegments[T Float](op string, segs [][]T, d int, r *Routing) error {
	// rowOwners needs Offsets to ascend from 0 within the row map (the
	// segment lengths below check only differences of Offsets, and
	// nothing at all when d = 0).
	if r.Offsets[0] != 0 || !sort.IntsAreSorted(r.Offsets) {
		return fmt.Errorf("kernels: %s: %w: Routing.Offsets does not ascend from 0; was it changed after PlanRouting?", op, ErrInvalid)
	}
	if len(segs) != r.Experts {
		return fmt.Errorf("kernels: %s: %w: %d segments, want one per expert (%d)", op, ErrInvalid, len(segs), r.Experts)
	}
	var errs []error
	for e, seg := range segs {
		if rows := r.Offsets[e+1] - r.Offsets[e]; len(seg) != rows*d { // named only on error: this runs every call
			errs = append(errs, permLen(op, fmt.Sprintf("segs[%d]", e), len(seg), rows, d))
		}
	}
	return errors.Join(errs...)
}

// PermuteExpert is expert e's part of [Permute]: row i of out (out holds
// the r.Offsets[e+1] − r.Offsets[e] packed rows of expert e, width d)
// becomes x[s/K] for the slot s = RowSlot[Offsets[e]+i], or zero for a pad
// row. Over every expert it is Permute. len(x) must be r.Tokens·d; out
// must not overlap x.
func PermuteExpert[T Float](out, x []T, d int, r *Routing, e int) error {
	const op = "PermuteExpert"
	idx, err := expertSlots(op, r, d, e)
	if err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "x", len(x), r.Tokens, d), permLen(op, "out", len(out), len(idx), d)); err != nil {
		return err
	}
	gatherRows(r.Workers, out, x, idx, r.TopK, d)
	return nil
}

// UnpermuteBackwardExpert is expert e's part of [UnpermuteBackward], for
// an expert's rank that holds expert e's rows while dout and the gates
// live with the tokens: dpacked (nil to skip) and packed hold expert e's
// r.Offsets[e+1] − r.Offsets[e] packed rows of width d. Row i of dpacked
// becomes gates[s]·dout[s/K] for its slot s = RowSlot[Offsets[e]+i] (zero
// for a pad row), and dgates[s] (nil to skip; n·K values)
// ⟨row i of packed, dout[s/K]⟩, in one pass and with the bits
// UnpermuteBackward gives; entries of dgates for other experts' slots and
// for slots that are not routed or were dropped are left as they are.
// gates may be nil (weights of 1); packed may be nil when dgates is.
func UnpermuteBackwardExpert[T Float](dpacked, dgates, dout, packed, gates []T, d int, r *Routing, e int) error {
	const op = "UnpermuteBackwardExpert"
	idx, err := expertSlots(op, r, d, e)
	if err != nil {
		return err
	}
	errs := []error{permLen(op, "dout", len(dout), r.Tokens, d)}
	if dpacked != nil {
		errs = append(errs, permLen(op, "dpacked", len(dpacked), len(idx), d))
	}
	if dgates != nil {
		errs = append(errs, permLen(op, "dgates", len(dgates), len(r.SlotRow), 1), permLen(op, "packed", len(packed), len(idx), d))
	}
	if gates != nil {
		errs = append(errs, permLen(op, "gates", len(gates), len(r.SlotRow), 1))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if dpacked == nil && dgates == nil {
		return nil // nothing asked for
	}
	unpermuteBackwardRows(r.Workers, dpacked, dgates, dout, packed, gates, idx, r.TopK, d)
	return nil
}

// expertSlots checks r, d and e and returns the slots of expert e's packed
// rows (RowSlot[Offsets[e]:Offsets[e+1]]), each checked.
func expertSlots(op string, r *Routing, d, e int) ([]int32, error) {
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return nil, err
	}
	if e < 0 || e >= r.Experts {
		return nil, fmt.Errorf("kernels: %s: %w: expert %d of %d", op, ErrInvalid, e, r.Experts)
	}
	lo, hi := r.Offsets[e], r.Offsets[e+1]
	if lo < 0 || lo > hi || hi > len(r.RowSlot) {
		return nil, fmt.Errorf("kernels: %s: %w: Routing.Offsets[%d:%d] = [%d, %d] outside its %d rows; was it changed after PlanRouting?", op, ErrInvalid, e, e+2, lo, hi, len(r.RowSlot))
	}
	idx := r.RowSlot[lo:hi]
	if err := permIdxCheck(op, "RowSlot", idx, len(r.SlotRow)); err != nil {
		return nil, err
	}
	return idx, nil
}

// UnpermuteSegments is [Unpermute] with the packed rows in per-expert
// segments: segs[e] holds expert e's r.Offsets[e+1] − r.Offsets[e] packed
// rows of width d, wherever they live (an expert rank's output, say). The
// result is bit for bit Unpermute's on the concatenated segments.
func UnpermuteSegments[T Float](out []T, segs [][]T, gates []T, d int, r *Routing) error {
	const op = "UnpermuteSegments"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := errors.Join(r.checkSlotRow(op), checkSegments(op, segs, d, r), permLen(op, "out", len(out), r.Tokens, d)); err != nil {
		return err
	}
	if gates != nil && len(gates) != len(r.SlotRow) {
		return fmt.Errorf("kernels: %s: %w: len(gates) = %d, want %d tokens × %d = %d", op, ErrInvalid, len(gates), r.Tokens, r.TopK, len(r.SlotRow))
	}
	unpermute(out, packedRows[T]{segs: segs, owner: rowOwners(r), d: d}, gates, d, r)
	return nil
}
