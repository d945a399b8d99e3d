package moe

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// ErrMismatch marks ranks that disagree about a dispatch they must agree on
// (experts, slots per token, row width, capacity, dtype), or a rank whose
// own arguments were rejected, found by the count exchange before any token
// row moves. Every rank of the exchange returns it. Test for it with
// errors.Is.
var ErrMismatch = loom.NewSentinel("moe: ranks disagree", loom.ErrMismatch)

// DispatchConfig configures Dispatch.
type DispatchConfig struct {
	// Axis names the expert-parallel mesh axis ("ep"). The tokens must be
	// sharded over it (Shard(0)), and its ranks own the experts in
	// contiguous blocks: with E experts over P ranks (P must divide E),
	// rank r owns experts [r·E/P, (r+1)·E/P).
	Axis string
	// Capacity, when positive, selects the static-capacity layout: every
	// rank sends exactly Capacity rows for every expert, the expert's
	// routed slots in token order up to Capacity and zero rows after them;
	// slots beyond the capacity are dropped (their gate takes no part in
	// the combine and gets gradient 0) and counted in Stats. Row counts
	// then depend only on E, P and Capacity, so no counts are exchanged;
	// every rank must use the same capacity (with the router's capacity,
	// which is per rank, that means equal token shards), or the payload
	// all-to-all-v fails with an error naming the disagreeing ranks.
	//
	// 0 lets the routing decide: the static layout with Routing.Capacity
	// when Routing.Pad is set (RouterConfig.PadToCapacity), and otherwise
	// the exact ragged layout, where rows are exactly the routed slots and
	// the ranks exchange their per-expert counts first.
	Capacity int
	// Diagnostics makes a static-capacity dispatch exchange its counts
	// anyway (the one all-gather the ragged layout always does), so that
	// Stats hold the send matrix and tokens per expert of the whole
	// expert-parallel group and every rank checks the others' arguments
	// before the payload moves; ragged dispatches always have them. It
	// also adds a barrier over Axis before the combine and both backward
	// passes, timed as Timings.Wait, which separates the cost of
	// imbalance from the exchanges' own (a few microseconds a barrier on
	// comm/local). Every rank must set it alike. The count exchange checks
	// that they do; in the static layout a rank without Diagnostics skips
	// that exchange, so there a disagreement is a mismatch of collectives,
	// which fails as such (at once on comm/local, by the communicator's
	// timeout on MPI and NCCL).
	Diagnostics bool
	// Workspace, when not nil, supplies the buffers the rows pass through
	// inside this dispatch, its combine and their backward passes, reused
	// from call to call (see Workspace); nil allocates them every call.
	// Layer uses one of its own when this is nil.
	Workspace *Workspace
	// Collectives moves the payload with all-to-all-v over Axis even where
	// the ranks share one address space (comm.SharedMemory), where
	// dispatch and combine otherwise pull rows straight from their peers'
	// memory (the fused path, see Dispatch). It runs in process the path
	// that MPI and NCCL communicators take: to test it on a laptop, or to
	// compare the two.
	Collectives bool
}

// Handle is the routing handle of one dispatch: the layout that Dispatch
// computed and that Combine, the experts and both backward passes reuse,
// so that dispatch and combine are each other's backward (DeepEP's
// pattern). It holds the permutation of this rank's token slots into
// expert-major order (kernels.Routing), the rows this rank sends to and
// receives from every expert-parallel rank, the rows per (source rank,
// local expert) and per local expert, and the Routed spec of the
// dispatched tensor. A Handle belongs to one rank and one step; it is not
// safe for concurrent use. Its diagnostics (Stats) are updated by every
// op that uses it, forward and backward.
type Handle struct {
	axis      string
	xs        *placement.Spec // the token layout
	routed    *placement.Spec // the dispatched rows' layout
	tokenAxes []string
	n, k, e   int // local tokens, slots per token, experts
	d         int // row width of the dispatched tokens
	ranks     int // P, the expert-parallel axis size
	rank      int // this rank's index on it
	local     int // L = E/P experts per rank
	capacity  int // static rows per (source, expert); 0: ragged
	static    bool
	c         comm.Communicator
	ws        *Workspace     // nil: allocate
	tape      *autograd.Tape // of the dispatched tokens: results and gradients come from it
	// split: the payload moves in one all-to-all-v per local expert (see
	// dispatch.go), and the plan's expert ids are relabelled local-expert
	// major (label). layout decides it, once the counts are known.
	split bool
	// diag: DispatchConfig.Diagnostics, so every later pass starts with a
	// barrier timed as Timings.Wait (wait).
	diag bool
	// fused: the payload moves by comm.SharedMemory (fused.go), not by
	// all-to-all-v; decided from the communicator, so the same on every
	// rank of the axis.
	fused bool
	// dev: the tokens' device, nil on the host (device.go).
	dev *onDevice

	plan       kernels.Routing
	send, recv []int // rows to and from every expert-parallel rank
	chunks     []int // [P·L]: rows from rank q for local expert l at q·L+l
	expertRows []int // [L]: rows of each local expert in the routed layout
	at         []int // [L·P]: first routed row of local expert l's rows from rank q at l·P+q

	stats Stats
}

