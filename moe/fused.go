package moe

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/kernels"
)

// The fused data path, taken where the expert-parallel ranks share one
// address space (comm.SharedMemory: comm/local's in-process ranks). Each
// pass is one Share over the ep axis in which every rank publishes a view
// of its rows and pulls what it needs straight from its peers' views, so
// that each row moves once, as DeepEP's kernels write straight into their
// peers' buffers:
//
//	dispatch:          the expert's rank gathers its rows from the token
//	                   ranks' inputs (PermuteExpert), into the routed layout
//	combine:           the token's rank sums its rows, gate-weighted, from
//	                   the experts' outputs (UnpermuteSegments)
//	combine backward:  the expert's rank gathers the gate-scaled gradient
//	                   rows and, in the same pass over each gradient row,
//	                   computes its slots' gate gradient against the rows
//	                   it holds, which it writes into the token rank's
//	                   gate gradient (UnpermuteBackwardExpert)
//	dispatch backward: the token's rank sums its rows' gradients
//	                   (UnpermuteSegments without gates)
//
// No send buffer is packed, no received buffer regrouped and no workspace
// used: against the collective path this saves two full passes over the
// payload per direction. Every rank checks every rank's counts and buffer
// lengths in every pass, so handles that disagree fail alike on all ranks
// before any row moves; after that check no kernel can fail, which the
// combine's backward relies on, since there one rank writes into another's
// gate gradient. The time of a fused pass counts as Timings.Fused.

// fusedView is what one rank publishes in a fused pass.
type fusedView[T kernels.Float] struct {
	plan   *kernels.Routing // this rank's token slots, expert-major
	chunks []int            // [P·L]: rows from rank q for local expert l at q·L+l
	at     []int            // [L·P]: first routed row of local expert l's rows from rank q at l·P+q
	width  int
	tokens []T // token-side rows: the dispatched tokens, or the combined tokens' gradient
	gates  []T // the gates of this rank's slots (nil: weights of 1)
	dgates []T // the gates' gradient, which the experts' ranks fill (nil: not wanted)
	routed []T // expert-side rows: the experts' outputs, or the gradient of the dispatched rows
}

// useFused reports whether dispatches through h take the fused path.
func (h *Handle) useFused(cfg DispatchConfig) bool {
	if h.ranks == 1 || cfg.Collectives {
		return false
	}
	_, ok := h.c.(comm.SharedMemory)
	return ok
}

// view returns h's view of rows of the given width.
func view[T kernels.Float](h *Handle, width int) *fusedView[T] {
	return &fusedView[T]{plan: &h.plan, chunks: h.chunks, at: h.at, width: width}
}

// share runs one fused pass: it publishes v and runs pull on every rank's
// views once they have been checked against each other.
func share[T kernels.Float](ctx context.Context, h *Handle, what string, v *fusedView[T], phase *Timings, pull func(peers []*fusedView[T]) error) error {
	start := time.Now()
	sm := h.c.(comm.SharedMemory)
	err := sm.Share(ctx, v, func(shared []any) error {
		peers := make([]*fusedView[T], len(shared))
		for q, s := range shared {
			p, ok := s.(*fusedView[T])
			if !ok {
				return fmt.Errorf("%w: rank %d of axis %q shared %T in the %s, want %T: the ranks run different passes", ErrMismatch, q, h.axis, s, what, v)
			}
			peers[q] = p
		}
		if err := checkViews(h, peers); err != nil {
			return err
		}
		return pull(peers)
	})
	phase.Fused += time.Since(start)
	if err != nil {
		return fmt.Errorf("%s over axis %q (fused): %w", what, h.axis, err)
	}
	return nil
}

