package moe

import (
	"context"
	"fmt"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// The data path of dispatch and combine. Every direction is built from
// two moves through the handle:
//
//	toExperts: packed send rows (expert-major, this rank's slots)
//	           -> all-to-all-v over the ep axis -> GroupByExpert -> routed rows
//	toTokens:  routed rows -> GroupByRank -> all-to-all-v back -> packed rows
//
// Dispatch is Permute then toExperts; its backward is toTokens then the
// unweighted Unpermute (a scatter-add). Combine is toTokens then the
// gate-weighted Unpermute; its backward is UnpermuteBackward (the
// gate-scaled gather, plus the gate gradient from the saved packed rows)
// then toExperts. So each op's backward runs the other's data path.
//
// With several local experts (Handle.split) the all-to-all-v is split
// into one per local expert l: the plan orders the packed rows by local
// expert, then destination rank (Handle.label), so call l sends one
// contiguous run, rank q's rows for its expert l, and receives straight
// into expert l's run of the routed rows, source rank after source rank:
// the routed layout itself. That saves the regrouping pass on each side
// (GroupByExpert, GroupByRank), a full read and write of the payload, for
// L−1 more collective calls; one local expert needs neither.
//
// Buffers: results and gradients are allocated (autograd owns them); the
// buffers in between come from the handle's Workspace (slot 0: what goes
// into an all-to-all-v, slot 1: what comes out of it), except where one
// rank makes an intermediate the result, or a combine keeps its received
// rows for backward.

// localData returns the local block of dt as a []T.
func localData[T kernels.Float](dt *placement.DTensor, what string) ([]T, error) {
	d, ok := dt.LocalData().([]T)
	if !ok {
		return nil, fmt.Errorf("%w: %s: local block is %T", ErrInvalid, what, dt.LocalData())
	}
	return d, nil
}

// wait, with DispatchConfig.Diagnostics, blocks at a barrier over the
// expert-parallel axis until every rank of the group has arrived, and
// counts the time as phase.Wait: called first in the combine and both
// backward passes, it absorbs the skew that the experts' (or the rest of
// the model's) uneven work left, which the pass's exchange would
// otherwise absorb.
func (h *Handle) wait(ctx context.Context, phase *Timings) error {
	if !h.diag || h.ranks == 1 {
		return nil
	}
	start := time.Now()
	err := comm.Barrier(ctx, h.c)
	phase.Wait += time.Since(start)
	if err != nil {
		return fmt.Errorf("diagnostics barrier over axis %q: %w", h.axis, err)
	}
	return nil
}

// exchange runs the payload all-to-all-v over the expert-parallel axis:
// sendRows[q] rows of width w go to rank q, recvRows[q] come from it.
func (h *Handle) exchangeRows(ctx context.Context, send, recv any, sendRows, recvRows []int, w int, phase *Timings) error {
	if h.ranks == 1 {
		return nil
	}
	start := time.Now()
	sc, rc := make([]int, h.ranks), make([]int, h.ranks)
	for q := range h.ranks {
		sc[q], rc[q] = sendRows[q]*w, recvRows[q]*w
	}
	var sb, rb comm.Buffer
	switch s := send.(type) {
	case []float32:
		sb, rb = comm.Host(s), comm.Host(recv.([]float32))
	case []float64:
		sb, rb = comm.Host(s), comm.Host(recv.([]float64))
	}
	err := comm.AllToAllV(ctx, h.c, sb, rb, sc, rc)
	phase.PayloadExchange += time.Since(start)
	if err != nil {
		return fmt.Errorf("payload all-to-all-v over axis %q: %w", h.axis, err)
	}
	return nil
}

// toExperts moves packed send rows of width w to the experts' ranks and
// groups them by local expert, into a rowsBlock (packed itself on one
// rank): the dispatch's result, or with grad set the rows' gradient.
func toExperts[T kernels.Float](ctx context.Context, h *Handle, packed []T, w int, grad bool, phase *Timings) ([]T, error) {
	if h.ranks == 1 {
		return packed, nil // one source rank: already expert-major
	}
	if h.split {
		out := rowsBlock[T](h, sum(h.recv)*w, grad)
		err := h.splitExchange(ctx, packed, out, w, true, phase)
		return out, err
	}
	recvd := wsBuf[T](h.ws, 1, sum(h.recv)*w)
	if err := h.exchangeRows(ctx, packed, recvd, h.send, h.recv, w, phase); err != nil {
		return nil, err
	}
	start := time.Now()
	out := rowsBlock[T](h, len(recvd), grad)
	if err := kernels.GroupByExpert(out, recvd, w, h.chunks, h.ranks, h.local); err != nil {
		return nil, err
	}
	phase.Permute += time.Since(start)
	return out, nil
}

// toTokens moves routed rows of width w back to the ranks holding their
// tokens, in the packed order of this rank's slots: into the tape's
// scratch when keep is set (the combine keeps them for its backward), else
// into the workspace (routed itself on one rank).
func toTokens[T kernels.Float](ctx context.Context, h *Handle, routed []T, w int, keep bool, phase *Timings) ([]T, error) {
	if h.ranks == 1 {
		return routed, nil
	}
	var packed []T
	if keep {
		packed = autograd.ScratchBlock[T](h.tape, h.plan.Rows()*w)
	} else {
		packed = wsBuf[T](h.ws, 1, h.plan.Rows()*w)
	}
	if h.split {
		err := h.splitExchange(ctx, packed, routed, w, false, phase)
		return packed, err
	}
	start := time.Now()
	byRank := wsBuf[T](h.ws, 0, len(routed))
	if err := kernels.GroupByRank(byRank, routed, w, h.chunks, h.ranks, h.local); err != nil {
		return nil, err
	}
	phase.Combine += time.Since(start)
	if err := h.exchangeRows(ctx, byRank, packed, h.recv, h.send, w, phase); err != nil {
		return nil, err
	}
	return packed, nil
}

// splitExchange runs the payload as one all-to-all-v per local expert l
// (rows of width w): toward the experts (packed rows, ordered local expert,
// destination rank, token, into the routed rows), or back (routed rows
// into packed rows).
func (h *Handle) splitExchange(ctx context.Context, packed, routed any, w int, toExperts bool, phase *Timings) error {
	p, l := h.ranks, h.local
	planRows, peerRows := make([]int, p), make([]int, p)
	at, from := 0, 0 // rows before local expert j: in packed, in routed
	for j := range l {
		for q := range p {
			planRows[q] = h.planRows(q*l + j)
			peerRows[q] = h.chunks[q*l+j]
		}
		np, nr := sum(planRows), sum(peerRows)
		ps, rs := rowRange(packed, at, np, w), rowRange(routed, from, nr, w)
		var err error
		if toExperts {
			err = h.exchangeRows(ctx, ps, rs, planRows, peerRows, w, phase)
		} else {
			err = h.exchangeRows(ctx, rs, ps, peerRows, planRows, w, phase)
		}
		if err != nil {
			return fmt.Errorf("local expert %d: %w", j, err)
		}
		at, from = at+np, from+nr
	}
	return nil
}

// rowRange returns rows [at, at+n) of width w of buf, a []float32 or
// []float64.
func rowRange(buf any, at, n, w int) any {
	switch b := buf.(type) {
	case []float32:
		return b[at*w : (at+n)*w]
	case []float64:
		return b[at*w : (at+n)*w]
	}
	return buf
}

func sum(v []int) int {
	s := 0
	for _, x := range v {
		s += x
	}
	return s
}

// rowsBlock returns n elements for rows that leave dispatch or combine:
// an op's result (recycled with the tape's results) or, with grad set, a
// gradient (the tape's scratch). Every kernel that fills them writes every
// element.
func rowsBlock[T kernels.Float](h *Handle, n int, grad bool) []T {
	if grad {
		return autograd.ScratchBlock[T](h.tape, n)
	}
	return autograd.ResultBlock[T](h.tape, n)
}

// dispatchForward permutes this rank's tokens and sends them to the
// experts.
func (h *Handle) dispatchForward(ctx context.Context, x *placement.DTensor) (*placement.DTensor, error) {
	if h.dev != nil {
		return h.dispatchDev(ctx, x)
	}
	if h.xs.DType() == comm.Float32 {
		return dispatchAs[float32](ctx, h, x)
	}
	return dispatchAs[float64](ctx, h, x)
}

func dispatchAs[T kernels.Float](ctx context.Context, h *Handle, x *placement.DTensor) (*placement.DTensor, error) {
	xd, err := localData[T](x, "Dispatch")
	if err != nil {
		return nil, err
	}
	st := &h.stats.Forward
	if h.fused {
		out, err := fusedDispatch(ctx, h, xd)
		if err != nil {
			return nil, err
		}
		return placement.NewLocal(h.routed, out)
	}
	start := time.Now()
	var packed []T
	if h.ranks == 1 {
		packed = rowsBlock[T](h, h.plan.Rows()*h.d, false) // the result itself
	} else {
		packed = wsBuf[T](h.ws, 0, h.plan.Rows()*h.d)
	}
	if err := kernels.Permute(packed, xd, h.d, &h.plan); err != nil {
		return nil, err
	}
	st.Permute += time.Since(start)
	out, err := toExperts(ctx, h, packed, h.d, false, st)
	if err != nil {
		return nil, err
	}
	return placement.NewLocal(h.routed, out)
}

// dispatchBackward sums the gradient rows of every token's copies: the
// unweighted combine.
func (h *Handle) dispatchBackward(ctx context.Context, g *placement.DTensor) (*placement.DTensor, error) {
	places, err := h.gradPlaces(g, h.routed, "the dispatched rows")
	if err != nil {
		return nil, err
	}
	// The input's gradient: the token layout with g's placements on the
	// other axes.
	for a, p := range h.xs.Placements() {
		if p.IsShard() {
			places[a] = p
		}
	}
	spec, err := gradSpec(h.xs, h.d, places)
	if err != nil {
		return nil, err
	}
	if h.dev != nil {
		return h.unpermuteDev(ctx, g, nil, h.d, spec, true, &h.stats.Backward, &h.stats.Backward.Permute, nil)
	}
	if h.xs.DType() == comm.Float32 {
		return unpermuteAs[float32](ctx, h, g, nil, h.d, spec, true, &h.stats.Backward, &h.stats.Backward.Permute)
	}
	return unpermuteAs[float64](ctx, h, g, nil, h.d, spec, true, &h.stats.Backward, &h.stats.Backward.Permute)
}

// unpermuteAs brings routed rows y (width w) back and sums each token's
// rows weighted by gates (nil: unweighted), laid out by spec: the
// combine's result, or with grad set the dispatch's input gradient. It
// returns the packed rows it received through keep, when not nil.
func unpermuteAs[T kernels.Float](ctx context.Context, h *Handle, y *placement.DTensor, gates []T, w int, spec *placement.Spec, grad bool, phase *Timings, local *time.Duration, keep ...*[]T) (*placement.DTensor, error) {
	yd, err := localData[T](y, "Combine")
	if err != nil {
		return nil, err
	}
	if err := h.wait(ctx, phase); err != nil {
		return nil, err
	}
	if h.fused {
		// The gates' gradient reads the experts' rows in place: nothing
		// to keep.
		what := "combine"
		if grad {
			what = "dispatch backward"
		}
		out, err := fusedUnpermute(ctx, h, what, yd, gates, w, grad, phase)
		if err != nil {
			return nil, err
		}
		return placement.NewLocal(spec, out)
	}
	keeping := len(keep) > 0 && keep[0] != nil
	packed, err := toTokens(ctx, h, yd, w, keeping, phase)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	out := rowsBlock[T](h, h.n*w, grad)
	if err := kernels.Unpermute(out, packed, gates, w, &h.plan); err != nil {
		return nil, err
	}
	*local += time.Since(start)
	if keeping {
		*keep[0] = packed
	}
	return placement.NewLocal(spec, out)
}

// combineState is one Combine call: its inputs and what its forward keeps
// for backward.
type combineState struct {
	h       *Handle
	y       *autograd.Value
	gates   *autograd.Value
	width   int
	outSpec *placement.Spec
	packed  any // []T or a device.Buffer: the rows the forward received, in packed order
}

func (cs *combineState) forward(ctx context.Context) (*placement.DTensor, error) {
	if cs.h.dev != nil {
		return combineDev(ctx, cs)
	}
	if cs.y.Spec().DType() == comm.Float32 {
		return combineAs[float32](ctx, cs)
	}
	return combineAs[float64](ctx, cs)
}

func combineAs[T kernels.Float](ctx context.Context, cs *combineState) (*placement.DTensor, error) {
	h := cs.h
	var gates []T
	if cs.gates != nil {
		var err error
		if gates, err = localData[T](cs.gates.Data(), "Combine gates"); err != nil {
			return nil, err
		}
	}
	// The received rows are kept for the gates' gradient.
	var packed []T
	var keep *[]T
	if cs.gates != nil && cs.gates.RequiresGrad() {
		keep = &packed
	}
	out, err := unpermuteAs(ctx, h, cs.y.Data(), gates, cs.width, cs.outSpec, false, &h.stats.Forward, &h.stats.Forward.Combine, keep)
	if err != nil {
		return nil, err
	}
	if keep != nil {
		cs.packed = packed
	}
	return out, nil
}

func (cs *combineState) backward(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
	if cs.h.dev != nil {
		return combineBackwardDev(ctx, cs, g)
	}
	if cs.y.Spec().DType() == comm.Float32 {
		return combineBackwardAs[float32](ctx, cs, g)
	}
	return combineBackwardAs[float64](ctx, cs, g)
}

// combineBackwardAs dispatches the gate-scaled gradient rows to the
// experts and computes the gates' gradient from the saved rows.
func combineBackwardAs[T kernels.Float](ctx context.Context, cs *combineState, g *placement.DTensor) ([]*placement.DTensor, error) {
	h := cs.h
	places, err := h.gradPlaces(g, cs.outSpec, "the combined tokens")
	if err != nil {
		return nil, err
	}
	gd, err := localData[T](g, "Combine backward")
	if err != nil {
		return nil, err
	}
	if err := h.wait(ctx, &h.stats.Backward); err != nil {
		return nil, err
	}
	var gates, dgates, packed []T
	if cs.gates != nil {
		if gates, err = localData[T](cs.gates.Data(), "Combine gates"); err != nil {
			return nil, err
		}
		if cs.gates.RequiresGrad() {
			if h.fused {
				// The experts' ranks write into it (fused.go). After a
				// failed pass a late peer may still be writing, so it
				// must be memory the tape never hands out again: the
				// garbage collector's (n·K values, little to allocate).
				dgates = make([]T, h.n*h.k)
			} else {
				dgates = autograd.ScratchBlock[T](h.tape, h.n*h.k)
			}
			packed, _ = cs.packed.([]T)
		}
	}
	st := &h.stats.Backward
	if h.fused {
		return fusedCombineBackwardAs(ctx, cs, places, gd, gates, dgates)
	}
	start := time.Now()
	// The rows' gradient, when y needs one; every rank of the group then
	// sends it, even with no rows (a nil dpacked asks the kernel for none).
	rowsGrad := cs.y.RequiresGrad()
	var dpacked []T
	switch {
	case !rowsGrad:
	case h.ranks == 1:
		dpacked = autograd.ScratchBlock[T](h.tape, h.plan.Rows()*cs.width) // the gradient itself
	default:
		dpacked = wsBuf[T](h.ws, 0, h.plan.Rows()*cs.width)
	}
	if rowsGrad || dgates != nil {
		if err := kernels.UnpermuteBackward(dpacked, dgates, gd, packed, gates, cs.width, &h.plan); err != nil {
			return nil, err
		}
	}
	st.Combine += time.Since(start)
	var dy []T
	if rowsGrad {
		var err error
		if dy, err = toExperts(ctx, h, dpacked, cs.width, true, st); err != nil {
			return nil, err
		}
	}
	return combineGrads(cs, places, dy, dgates)
}

// fusedCombineBackwardAs is combineBackwardAs on the fused path.
func fusedCombineBackwardAs[T kernels.Float](ctx context.Context, cs *combineState, places []placement.Placement, gd, gates, dgates []T) ([]*placement.DTensor, error) {
	h := cs.h
	var dy []T
	if cs.y.RequiresGrad() {
		dy = autograd.ScratchBlock[T](h.tape, sum(h.recv)*cs.width)
	}
	// The rows the combine summed: this rank computes the gate gradient
	// of every slot its experts hold, whichever rank wants it.
	y, err := localData[T](cs.y.Data(), "Combine backward")
	if err != nil {
		return nil, err
	}
	if err := fusedCombineBackward(ctx, h, gd, gates, y, dy, dgates, cs.width); err != nil {
		return nil, err
	}
	return combineGrads(cs, places, dy, dgates)
}

// combineGrads lays out the combine's gradients: dy for the rows (nil:
// none), dgates for the gates (nil: none).
func combineGrads[T kernels.Float](cs *combineState, places []placement.Placement, dy, dgates []T) ([]*placement.DTensor, error) {
	var wrapGates func(*placement.Spec) (*placement.DTensor, error)
	if dgates != nil {
		wrapGates = func(s *placement.Spec) (*placement.DTensor, error) { return placement.NewLocal(s, dgates) }
	}
	return layoutCombineGrads(cs, places, func(s *placement.Spec) (*placement.DTensor, error) { return placement.NewLocal(s, dy) }, wrapGates)
}

// layoutCombineGrads lays out the combine's gradients on the host or a
// device: wrapRows wraps the rows' gradient block in its spec, wrapGates
// the gates' (nil: the gates got none).
func layoutCombineGrads(cs *combineState, places []placement.Placement, wrapRows, wrapGates func(*placement.Spec) (*placement.DTensor, error)) ([]*placement.DTensor, error) {
	h := cs.h
	grads := make([]*placement.DTensor, 1, 2)
	if cs.y.RequiresGrad() {
		rowsPl := h.routed.Placements()
		for a, p := range places {
			if !rowsPl[a].IsRouted() {
				rowsPl[a] = p
			}
		}
		spec, err := gradSpec(h.routed, cs.width, rowsPl)
		if err != nil {
			return nil, err
		}
		if grads[0], err = wrapRows(spec); err != nil {
			return nil, err
		}
	}
	if cs.gates != nil {
		grads = append(grads, nil)
		if wrapGates != nil {
			spec, err := gradSpec(h.xs, h.k, places)
			if err != nil {
				return nil, err
			}
			if grads[1], err = wrapGates(spec); err != nil {
				return nil, err
			}
		}
	}
	return grads, nil
}