// Axis returns the expert-parallel mesh axis ("" for a nil handle).
func (h *Handle) Axis() string {
	if h == nil {
		return ""
	}
	return h.axis
}

// Spec returns the layout of the dispatched rows: global shape [rows, D],
// Routed on the token-sharding axes (with every routed group's row count,
// placement.WithRoutedRows) and Replicate elsewhere. It is nil for a nil
// handle.
func (h *Handle) Spec() *placement.Spec {
	if h == nil {
		return nil
	}
	return h.routed
}

// TokenSpec returns the layout of the tokens that were dispatched, which is
// the layout Combine returns (nil for a nil handle).
func (h *Handle) TokenSpec() *placement.Spec {
	if h == nil {
		return nil
	}
	return h.xs
}

// Capacity returns the static capacity (rows per source rank and expert),
// or 0 for the exact ragged layout (and for a nil handle).
func (h *Handle) Capacity() int {
	if h == nil {
		return 0
	}
	return h.capacity
}

// LocalExperts returns the global id of this rank's first expert and the
// number of experts it owns (0, 0 for a nil handle).
func (h *Handle) LocalExperts() (first, count int) {
	if h == nil {
		return 0, 0
	}
	return h.rank * h.local, h.local
}

// ExpertRows returns the number of dispatched rows of each local expert on
// this rank, in the order they are stored: local expert l's rows are the
// l-th contiguous run, holding its rows from expert-parallel rank 0, then
// rank 1, and so on, each in token order (padding included in the static
// layout). It is nil for a nil handle.
func (h *Handle) ExpertRows() []int {
	if h == nil {
		return nil
	}
	return slices.Clone(h.expertRows)
}

// Dispatch moves token copies to the ranks that own their experts. x holds
// this rank's tokens [n, D] (global [N, D]), laid out Shard(0) on the
// token-sharding mesh axes in mesh-axis order (they must include
// cfg.Axis) and Replicate on the others, exactly as Router.Route takes
// them; r is the routing of those tokens. Every routed slot (t, j) with
// expert e = r.Experts[t·K+j] ≥ 0 becomes one row holding x_t; the rows
// are permuted expert-major (then by token and slot) with the permute
// kernels, sent with all-to-all-v over cfg.Axis, and regrouped on the
// receiving rank by local expert, then source rank, then token order.
// Small payloads go in one all-to-all-v followed by a regrouping pass;
// from 64 KiB per rank and call on average (over the expert-parallel
// group), the rows are packed by local expert instead and sent in one
// all-to-all-v per local expert, straight into place (the same for every
// rank of the group; combine and both backward passes follow suit).
// Where the ranks share memory (comm.SharedMemory, comm/local) and
// cfg.Collectives is not set, no all-to-all-v runs: each rank gathers its
// experts' rows straight from the token ranks' inputs, after checking
// every rank's counts against every other's.
//
// The result is laid out by Handle.Spec: Routed on the token-sharding axes
// (its rows sit on the rank owning their expert, in data-dependent
// numbers; a rank with no rows is an ordinary case) and Replicate
// elsewhere. The Handle carries the layout to the experts (Experts.Forward)
// and back (Combine). The backward of Dispatch is the combine of the
// gradient rows without weights: each token's gradient is the sum of its
// copies' gradients, laid out like x.
//
// In the ragged layout the ranks first exchange their per-expert counts:
// one all-gather of E+11 int64 per rank over the token-sharding axes
// (mesh.Mesh.Group), which also checks that every rank was called with
// the same experts, slots, width, capacity, dtype and Diagnostics, and that no rank
// rejected its own routing, before any token row moves: a disagreement is
// an ErrMismatch error on every rank. The static-capacity layout
// (DispatchConfig.Capacity) skips the exchange unless Diagnostics is set.
// Dispatch is collective over the mesh: every rank calls it in the same
// order with the same configuration. Errors wrap ErrInvalid (arguments),
// ErrMismatch, or the autograd, placement and comm errors of the step that
// failed, with the step named.
func Dispatch(ctx context.Context, x *autograd.Value, r *Routing, cfg DispatchConfig) (*autograd.Value, *Handle, error) {
	const op = "moe: Dispatch"
	h, err := newHandle(ctx, op, x, r, cfg)
	if err != nil {
		return nil, nil, err
	}
	out, err := autograd.Custom("moe.Dispatch", []*autograd.Value{x},
		func() (*placement.DTensor, error) { return h.dispatchForward(ctx, x.Data()) },
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			dx, err := h.dispatchBackward(ctx, g)
			return []*placement.DTensor{dx}, err
		})
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", op, err)
	}
	return out, h, nil
}