// checkViews checks, identically on every rank, that the rows every rank
// plans to send each expert are the rows the expert's rank expects, and
// that the row widths agree: the check the collective path's
// all-to-all-v makes on its counts.
func checkViews[T kernels.Float](h *Handle, peers []*fusedView[T]) error {
	p, l := h.ranks, h.local
	var bad []string
	for q, v := range peers {
		if v.width != peers[0].width {
			bad = append(bad, fmt.Sprintf("rank %d has rows of width %d, rank 0 of width %d", q, v.width, peers[0].width))
		}
		if v.plan.Experts != p*l || len(v.chunks) != p*l {
			bad = append(bad, fmt.Sprintf("rank %d has %d experts", q, v.plan.Experts))
		}
	}
	if bad == nil {
		bad = checkBuffers(h, peers)
	}
	if bad == nil {
		for q, src := range peers {
			for r, dst := range peers {
				for j := range l {
					x := r*l + j
					if n, want := src.plan.Offsets[x+1]-src.plan.Offsets[x], dst.chunks[q*l+j]; n != want {
						bad = append(bad, fmt.Sprintf("rank %d sends %d rows for expert %d, rank %d expects %d", q, n, x, r, want))
					}
				}
			}
		}
	}
	if bad == nil {
		return nil
	}
	if len(bad) > 4 {
		bad = append(bad[:4], fmt.Sprintf("and %d more", len(bad)-4))
	}
	return fmt.Errorf("%w: the ranks' handles disagree (%s); no row moved", ErrMismatch, strings.Join(bad, "; "))
}

// checkBuffers checks that every view's buffers hold what its plan says
// (token rows, one gate per slot, the routed rows its peers expect), so
// that the kernels of a pass cannot fail on one rank only.
func checkBuffers[T kernels.Float](h *Handle, peers []*fusedView[T]) []string {
	var bad []string
	for q, v := range peers {
		// The peer's sizes, checked: a product that wraps could match a
		// short buffer.
		slots, ok1 := checked.Mul(v.plan.Tokens, v.plan.TopK)
		tokens, ok2 := checked.Mul(v.plan.Tokens, v.width)
		routed, ok3 := checked.Sum(v.chunks)
		routedVals, ok4 := checked.Mul(routed, v.width)
		if !ok1 || !ok2 || !ok3 || !ok4 {
			bad = append(bad, fmt.Sprintf("rank %d has sizes that overflow int (%d tokens, K = %d, width %d, routed rows %v)", q, v.plan.Tokens, v.plan.TopK, v.width, v.chunks))
			continue
		}
		for _, b := range []struct {
			name string
			buf  []T
			want int
		}{{"token rows", v.tokens, tokens}, {"gates", v.gates, slots}, {"gate gradient", v.dgates, slots}, {"routed rows", v.routed, routedVals}} {
			if b.buf != nil && len(b.buf) != b.want {
				bad = append(bad, fmt.Sprintf("rank %d shares %d values of %s, want %d", q, len(b.buf), b.name, b.want))
			}
		}
	}
	return bad
}

// chunk returns rows [at, at+n) of width w of buf, or an error when buf is
// too short (a view that checkViews let through cannot be).
func chunk[T kernels.Float](buf []T, at, n, w int) ([]T, error) {
	bad := at < 0 || n < 0 || at > len(buf) || n > len(buf) // then at+n fits
	end, ok := checked.Product([]int{at + n, w})
	if bad || !ok || end > len(buf) {
		return nil, fmt.Errorf("rows [%d, +%d) of width %d outside a buffer of %d values", at, n, w, len(buf))
	}
	return buf[at*w : end], nil
}

// gatherRouted fills routed (this rank's routed layout, rows of width w)
// with every token rank's rows for this rank's experts.
func gatherRouted[T kernels.Float](h *Handle, routed []T, w int, peers []*fusedView[T]) error {
	return forExpertChunks(h, peers, func(j, q, x int, v *fusedView[T]) error {
		dst, err := chunk(routed, h.at[j*h.ranks+q], h.chunks[q*h.local+j], w)
		if err != nil {
			return err
		}
		return kernels.PermuteExpert(dst, v.tokens, w, v.plan, x)
	})
}

// forExpertChunks calls f for every local expert j (global id x) of this
// rank and every token rank q, with q's view: once for each chunk of the
// routed layout, in layout order.
func forExpertChunks[T kernels.Float](h *Handle, peers []*fusedView[T], f func(j, q, x int, v *fusedView[T]) error) error {
	for j := range h.local {
		x := h.rank*h.local + j
		for q, v := range peers {
			if err := f(j, q, x, v); err != nil {
				return fmt.Errorf("rows of rank %d for expert %d: %w", q, x, err)
			}
		}
	}
	return nil
}

