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
// outputs ([UnpermuteSegments], [GateGradSegments]): each row moves once,
// with no send buffer packed and no received buffer regrouped.

// packedRows locates packed rows of width d: in one buffer (flat), or in
// segs, where segs[e] holds expert e's rows [Offsets[e], Offsets[e+1]).
type packedRows[T Float] struct {
	flat []T
	segs [][]T
	d    int
}

// row returns packed row p; offsets are the Routing's.
func (s packedRows[T]) row(p int, offsets []int) []T {
	d := s.d
	if s.segs == nil {
		return s.flat[p*d : p*d+d]
	}
	// The last expert whose rows start at or before p: empty experts
	// share their offset with the next one and are skipped.
	e := sort.SearchInts(offsets, p+1) - 1
	i := p - offsets[e]
	return s.segs[e][i*d : i*d+d]
}

// checkSegments checks that segs holds every expert's packed rows.
func checkSegments[T Float](op string, segs [][]T, d int, r *Routing) error {
	// packedRows.row searches Offsets for a row's expert: a hand-changed
	// Offsets that does not start at 0 would index segs[-1]. The segment
	// lengths below check only differences of Offsets (and nothing at all
	// when d = 0).
	if r.Offsets[0] != 0 || !sort.IntsAreSorted(r.Offsets) {
		return fmt.Errorf("kernels: %s: Routing.Offsets does not ascend from 0; was it changed after PlanRouting?", op)
	}
	if len(segs) != r.Experts {
		return fmt.Errorf("kernels: %s: %d segments, want one per expert (%d)", op, len(segs), r.Experts)
	}
	var errs []error
	for e, seg := range segs {
		errs = append(errs, permLen(op, fmt.Sprintf("segs[%d]", e), len(seg), r.Offsets[e+1]-r.Offsets[e], d))
	}
	return errors.Join(errs...)
}

// PermuteExpert is expert e's part of [Permute], optionally gate-scaled:
// row i of out (out holds the r.Offsets[e+1] − r.Offsets[e] packed rows of
// expert e, width d) becomes gates[s] · x[s/K] for the slot s =
// RowSlot[Offsets[e]+i], or zero for a pad row; nil gates weight every row
// by 1. Over every expert with nil gates it is Permute; with gates it is
// the gate-scaled gather of [UnpermuteBackward] (the combine's adjoint).
// len(x) must be r.Tokens·d and len(gates) n·K when not nil; out must not
// overlap x.
func PermuteExpert[T Float](out, x, gates []T, d int, r *Routing, e int) error {
	const op = "PermuteExpert"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if e < 0 || e >= r.Experts {
		return fmt.Errorf("kernels: %s: expert %d of %d", op, e, r.Experts)
	}
	lo, hi := r.Offsets[e], r.Offsets[e+1]
	if lo < 0 || lo > hi || hi > len(r.RowSlot) {
		return fmt.Errorf("kernels: %s: Routing.Offsets[%d:%d] = [%d, %d] outside its %d rows; was it changed after PlanRouting?", op, e, e+2, lo, hi, len(r.RowSlot))
	}
	idx := r.RowSlot[lo:hi]
	var errs []error
	errs = append(errs, permIdxCheck(op, "RowSlot", idx, len(r.SlotRow)),
		permLen(op, "x", len(x), r.Tokens, d), permLen(op, "out", len(out), hi-lo, d))
	if gates != nil {
		errs = append(errs, permLen(op, "gates", len(gates), len(r.SlotRow), 1))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	k := r.TopK
	if gates == nil {
		gatherRows(r.Workers, out, x, idx, k, d)
		return nil
	}
	permForRows(r.Workers, len(idx), 2*d*sizeOf[T](), func(lo, hi int) {
		for i := lo; i < hi; i++ {
			o := out[i*d : i*d+d]
			s := int(idx[i])
			if s < 0 {
				clear(o)
				continue
			}
			t := s / k
			permScale(o, x[t*d:t*d+d], gates[s])
		}
	})
	return nil
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
		return fmt.Errorf("kernels: %s: len(gates) = %d, want %d tokens × %d = %d", op, len(gates), r.Tokens, r.TopK, len(r.SlotRow))
	}
	unpermute(out, packedRows[T]{segs: segs, d: d}, gates, d, r)
	return nil
}

// GateGradSegments is the gate gradient of [UnpermuteBackward] with the
// combine's packed input in per-expert segments (as for
// [UnpermuteSegments]): dgates[s] = ⟨packed row of slot s, dout[s/K]⟩,
// accumulated in float64, or zero for a slot that is not routed or was
// dropped. len(dgates) must be n·K and len(dout) r.Tokens·d.
func GateGradSegments[T Float](dgates, dout []T, segs [][]T, d int, r *Routing) error {
	const op = "GateGradSegments"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := errors.Join(r.checkSlotRow(op), checkSegments(op, segs, d, r),
		permLen(op, "dgates", len(dgates), len(r.SlotRow), 1), permLen(op, "dout", len(dout), r.Tokens, d)); err != nil {
		return err
	}
	gateGrad(dgates, dout, packedRows[T]{segs: segs, d: d}, d, r)
	return nil
}