// Combine is the reverse of Dispatch: it sends the rows of y, laid out like
// the dispatched rows (Handle.Spec's layout and rows; the width may differ
// from D), back to the ranks holding their tokens with all-to-all-v over
// the expert-parallel axis (as many as the dispatch used), and sums each token's rows weighted by its
// gates: y_t = Σ_j g_tj · y_(t,j) over the token's routed slots that were
// not dropped (a token with none gets zeros). gates [N, K] is laid out like
// the token rows (Routing.Gates); nil sums without weights, which is
// Dispatch's backward. The result [N, width] is laid out like the
// dispatched tokens (Handle.TokenSpec).
//
// Its backward is a dispatch through the same handle: the gradient row of
// slot (t, j) is g_tj·G_t (zero rows for padding), sent to the expert's
// rank; the gates' gradient is dg_tj = G_t·o_tj, computed on the token's
// rank from the rows o the forward received (0 for dropped slots), laid
// out like the gates. No counts are exchanged: the handle knows them.
//
// Combine is collective over the expert-parallel axis and must be called
// on every rank with the handle of the same Dispatch call: handles from
// different calls disagree on the row counts, which the all-to-all-v's
// pairwise check reports on every rank (rank, op and sequence number)
// instead of hanging. Errors wrap ErrInvalid or the errors of the step
// that failed.
func Combine(ctx context.Context, y *autograd.Value, h *Handle, gates *autograd.Value) (*autograd.Value, error) {
	const op = "moe: Combine"
	if h == nil {
		return nil, fmt.Errorf("%s: %w: nil handle", op, ErrInvalid)
	}
	width, err := h.checkRouted(op, y, "y")
	if err != nil {
		return nil, err
	}
	if gates != nil {
		if err := h.checkGates(op, gates, y); err != nil {
			return nil, err
		}
	}
	outSpec, err := placement.NewSpec(h.xs.Mesh(), []int{h.xs.Shape()[0], width}, y.Spec().DType(), h.xs.Placements())
	if err != nil {
		return nil, fmt.Errorf("%s: result layout: %w", op, err)
	}
	cs := &combineState{h: h, y: y, gates: gates, width: width, outSpec: outSpec}
	inputs := []*autograd.Value{y}
	if gates != nil {
		inputs = append(inputs, gates)
	}
	out, err := autograd.Custom("moe.Combine", inputs,
		func() (*placement.DTensor, error) { return cs.forward(ctx) },
		cs.backward)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return out, nil
}

