package kernels

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"unsafe"

	"github.com/b7ea7098/loom/internal/checked"
)

// MoE permute kernels: the local data movement of expert-parallel dispatch
// and combine.
//
// A token t of n routes to K experts; slot s = t·K + j holds its j-th
// choice, experts[s] in [0, E), or −1 when the slot is not routed. A
// [Routing] is the expert-major layout of those slots, computed once per
// step by [PlanRouting] with a counting sort: packed rows are grouped by
// expert (ascending), and within an expert ordered by slot index, that is by
// token and then by slot — Megatron-Core's dropless order. [Permute] copies
// token rows into that layout (dispatch), [Unpermute] sums them back
// weighted by their gates (combine), and [UnpermuteBackward] gives both
// gradients of the combine. [Routing.RankSplits], [GroupByRank] and
// [GroupByExpert] are the expert-parallel pack and unpack around the
// all-to-all.
//
// In static-capacity mode (capacity > 0) every expert owns exactly capacity
// packed rows: slots beyond an expert's capacity (in slot order) are dropped
// and counted, and the unused rows are pad rows, zero in [Permute]'s output
// and ignored by [Unpermute]. The layout then depends only on E and the
// capacity, never on the routing.
//
// Every kernel reuses caller-provided buffers and does not allocate. Row
// moves are copy() calls; bad lengths return an error and leave every
// output untouched. Large calls split their rows over up to
// Routing.Workers goroutines (GroupByExpert and GroupByRank, which take no
// Routing, over GOMAXPROCS); each row is computed exactly as by a serial
// loop, so results do not depend on the split.

// Float is the element type of the permute kernels.
type Float interface{ ~float32 | ~float64 }

// ExpertIndex is the integer type of expert ids given to [PlanRouting].
type ExpertIndex interface{ ~int | ~int32 | ~int64 }

// permMinBytesPerWorker is the fewest bytes a goroutine of permForRows
// moves. Measured on the two-core development machine
// (BenchmarkPermuteWorkers, float32 rows of 256): moving 2 MiB, one
// goroutine is faster than two (65 against 43 GB/s, the data sits in
// cache); moving 4 MiB, two are faster (57 against 37-47 GB/s), and from 8
// MiB on two goroutines move rows 1.9 to 3 times faster than one.
const permMinBytesPerWorker = 2 << 20

// permForRows calls f on ranges [lo, hi) covering rows 0..rows−1, each row
// moving rowBytes bytes, on up to w goroutines (the first range on the
// caller's), and waits for them.
func permForRows(w Workers, rows, rowBytes int, f func(lo, hi int)) {
	k := 1
	if rows > 1 && rowBytes > 0 {
		k = min(w.Count(), rows, int(min(int64(rows)*int64(rowBytes)/permMinBytesPerWorker, math.MaxInt32)))
	}
	if k <= 1 {
		f(0, rows)
		return
	}
	var wg sync.WaitGroup
	for i := 1; i < k; i++ {
		lo, hi := i*rows/k, (i+1)*rows/k
		wg.Go(func() { f(lo, hi) })
	}
	f(0, rows/k)
	wg.Wait()
}

// Routing is the expert-major layout of one MoE dispatch: which token slot
// fills each packed row. [PlanRouting] fills it; reusing one Routing across
// steps reuses its slices. The fields are read-only for callers: the
// kernels trust them.
type Routing struct {
	// Tokens is n, the number of token rows; TopK is K, the slots per
	// token; Experts is E.
	Tokens, TopK, Experts int
	// Capacity is the rows per expert in static-capacity mode, 0 when the
	// layout is dropless.
	Capacity int

	// Counts[e] is the number of packed rows of expert e that hold a token
	// (at most Capacity in static-capacity mode).
	Counts []int
	// Routed[e] is the number of slots routed to expert e before the
	// capacity limit; Routed[e] − Counts[e] of them were dropped.
	Routed []int
	// Offsets has E+1 entries: expert e owns packed rows
	// [Offsets[e], Offsets[e+1]), the first Counts[e] of them live and the
	// rest pad rows. Offsets[E] is the number of packed rows.
	Offsets []int
	// RowSlot[p] is the slot t·K + j that fills packed row p (token
	// RowSlot[p]/K, choice RowSlot[p]%K), or −1 for a pad row.
	RowSlot []int32
	// SlotRow[s] is the packed row of slot s, or −1 when the slot is not
	// routed (expert −1) or was dropped by the capacity limit.
	SlotRow []int32

	// Unrouted counts slots whose expert is −1; Dropped counts slots
	// beyond their expert's capacity; Padded counts pad rows.
	Unrouted, Dropped, Padded int

	// Workers bounds the goroutines of the kernels given this Routing: the
	// caller's share of the cores (see [Workers]; 0 means GOMAXPROCS).
	// PlanRouting keeps it.
	Workers Workers

	scratch []int // PlanRouting's, kept for the next plan
}