// segments returns, for every expert, this rank's rows of it inside the
// routed rows of the expert's rank's view.
func segments[T kernels.Float](h *Handle, w int, peers []*fusedView[T]) ([][]T, error) {
	p, l := h.ranks, h.local
	segs := make([][]T, h.e)
	for x := range segs {
		q, j := x/l, x%l
		v := peers[q]
		seg, err := chunk(v.routed, v.at[j*p+h.rank], h.plan.Offsets[x+1]-h.plan.Offsets[x], w)
		if err != nil {
			return nil, fmt.Errorf("rows of expert %d on rank %d: %w", x, q, err)
		}
		segs[x] = seg
	}
	return segs, nil
}

// fusedDispatch moves this rank's tokens xd to the experts: the routed
// rows of this rank's experts, gathered from every rank.
func fusedDispatch[T kernels.Float](ctx context.Context, h *Handle, xd []T) ([]T, error) {
	out := rowsBlock[T](h, sum(h.recv)*h.d, false)
	v := view[T](h, h.d)
	v.tokens = xd
	err := share(ctx, h, "dispatch", v, &h.stats.Forward, func(peers []*fusedView[T]) error {
		return gatherRouted(h, out, h.d, peers)
	})
	return out, err
}

// fusedUnpermute sums every token's rows from the experts' routed rows y
// (width w), weighted by gates (nil: unweighted): the combine's result, or
// with grad set the dispatch's input gradient.
func fusedUnpermute[T kernels.Float](ctx context.Context, h *Handle, what string, y, gates []T, w int, grad bool, phase *Timings) ([]T, error) {
	out := rowsBlock[T](h, h.n*w, grad)
	v := view[T](h, w)
	v.routed = y
	err := share(ctx, h, what, v, phase, func(peers []*fusedView[T]) error {
		segs, err := segments(h, w, peers)
		if err != nil {
			return err
		}
		return kernels.UnpermuteSegments(out, segs, gates, w, &h.plan)
	})
	return out, err
}

// fusedCombineBackward moves the gate-scaled gradient gd of the combined
// tokens (width w) to the experts, into dy (nil: not wanted), and computes
// the gates' gradient into dgates (nil: not wanted) from the experts' rows
// y that the combine summed. Each expert's rank does both for its rows in
// one pass (kernels.UnpermuteBackwardExpert): it reads a token's gradient
// row once, from the token's rank, for the scaled row it keeps and for the
// dot product with the row it holds, whose result it writes into the
// token rank's dgates. Slots without a row (not routed, or dropped) get 0
// from their own rank, before the pass; every other slot is written by
// exactly one rank, the owner of its expert. Since peers write into it,
// dgates must be memory that is not handed out again if the pass fails.
func fusedCombineBackward[T kernels.Float](ctx context.Context, h *Handle, gd, gates, y, dy, dgates []T, w int) error {
	if dgates != nil {
		for s, p := range h.plan.SlotRow {
			if p < 0 {
				dgates[s] = 0
			}
		}
	}
	v := view[T](h, w)
	// y is shared only so that checkViews checks its length on every
	// rank: no peer reads it, but a short y failing here alone would
	// leave the peers' gate gradients short without an error.
	v.tokens, v.gates, v.dgates, v.routed = gd, gates, dgates, y
	return share(ctx, h, "combine backward", v, &h.stats.Backward, func(peers []*fusedView[T]) error {
		return forExpertChunks(h, peers, func(j, q, x int, peer *fusedView[T]) error {
			if dy == nil && peer.dgates == nil {
				return nil
			}
			at, n := h.at[j*h.ranks+q], h.chunks[q*h.local+j]
			var rows, held []T
			var err error
			if dy != nil {
				if rows, err = chunk(dy, at, n, w); err != nil {
					return err
				}
			}
			if peer.dgates != nil {
				if held, err = chunk(y, at, n, w); err != nil {
					return err
				}
			}
			return kernels.UnpermuteBackwardExpert(rows, peer.dgates, peer.tokens, held, peer.gates, w, peer.plan, x)
		})
	})
}