// newHandle validates a dispatch, plans the permutation and exchanges the
// counts.
func newHandle(ctx context.Context, op string, x *autograd.Value, r *Routing, cfg DispatchConfig) (*Handle, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%s: %w: "+format, append([]any{op, ErrInvalid}, args...)...)
	}
	if x == nil || x.Spec() == nil {
		return nil, bad("nil tokens")
	}
	if r == nil {
		return nil, bad("nil routing")
	}
	xs := x.Spec()
	shape := xs.Shape()
	if len(shape) != 2 {
		return nil, bad("tokens of shape %v; want [N, D] (reshape [B, T, D] tokens to [B·T, D] first)", shape)
	}
	if dt := xs.DType(); dt != comm.Float32 && dt != comm.Float64 {
		return nil, bad("tokens are %v; want float32 or float64", dt)
	}
	m := xs.Mesh()
	names := m.Names()
	var tokenAxes []string
	for a, p := range xs.Placements() {
		switch {
		case p == placement.Shard(0):
			tokenAxes = append(tokenAxes, names[a])
		case !p.IsReplicate():
			return nil, bad("tokens are %v on mesh axis %q; want S(0) (sharded tokens) or R: redistribute them first", p, names[a])
		}
	}
	if !slices.Equal(xs.Order(0), tokenAxes) {
		return nil, bad("the tokens are sharded over mesh axes %v in that order; dispatch needs mesh-axis order %v: redistribute them first", xs.Order(0), tokenAxes)
	}
	epIdx := slices.Index(tokenAxes, cfg.Axis)
	if epIdx < 0 {
		if !slices.Contains(names, cfg.Axis) {
			return nil, bad("expert-parallel axis %q is not an axis of the mesh %v", cfg.Axis, m)
		}
		return nil, bad("the tokens are not sharded over the expert-parallel axis %q (they are %v): each rank dispatches its own tokens", cfg.Axis, xs.Placements())
	}
	ranks, err := m.AxisSize(cfg.Axis)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	if r.K < 1 || r.NumExperts < 1 {
		return nil, bad("routing with %d experts and K = %d; want at least 1 of each", r.NumExperts, r.K)
	}
	if r.NumExperts%ranks != 0 {
		return nil, bad("%d experts do not divide over the %d ranks of axis %q", r.NumExperts, ranks, cfg.Axis)
	}
	if err := numcheck.NonNegativeCount(ErrInvalid, "Capacity", cfg.Capacity); err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	capacity, static := cfg.Capacity, cfg.Capacity > 0
	if !static && r.Pad {
		capacity, static = r.Capacity, true
	}
	rank, err := m.Local(cfg.Axis)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	h := &Handle{
		axis: cfg.Axis, xs: xs, tokenAxes: tokenAxes,
		n: xs.LocalShape()[0], k: r.K, e: r.NumExperts, d: shape[1],
		ranks: ranks, rank: rank, local: r.NumExperts / ranks, capacity: capacity, static: static,
		ws: cfg.Workspace, tape: x.Tape(), diag: cfg.Diagnostics,
	}
	h.stats.init(h)
	if h.dev, err = deviceOf(op, x.Data()); err != nil {
		return nil, err
	}
	// Communicators: created on first use by a collective Split, so every
	// rank asks for the same ones in the same order.
	if h.c, err = m.Comm(ctx, cfg.Axis); err != nil {
		return nil, fmt.Errorf("%s: communicator of axis %q: %w", op, cfg.Axis, err)
	}
	h.fused = h.dev == nil && h.useFused(cfg) // the fused path is host memory's
	exchange := !static || cfg.Diagnostics
	var group comm.Communicator
	if exchange {
		if group, err = m.Group(ctx, tokenAxes...); err != nil {
			return nil, fmt.Errorf("%s: communicator of mesh axes %v: %w", op, tokenAxes, err)
		}
	}

	// This rank's own checks; with an exchange the verdict travels with
	// the counts so that every rank fails together.
	var localErr error
	switch {
	case static && capacity <= 0:
		localErr = bad("static capacity %d: the router's capacity is per rank, and a rank without tokens has none; use equal token shards, DispatchConfig.Capacity or the ragged layout", capacity)
	case len(r.Experts) != h.n*r.K:
		localErr = bad("routing of %d slots for %d local tokens × K = %d", len(r.Experts), h.n, r.K)
	default:
		h.plan.Workers = h.tape.Workers()
		if err := kernels.PlanRouting(&h.plan, r.Experts, r.K, r.NumExperts, capacity); err != nil {
			localErr = bad("%v", err)
		}
	}
	start := time.Now()
	var gathered [][]int64
	if exchange {
		gathered, err = h.exchange(ctx, op, group, localErr, static, xs.DType())
		h.stats.Forward.CountExchange += time.Since(start)
		if err != nil {
			return nil, err
		}
	} else if localErr != nil {
		return nil, localErr
	}
	if err := h.layout(op, r.Experts, gathered, epIdx, m.Shape(), names); err != nil {
		return nil, err
	}
	return h, nil
}

// Layout of the count exchange message: a header the ranks must agree on,
// then this rank's kept rows per expert and its slot statistics.
const (
	hdrStatus = iota
	hdrExperts
	hdrK
	hdrWidth
	hdrCapacity
	hdrStatic
	hdrDType
	hdrDiag
	hdrLen
)