// Rows returns the number of packed rows, Offsets[E] (0 for a Routing that
// was never planned).
func (r *Routing) Rows() int {
	if len(r.Offsets) == 0 {
		return 0
	}
	return r.Offsets[len(r.Offsets)-1]
}

// Source returns the token and choice that fill packed row p, with ok false
// for a pad row or a row out of range.
func (r *Routing) Source(p int) (token, choice int, ok bool) {
	if p < 0 || p >= len(r.RowSlot) || r.RowSlot[p] < 0 {
		return 0, 0, false
	}
	s := int(r.RowSlot[p])
	return s / r.TopK, s % r.TopK, true
}

// grow returns s resized to n elements, reusing its storage when it is
// large enough. The contents are unspecified.
func grow[T any](s []T, n int) []T {
	if cap(s) >= n {
		return s[:n]
	}
	return make([]T, n)
}

// PlanRouting computes the expert-major layout of experts (n·K slot expert
// ids, token-major: slot t·K + j is token t's j-th choice; −1 marks a slot
// that is not routed) into r, reusing r's slices. numExperts is E ≥ 1 and
// k is K ≥ 1; len(experts) must be a multiple of k. capacity 0 plans the
// dropless layout (one packed row per routed slot); capacity > 0 plans the
// static-capacity layout of E·capacity rows, keeping each expert's first
// capacity slots in slot order. It returns an error, leaving r unchanged,
// for an id outside [−1, E), bad sizes, or more than 2³¹−1 slots or rows.
func PlanRouting[I ExpertIndex](r *Routing, experts []I, k, numExperts, capacity int) error {
	const op = "PlanRouting"
	switch {
	case r == nil:
		return fmt.Errorf("kernels: %s: %w: nil Routing", op, ErrInvalid)
	case k < 1:
		return fmt.Errorf("kernels: %s: %w: top-k %d, want >= 1", op, ErrInvalid, k)
	case numExperts < 1:
		return fmt.Errorf("kernels: %s: %w: %d experts, want >= 1", op, ErrInvalid, numExperts)
	case capacity < 0:
		return fmt.Errorf("kernels: %s: %w: negative capacity %d", op, ErrInvalid, capacity)
	case len(experts)%k != 0:
		return fmt.Errorf("kernels: %s: %w: %d expert ids are not whole tokens of %d slots", op, ErrInvalid, len(experts), k)
	case len(experts) > math.MaxInt32:
		return fmt.Errorf("kernels: %s: %w: %d slots exceed the int32 row map", op, ErrInvalid, len(experts))
	case capacity > 0 && int64(capacity)*int64(numExperts) > math.MaxInt32:
		return fmt.Errorf("kernels: %s: %w: %d experts × capacity %d rows exceed the int32 row map", op, ErrInvalid, numExperts, capacity)
	}
	ne := numExperts
	// scratch is r's own: hist while counting, then cursor and end. r's
	// exported slices are written only once every id is known to be good.
	scratch := grow(r.scratch, 2*ne+1)
	hist := scratch[:ne+1]
	if s := countExperts(hist, experts); s >= 0 {
		return fmt.Errorf("kernels: %s: %w: slot %d (token %d, choice %d) has expert %d, want -1 or [0, %d)",
			op, ErrInvalid, s, s/k, s%k, int64(experts[s]), numExperts)
	}
	unrouted := hist[0]
	routed := grow(r.Routed, ne)
	copy(routed, hist[1:])
	counts := grow(r.Counts, ne)
	offsets := grow(r.Offsets, ne+1)
	dropped, padded := 0, 0
	offsets[0] = 0
	for e, c := range routed {
		if capacity > 0 {
			kept := min(c, capacity)
			counts[e] = kept
			dropped += c - kept
			padded += capacity - kept
			offsets[e+1] = offsets[e] + capacity
		} else {
			counts[e] = c
			offsets[e+1] = offsets[e] + c
		}
	}
	rows := offsets[ne]
	rowSlot := grow(r.RowSlot, rows)
	slotRow := grow(r.SlotRow, len(experts))
	cursor, end := scratch[:ne], scratch[ne:2*ne]
	for e := range ne {
		cursor[e], end[e] = offsets[e], offsets[e]+counts[e]
	}
	placeSlots(rowSlot, slotRow, cursor, end, experts)
	if padded > 0 {
		for e := range ne {
			for p := offsets[e] + counts[e]; p < offsets[e+1]; p++ {
				rowSlot[p] = -1
			}
		}
	}
	*r = Routing{
		Tokens: len(experts) / k, TopK: k, Experts: ne, Capacity: capacity,
		Counts: counts, Routed: routed, Offsets: offsets, RowSlot: rowSlot, SlotRow: slotRow,
		Unrouted: unrouted, Dropped: dropped, Padded: padded,
		Workers: r.Workers, scratch: scratch,
	}
	return nil
}