// exchange all-gathers every rank's header and per-expert counts over the
// token-sharding axes and checks the headers and verdicts.
func (h *Handle) exchange(ctx context.Context, op string, group comm.Communicator, localErr error, static bool, dt comm.DType) ([][]int64, error) {
	e := h.e
	msg := make([]int64, hdrLen+e+3)
	msg[hdrExperts], msg[hdrK], msg[hdrWidth], msg[hdrCapacity], msg[hdrDType] = int64(e), int64(h.k), int64(h.d), int64(h.capacity), int64(dt)
	if static {
		msg[hdrStatic] = 1
	}
	if h.diag {
		msg[hdrDiag] = 1
	}
	if localErr != nil {
		msg[hdrStatus] = 1
	} else {
		for x, c := range h.plan.Counts {
			msg[hdrLen+x] = int64(c)
		}
		msg[hdrLen+e], msg[hdrLen+e+1], msg[hdrLen+e+2] = int64(h.plan.Dropped), int64(h.plan.Padded), int64(h.plan.Unrouted)
	}
	all := make([]int64, len(msg)*group.Size())
	if err := comm.AllGather(ctx, group, comm.Host(msg), comm.Host(all)); err != nil {
		if localErr != nil {
			return nil, localErr
		}
		return nil, fmt.Errorf("%s: count exchange over mesh axes %v: %w", op, h.tokenAxes, err)
	}
	rows := make([][]int64, group.Size())
	var rejected, differ []string
	for g := range rows {
		rows[g] = all[g*len(msg) : (g+1)*len(msg)]
		if rows[g][hdrStatus] != 0 {
			rejected = append(rejected, fmt.Sprint(g))
		}
		if !slices.Equal(rows[g][1:hdrLen], msg[1:hdrLen]) {
			differ = append(differ, fmt.Sprintf("rank %d has E=%d K=%d D=%d capacity=%d static=%d dtype=%v diagnostics=%d", g,
				rows[g][hdrExperts], rows[g][hdrK], rows[g][hdrWidth], rows[g][hdrCapacity], rows[g][hdrStatic], comm.DType(rows[g][hdrDType]), rows[g][hdrDiag]))
		}
	}
	if localErr != nil {
		return nil, localErr
	}
	if rejected != nil {
		return nil, fmt.Errorf("%s: %w: rank(s) %s of mesh axes %v rejected their routing (see their errors); no token row moved", op, ErrMismatch, strings.Join(rejected, ", "), h.tokenAxes)
	}
	if differ != nil {
		return nil, fmt.Errorf("%s: %w: this rank has E=%d K=%d D=%d capacity=%d static=%d dtype=%v diagnostics=%d, but %s; no token row moved", op, ErrMismatch,
			e, h.k, h.d, h.capacity, msg[hdrStatic], dt, msg[hdrDiag], strings.Join(differ, "; "))
	}
	return rows, nil
}

// splitMinBytes is the payload per rank and call, averaged over the
// expert-parallel group, from which the payload moves in one all-to-all-v
// per local expert rather than one all-to-all-v and a regrouping pass on
// each side. Splitting saves a read and a write of the payload per side
// and costs L−1 more collective calls: on comm/local, a few microseconds
// each against a copy bandwidth of 5 to 20 GB/s, so it pays from some
// tens of KiB per call (measured with BenchmarkDispatchCombine on the
// two-core development machine: at 4 MiB per rank the split path is 1.3
// to 2 times faster; below 64 KiB the extra calls cost about what the
// regrouping does).
const splitMinBytes = 64 << 10

// label is the id under which the plan knows global expert x: x itself,
// or with split exchanges x = q·L + l (rank q's local expert l) becomes
// l·P + q, so that the packed rows are ordered by local expert, then
// destination rank, then token, and the rows of each local expert are
// one all-to-all-v's send buffer.
func (h *Handle) label(x int) int {
	if !h.split {
		return x
	}
	return (x%h.local)*h.ranks + x/h.local
}

// planRows returns the packed rows (padding included) of global expert x.
func (h *Handle) planRows(x int) int {
	y := h.label(x)
	return h.plan.Offsets[y+1] - h.plan.Offsets[y]
}