// countExperts counts every slot of experts into hist[e+1] (hist[0]: the
// slots with id −1) and returns the first slot whose id is outside
// [−1, len(hist)−1), or −1 when every id is good. It is a loop of its own,
// as is placeSlots, so that the compiler keeps its variables in registers.
//
//go:noinline
func countExperts[I ExpertIndex](hist []int, experts []I) int {
	clear(hist)
	n := uint64(len(hist))
	for s, e := range experts {
		i := uint64(int64(e) + 1) // −1 → 0; below −1 wraps past n
		if i >= n {
			return s
		}
		hist[i]++
	}
	return -1
}

// placeSlots gives every routed slot of experts the next row of its
// expert, in slot order: cursor[e] is expert e's next row and end[e] the
// end of the rows it keeps. A slot with id −1 or past its expert's end
// gets row −1.
//
//go:noinline
func placeSlots[I ExpertIndex](rowSlot, slotRow []int32, cursor, end []int, experts []I) {
	slotRow = slotRow[:len(experts)]
	for s, e := range experts {
		if e < 0 {
			slotRow[s] = -1
			continue
		}
		p := cursor[e]
		if p >= end[e] {
			slotRow[s] = -1
			continue
		}
		cursor[e] = p + 1
		rowSlot[p] = int32(s)
		slotRow[s] = int32(p)
	}
}

// check validates that r is a planned layout whose slices agree with its
// sizes, so that the kernels can trust it.
func (r *Routing) check(op string) error {
	if r == nil {
		return fmt.Errorf("kernels: %s: %w: nil Routing", op, ErrInvalid)
	}
	if r.TopK < 1 || r.Experts < 1 || len(r.Offsets) != r.Experts+1 || len(r.Counts) != r.Experts ||
		len(r.SlotRow) != r.Tokens*r.TopK || len(r.RowSlot) != r.Offsets[r.Experts] {
		return fmt.Errorf("kernels: %s: %w: Routing is not planned (tokens %d, top-k %d, experts %d, %d offsets, %d row map, %d slot map); call PlanRouting",
			op, ErrInvalid, r.Tokens, r.TopK, r.Experts, len(r.Offsets), len(r.RowSlot), len(r.SlotRow))
	}
	return nil
}

// checkRowSlot and checkSlotRow validate the row maps a kernel indexes
// with, so that a Routing whose exported fields were changed by hand gives
// an error instead of an index panic.
func (r *Routing) checkRowSlot(op string) error {
	return permIdxCheck(op, "RowSlot", r.RowSlot, len(r.SlotRow))
}

func (r *Routing) checkSlotRow(op string) error {
	return permIdxCheck(op, "SlotRow", r.SlotRow, len(r.RowSlot))
}

// permIdxCheck checks that every entry of idx is −1 or in [0, limit).
func permIdxCheck(op, name string, idx []int32, limit int) error {
	lo, hi := int32(-1), int32(-1)
	for _, v := range idx {
		lo = min(lo, v)
		hi = max(hi, v)
	}
	if lo < -1 || int(hi) >= limit {
		return fmt.Errorf("kernels: %s: %w: Routing.%s holds entries in [%d, %d], want -1 or [0, %d); was it changed after PlanRouting?", op, ErrInvalid, name, lo, hi, limit)
	}
	return nil
}

// permLen checks that buf holds rows rows of width d.
func permLen(op, name string, l, rows, d int) error {
	want, ok := checked.Mul(rows, d)
	if !ok {
		return fmt.Errorf("kernels: %s: %w: %s of %d rows × %d: the element count overflows int", op, ErrInvalid, name, rows, d)
	}
	if l != want {
		return fmt.Errorf("kernels: %s: %w: len(%s) = %d, want %d rows × %d = %d", op, ErrInvalid, name, l, rows, d, want)
	}
	return nil
}

// permWidth checks the row width.
func permWidth(op string, d int) error {
	if d < 0 {
		return fmt.Errorf("kernels: %s: %w: negative row width %d", op, ErrInvalid, d)
	}
	return nil
}

// sizeOf returns the size of T in bytes.
func sizeOf[T Float]() int {
	var z T
	return int(unsafe.Sizeof(z))
}

// Permute is the dispatch copy: packed row p of out (rows of width d,
// r.Rows() of them) becomes row RowSlot[p]/K of x (r.Tokens rows of width
// d), and pad rows become zero. len(x) must be r.Tokens·d and len(out)
// r.Rows()·d; out must not overlap x. Its adjoint is [Unpermute] with nil
// gates.
func Permute[T Float](out, x []T, d int, r *Routing) error {
	const op = "Permute"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := r.checkRowSlot(op); err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "x", len(x), r.Tokens, d), permLen(op, "out", len(out), r.Rows(), d)); err != nil {
		return err
	}
	gatherRows(r.Workers, out, x, r.RowSlot, r.TopK, d)
	return nil
}

// PermuteSlots gathers per-slot rows into the packed order: packed row p of
// out becomes row RowSlot[p] of v (n·K rows of width d), and pad rows
// become zero. With d = 1 it gives each packed row its gate (Megatron's
// permuted probs). len(v) must be n·K·d and len(out) r.Rows()·d. Its
// adjoint is [UnpermuteSlots].
func PermuteSlots[T Float](out, v []T, d int, r *Routing) error {
	const op = "PermuteSlots"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := r.checkRowSlot(op); err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "v", len(v), len(r.SlotRow), d), permLen(op, "out", len(out), r.Rows(), d)); err != nil {
		return err
	}
	gatherRows(r.Workers, out, v, r.RowSlot, 1, d)
	return nil
}

// UnpermuteSlots scatters packed rows back to their slots: row s of v (n·K
// rows of width d) becomes packed row SlotRow[s] of packed, or zero for a
// slot that is not routed or was dropped. It is the adjoint of
// [PermuteSlots] (and, with d = 1, the gradient of the gates a
// [PermuteSlots] call gathered).
func UnpermuteSlots[T Float](v, packed []T, d int, r *Routing) error {
	const op = "UnpermuteSlots"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := r.checkSlotRow(op); err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "v", len(v), len(r.SlotRow), d), permLen(op, "packed", len(packed), r.Rows(), d)); err != nil {
		return err
	}
	gatherRows(r.Workers, v, packed, r.SlotRow, 1, d)
	return nil
}