// layout computes the send and receive counts, the per-expert rows, the
// diagnostics' matrix and the Routed spec, from the gathered counts (nil
// for a static layout without exchange).
func (h *Handle) layout(op string, experts []int32, gathered [][]int64, epIdx int, mshape []int, names []string) error {
	p, l := h.ranks, h.local
	// Sizes of the token axes, and the stride of the ep axis in the
	// row-major order of the token group.
	var sizes []int
	for _, ax := range h.tokenAxes {
		sizes = append(sizes, mshape[slices.Index(names, ax)])
	}
	stride := 1
	for _, s := range sizes[epIdx+1:] {
		stride *= s
	}
	groups := 1
	for _, s := range sizes {
		groups *= s
	}
	me := 0
	for i, ax := range h.tokenAxes {
		c, err := h.xs.Mesh().Local(ax)
		if err != nil {
			// tokenAxes come from this mesh's names, so this is a bug.
			return fmt.Errorf("%s: token axis %q: %w", op, ax, err)
		}
		me = me*sizes[i] + c
	}
	// Every rank's counts are at most its slots, which PlanRouting keeps
	// within int32; a count outside that came from a broken peer, and is
	// caught here, on every rank alike (they all hold the same counts),
	// before any sum of counts is formed.
	for g, msg := range gathered {
		for x, c := range msg[hdrLen : hdrLen+h.e] {
			if c < 0 || c > math.MaxInt32 {
				return fmt.Errorf("%s: %w: rank %d of mesh axes %v reported %d rows for expert %d; want [0, 2^31)", op, ErrMismatch, g, h.tokenAxes, c, x)
			}
		}
	}
	kept := func(g, x int) int { return int(gathered[g][hdrLen+x]) }
	// member returns the token-group rank with ep coordinate q in g's ep
	// group.
	member := func(g, q int) int { return g + (q-(g/stride)%p)*stride }

	h.chunks = make([]int, p*l)
	h.recv = make([]int, p)
	h.expertRows = make([]int, l)
	rows := make([]int, groups)
	for q := range p {
		for j := range l {
			c := h.capacity
			if !h.static {
				c = kept(member(me, q), h.rank*l+j)
			}
			h.chunks[q*l+j] = c
			h.recv[q] += c
			h.expertRows[j] += c
		}
	}
	h.at = make([]int, l*p)
	at := 0
	for j := range l {
		for q := range p {
			h.at[j*p+q] = at
			at += h.chunks[q*l+j]
		}
	}
	// Row totals: sums of counts, checked (chunks, recv, expertRows and at
	// above are partial sums of this rank's own total).
	overflow := false
	counts := make([]int, 0, p*l)
	for g := range rows {
		var ok bool
		if h.static {
			rows[g], ok = checked.Product([]int{p, l, h.capacity})
			overflow = overflow || !ok
			continue
		}
		rg := (g / stride) % p
		counts = counts[:0]
		for q := range p {
			for j := range l {
				counts = append(counts, kept(member(g, q), rg*l+j))
			}
		}
		rows[g], ok = checked.Sum(counts)
		overflow = overflow || !ok
	}
	total, ok := checked.Sum(rows)
	if overflow || !ok {
		return fmt.Errorf("%s: %w: the dispatched rows of the routed groups overflow int (capacity %d, %d experts, %d rank groups)", op, ErrInvalid, h.capacity, h.e, groups)
	}
	places := make([]placement.Placement, len(names))
	for a, name := range names {
		places[a] = placement.Replicate()
		if slices.Contains(h.tokenAxes, name) {
			places[a] = placement.Routed()
		}
	}
	// The spec checks that total·D elements fit in an int of bytes, which
	// bounds the byte count of the split decision below.
	var err error
	h.routed, err = placement.NewSpec(h.xs.Mesh(), []int{total, h.d}, h.xs.DType(), places, placement.WithRoutedRows(rows))
	if err != nil {
		return fmt.Errorf("%s: layout of the dispatched rows: %w", op, err)
	}
	// Every rank of the expert-parallel group sees the same rows, so they
	// agree on the split.
	groupRows := 0
	for q := range p {
		groupRows += rows[member(me, q)]
	}
	if least := h.ws.splitThreshold(); !h.fused && p > 1 && l > 1 && least >= 0 && groupRows*h.d*h.xs.DType().Size() >= least*l*p {
		h.split = true
		relabelled := make([]int32, len(experts))
		for s, x := range experts {
			relabelled[s] = x
			if x >= 0 && int(x) < h.e {
				relabelled[s] = int32(h.label(int(x)))
			}
		}
		if err := kernels.PlanRouting(&h.plan, relabelled, h.k, h.e, h.capacity); err != nil {
			return fmt.Errorf("%s: %w", op, err)
		}
	}
	h.send = make([]int, p)
	for q := range p {
		for j := range l {
			h.send[q] += h.planRows(q*l + j)
		}
	}
	h.stats.fill(h, gathered, func(q int) int { return member(me, q) })
	return nil
}