// gatherRows sets row i of dst to row idx[i]/div of src, or to zero when
// idx[i] < 0.
func gatherRows[T Float](w Workers, dst, src []T, idx []int32, div, d int) {
	permForRows(w, len(idx), 2*d*sizeOf[T](), func(lo, hi int) {
		gatherRange(dst, src, idx, div, d, lo, hi)
	})
}

func gatherRange[T Float](dst, src []T, idx []int32, div, d, lo, hi int) {
	if d == 1 {
		for i := lo; i < hi; i++ {
			if s := idx[i]; s >= 0 {
				dst[i] = src[int(s)/div]
			} else {
				dst[i] = 0
			}
		}
		return
	}
	for i := lo; i < hi; i++ {
		o := dst[i*d : i*d+d]
		s := int(idx[i])
		if s < 0 {
			clear(o)
			continue
		}
		s /= div
		copy(o, src[s*d:s*d+d])
	}
}

// Unpermute is the combine: row t of out (r.Tokens rows of width d) becomes
// Σ_j gates[t·K+j] · packed[SlotRow[t·K+j]] over the token's live slots
// (zero when none is live), summed pairwise in slot order:
// (g₀x₀ + g₁x₁) + (g₂x₂ + g₃x₃) + …. nil gates weight every slot by 1,
// the pure scatter-add that is [Permute]'s adjoint. len(packed) must be
// r.Rows()·d, len(out) r.Tokens·d and len(gates) n·K when not nil; out must
// not overlap packed.
func Unpermute[T Float](out, packed, gates []T, d int, r *Routing) error {
	const op = "Unpermute"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	if err := r.checkSlotRow(op); err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "out", len(out), r.Tokens, d), permLen(op, "packed", len(packed), r.Rows(), d)); err != nil {
		return err
	}
	if gates != nil && len(gates) != len(r.SlotRow) {
		return fmt.Errorf("kernels: %s: %w: len(gates) = %d, want %d tokens × %d = %d", op, ErrInvalid, len(gates), r.Tokens, r.TopK, len(r.SlotRow))
	}
	unpermute(out, packedRows[T]{flat: packed, d: d}, gates, d, r)
	return nil
}

// unpermute is Unpermute's loop over rows from src: unpermuteF32 for
// float32, unpermuteGo otherwise.
func unpermute[T Float](out []T, src packedRows[T], gates []T, d int, r *Routing) {
	if o32, ok := any(out).([]float32); ok {
		unpermuteF32(o32, any(src).(packedRows[float32]), any(gates).([]float32), d, r)
		return
	}
	unpermuteGo(out, src, gates, d, r)
}

// unpermuteGo is unpermute's portable loop.
func unpermuteGo[T Float](out []T, src packedRows[T], gates []T, d int, r *Routing) {
	k := r.TopK
	permForRows(r.Workers, r.Tokens, (k+1)*d*sizeOf[T](), func(lo, hi int) {
		for t := lo; t < hi; t++ {
			// Live slots are taken two at a time, so that o is read and
			// written once per pair: o = g₀x₀ + g₁x₁, then o += g₂x₂ + g₃x₃,
			// and a last odd one alone.
			o := out[t*d : t*d+d]
			first := true
			var x0 []T
			var g0 T
			for s := t * k; s < t*k+k; s++ {
				p := int(r.SlotRow[s])
				if p < 0 {
					continue
				}
				g := T(1)
				if gates != nil {
					g = gates[s]
				}
				if x0 == nil {
					x0, g0 = src.row(p, r.Offsets), g
					continue
				}
				permPair(o, x0, src.row(p, r.Offsets), g0, g, first)
				x0, first = nil, false
			}
			switch {
			case x0 != nil && first && gates == nil:
				copy(o, x0)
			case x0 != nil && first:
				permScale(o, x0, g0)
			case x0 != nil:
				permAxpy(o, x0, g0)
			case first:
				clear(o)
			}
		}
	})
}

// UnpermuteBackward is the backward of [Unpermute] for upstream gradient
// dout (r.Tokens rows of width d):
//
//   - dpacked (r.Rows() rows of width d, or nil to skip) gets
//     gates[s] · dout[s/K] in the packed row of each live slot s, and zero in
//     pad rows: the gate-scaled gather that is the combine's adjoint (with
//     nil gates, exactly [Permute] of dout).
//   - dgates (n·K values, or nil to skip) gets ⟨packed[SlotRow[s]], dout[s/K]⟩
//     for each live slot, accumulated in float64, and zero for a slot that
//     is not routed or was dropped. It needs packed, the combine's input.
//
// packed may be nil when dgates is; gates may be nil (weights of 1). Both
// outputs come from one pass over the packed rows, which reads each slot's
// dout row once for the two.
func UnpermuteBackward[T Float](dpacked, dgates, dout, packed, gates []T, d int, r *Routing) error {
	const op = "UnpermuteBackward"
	if err := errors.Join(r.check(op), permWidth(op, d)); err != nil {
		return err
	}
	slots := len(r.SlotRow)
	var errs []error
	errs = append(errs, permLen(op, "dout", len(dout), r.Tokens, d))
	if dpacked != nil {
		errs = append(errs, permLen(op, "dpacked", len(dpacked), r.Rows(), d))
	}
	if dgates != nil {
		errs = append(errs, permLen(op, "dgates", len(dgates), slots, 1), permLen(op, "packed", len(packed), r.Rows(), d))
	}
	if gates != nil {
		errs = append(errs, permLen(op, "gates", len(gates), slots, 1))
	}
	if dpacked != nil || dgates != nil {
		errs = append(errs, r.checkRowSlot(op))
	}
	if dgates != nil {
		errs = append(errs, r.checkSlotRow(op))
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if dpacked == nil && dgates == nil {
		return nil // nothing asked for
	}
	if dgates != nil {
		// Slots without a packed row get no gradient from the row pass.
		for s, p := range r.SlotRow {
			if p < 0 {
				dgates[s] = 0
			}
		}
	}
	unpermuteBackwardRows(r.Workers, dpacked, dgates, dout, packed, gates, r.RowSlot, r.TopK, d)
	return nil
}

// unpermuteBackwardRows runs UnpermuteBackward over the packed rows whose
// slots are idx, in one pass: row i of dpacked (nil: skip) gets
// gates[s]·dout[s/K] for its slot s = idx[i] (zero for a pad row), and
// dgates[s] (nil: skip) ⟨row i of packed, dout[s/K]⟩, reading each dout row
// once for both. Pad rows leave dgates alone. Its loop is
// unpermuteBackwardF32 for float32 and unpermuteBackwardGo otherwise.
func unpermuteBackwardRows[T Float](w Workers, dpacked, dgates, dout, packed, gates []T, idx []int32, k, d int) {
	if dgates == nil && gates == nil {
		if dpacked != nil {
			gatherRows(w, dpacked, dout, idx, k, d)
		}
		return
	}
	if dout32, ok := any(dout).([]float32); ok {
		unpermuteBackwardF32(w, any(dpacked).([]float32), any(dgates).([]float32), dout32, any(packed).([]float32), any(gates).([]float32), idx, k, d)
		return
	}
	unpermuteBackwardGo(w, dpacked, dgates, dout, packed, gates, idx, k, d)
}

// unpermuteBackwardGo is unpermuteBackwardRows's portable loop.
func unpermuteBackwardGo[T Float](w Workers, dpacked, dgates, dout, packed, gates []T, idx []int32, k, d int) {
	permForRows(w, len(idx), 3*d*sizeOf[T](), func(lo, hi int) {
		var o, y []T
		for i := lo; i < hi; i++ {
			if dpacked != nil {
				o = dpacked[i*d : i*d+d]
			}
			s := int(idx[i])
			if s < 0 {
				clear(o)
				continue
			}
			if dgates != nil {
				y = packed[i*d : i*d+d]
			}
			g := T(1)
			if gates != nil {
				g = gates[s]
			}
			t := s / k
			if dot := permScaleDot(o, dout[t*d:t*d+d], y, g, 0); dgates != nil {
				dgates[s] = T(dot)
			}
		}
	})
}

// The row primitives of the generic loops: portable, element by element.
// Float32 rows go through the vector kernels in permute_f32.go, which use
// these for their last len mod 8 elements.

// permScale sets o[i] = g·x[i]; len(x) >= len(o).
func permScale[T Float](o, x []T, g T) {
	x = x[:len(o)]
	for i := range o {
		o[i] = g * x[i]
	}
}

// permAxpy sets o[i] += g·x[i]; len(x) >= len(o).
func permAxpy[T Float](o, x []T, g T) {
	x = x[:len(o)]
	for i := range o {
		o[i] += g * x[i]
	}
}

// permPair sets o[i] = a·x[i] + b·y[i] (set) or adds it to o[i];
// len(x), len(y) >= len(o). x is never nil here, y may alias x.
func permPair[T Float](o, x, y []T, a, b T, set bool) {
	x, y = x[:len(o)], y[:len(o)]
	for i := range o {
		if set {
			o[i] = a*x[i] + b*y[i]
		} else {
			o[i] += a*x[i] + b*y[i]
		}
	}
}

// permScaleDot sets o[i] = g·x[i] unless o is nil, and returns s plus
// Σ x[i]·y[i], each product exact in float64 and added in turn, or s when
// y is nil: the gate-scaled gather and the gate gradient of one slot in
// one pass over x.
func permScaleDot[T Float](o, x, y []T, g T, s float64) float64 {
	if y == nil {
		if o != nil {
			permScale(o, x, g)
		}
		return s
	}
	y = y[:len(x)]
	for i := range x {
		if o != nil {
			o[i] = g * x[i]
		}
		s += float64(x[i]) * float64(y[i])
	}
	return s
}

// ExpertBounds splits experts 0..numExperts−1 into contiguous ranges over
// ranks ranks by the torch.chunk rule (chunk = ⌈E/ranks⌉, the last ranks
// may own fewer or none): rank q owns experts [b[q], b[q+1]) of the
// returned b (ranks+1 entries). It returns an error for numExperts < 0 or
// ranks < 1.
func ExpertBounds(numExperts, ranks int) ([]int, error) {
	if numExperts < 0 || ranks < 1 {
		return nil, fmt.Errorf("kernels: ExpertBounds: %w: %d experts over %d ranks, want experts >= 0 and ranks >= 1", ErrInvalid, numExperts, ranks)
	}
	chunk := (numExperts + ranks - 1) / ranks
	b := make([]int, ranks+1)
	for q := range b {
		b[q] = min(q*chunk, numExperts)
	}
	return b, nil
}

// RankSplits sets dst[q] to the number of packed rows owned by rank q when
// rank q owns experts [bounds[q], bounds[q+1]) (bounds ascending from 0 to
// r.Experts, len(bounds) = len(dst)+1, as from [ExpertBounds]). Because
// the packed layout is expert-major and ownership is contiguous, rank q's
// rows are already one contiguous send buffer, starting at packed row
// Offsets[bounds[q]]: dst is the all-to-all-v send split, with no copy.
// Pad rows count (static capacity sends E·capacity rows).
func (r *Routing) RankSplits(dst, bounds []int) error {
	const op = "RankSplits"
	if err := r.check(op); err != nil {
		return err
	}
	if len(bounds) != len(dst)+1 || len(bounds) < 2 || bounds[0] != 0 || bounds[len(bounds)-1] != r.Experts {
		return fmt.Errorf("kernels: %s: %w: bounds %v for %d ranks, want %d ascending entries from 0 to %d", op, ErrInvalid, bounds, len(dst), len(dst)+1, r.Experts)
	}
	for q := range dst {
		if bounds[q+1] < bounds[q] {
			return fmt.Errorf("kernels: %s: %w: bounds %v are not ascending", op, ErrInvalid, bounds)
		}
	}
	for q := range dst {
		dst[q] = r.Offsets[bounds[q+1]] - r.Offsets[bounds[q]]
	}
	return nil
}

// chunkCheck validates the [ranks, local] count matrix of GroupByRank and
// GroupByExpert and returns the total row count.
func chunkCheck(op string, counts []int, ranks, local int) (int, error) {
	if n, ok := checked.Product([]int{ranks, local}); !ok || len(counts) != n {
		return 0, fmt.Errorf("kernels: %s: %w: %d counts for %d ranks × %d local experts", op, ErrInvalid, len(counts), ranks, local)
	}
	for i, c := range counts {
		if c < 0 {
			return 0, fmt.Errorf("kernels: %s: %w: counts[%d] (rank %d, local expert %d) = %d is negative", op, ErrInvalid, i, i/local, i%local, c)
		}
	}
	total, ok := checked.Sum(counts)
	if !ok {
		return 0, fmt.Errorf("kernels: %s: %w: counts %v sum past the largest int", op, ErrInvalid, counts)
	}
	return total, nil
}

// GroupByExpert is the unpack after the dispatch all-to-all: src holds the
// rows received from ranks source ranks in rank order, each rank's rows
// grouped by local expert (rank-major: chunk (q, l) of counts[q·local+l]
// rows); dst gets the same rows expert-major (chunk (l, q) of local expert
// l from rank q), the layout a grouped expert GEMM wants. counts is a
// [ranks, local] matrix in both directions. Rows have width d; len(src) and
// len(dst) must both be Σcounts·d and must not overlap. Each chunk moves
// with one copy. [GroupByRank] is the inverse (and the adjoint).
func GroupByExpert[T Float](dst, src []T, d int, counts []int, ranks, local int) error {
	return groupChunks("GroupByExpert", dst, src, d, counts, ranks, local, true)
}

// GroupByRank is the pack before the combine all-to-all, the inverse of
// [GroupByExpert]: src holds rows expert-major (chunk (l, q): local expert
// l's rows from rank q, counts[q·local+l] of them) and dst gets them
// rank-major, so that rank q's rows form one contiguous send buffer in
// local-expert order. Rows have width d; len(src) and len(dst) must both be
// Σcounts·d and must not overlap.
func GroupByRank[T Float](dst, src []T, d int, counts []int, ranks, local int) error {
	return groupChunks("GroupByRank", dst, src, d, counts, ranks, local, false)
}

// groupChunks moves the chunks of a [ranks, local] count matrix between the
// rank-major and the expert-major layouts.
func groupChunks[T Float](op string, dst, src []T, d int, counts []int, ranks, local int, toExpert bool) error {
	if err := permWidth(op, d); err != nil {
		return err
	}
	total, err := chunkCheck(op, counts, ranks, local)
	if err != nil {
		return err
	}
	if err := errors.Join(permLen(op, "src", len(src), total, d), permLen(op, "dst", len(dst), total, d)); err != nil {
		return err
	}
	if total == 0 || d == 0 {
		return nil
	}
	// Walk the chunks in rank-major order; em is the expert-major row
	// offset of chunk (q, l): rows of experts < l from every rank, plus
	// rows of expert l from ranks < q.
	move := func(q0, q1 int) {
		rm := 0
		for q := range q0 {
			for l := range local {
				rm += counts[q*local+l]
			}
		}
		for q := q0; q < q1; q++ {
			em := 0
			for l := range local {
				for qq := range ranks {
					if qq < q {
						em += counts[qq*local+l]
					}
				}
				c := counts[q*local+l]
				if c > 0 {
					a, b := rm*d, em*d
					if toExpert {
						copy(dst[b:b+c*d], src[a:a+c*d])
					} else {
						copy(dst[a:a+c*d], src[b:b+c*d])
					}
				}
				rm += c
				for qq := q; qq < ranks; qq++ {
					em += counts[qq*local+l]
				}
			}
		}
	}
	permForRows(0, ranks, 2*total*d*sizeOf[T]()/max(ranks, 1), move)
	return nil
}