// checkRouted checks that v is laid out like the dispatched rows (any row
// width) and returns its width.
func (h *Handle) checkRouted(op string, v *autograd.Value, what string) (int, error) {
	if v == nil || v.Spec() == nil {
		return 0, fmt.Errorf("%s: %w: nil %s", op, ErrInvalid, what)
	}
	s := v.Spec()
	shape := s.Shape()
	if len(shape) != 2 || shape[0] != h.routed.Shape()[0] || !slices.Equal(s.Placements(), h.routed.Placements()) ||
		!slices.Equal(s.RoutedRows(), h.routed.RoutedRows()) || s.Mesh().World() != h.xs.Mesh().World() {
		return 0, fmt.Errorf("%s: %w: %s is laid out as %v; this handle's rows are %v (any width): use the rows of the same dispatch", op, ErrInvalid, what, s, h.routed)
	}
	if dt := s.DType(); dt != comm.Float32 && dt != comm.Float64 {
		return 0, fmt.Errorf("%s: %w: %s is %v; want float32 or float64", op, ErrInvalid, what, dt)
	}
	return shape[1], nil
}

// checkGates checks the gate weights against the handle and y.
func (h *Handle) checkGates(op string, gates, y *autograd.Value) error {
	s := gates.Spec()
	if s == nil {
		return fmt.Errorf("%s: %w: nil gates", op, ErrInvalid)
	}
	want := []int{h.xs.Shape()[0], h.k}
	if !slices.Equal(s.Shape(), want) || !slices.Equal(s.Placements(), h.xs.Placements()) || !slices.Equal(s.Order(0), h.xs.Order(0)) {
		return fmt.Errorf("%s: %w: gates are %v; want shape %v laid out like the tokens %v", op, ErrInvalid, s, want, h.xs)
	}
	if s.DType() != y.Spec().DType() {
		return fmt.Errorf("%s: %w: gates are %v, the rows %v; they must match", op, ErrInvalid, s.DType(), y.Spec().DType())
	}
	return nil
}

// gradPlaces checks a gradient g that arrives for a value laid out by want
// (the same shape, the same placements on the token-sharding axes) and
// returns want's placements with every other axis taken from g, which may
// be Replicate or Partial(sum) there: everything below is linear in g.
func (h *Handle) gradPlaces(g *placement.DTensor, want *placement.Spec, what string) ([]placement.Placement, error) {
	gs := g.Spec()
	ok := slices.Equal(gs.Shape(), want.Shape()) && gs.DType() == want.DType() && slices.Equal(gs.RoutedRows(), want.RoutedRows())
	places := want.Placements()
	names := want.Mesh().Names()
	gp := gs.Placements()
	for a := range places {
		if !ok || len(gp) != len(places) {
			ok = false
			break
		}
		if slices.Contains(h.tokenAxes, names[a]) {
			ok = gp[a] == places[a]
			continue
		}
		switch {
		case gp[a].IsReplicate():
		case gp[a] == placement.Partial(comm.Sum):
			places[a] = gp[a]
		default:
			ok = false
		}
	}
	if ok && want.RoutedRows() == nil && !slices.Equal(gs.Order(0), want.Order(0)) {
		ok = false
	}
	if !ok {
		return nil, fmt.Errorf("%w: the gradient of %s arrives as %v; want %v, with Replicate or Partial(sum) on the axes that do not shard the tokens", autograd.ErrGradPlacement, what, gs, want)
	}
	return places, nil
}

// gradSpec returns want's layout with placements places (the token layout
// keeps mesh-axis shard order; a Routed layout keeps its rows).
func gradSpec(want *placement.Spec, width int, places []placement.Placement) (*placement.Spec, error) {
	shape := []int{want.Shape()[0], width}
	var opts []placement.SpecOption
	if rows := want.RoutedRows(); rows != nil {
		opts = append(opts, placement.WithRoutedRows(rows))
	}
	return placement.NewSpec(want.Mesh(), shape, want.DType(), places, opts...)
}
