package cp

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/placement"
)

// Method is how Attention computes exact attention over a sequence
// sharded over the cp axis.
type Method uint8

// The methods. Auto lets Attention choose (see Attention).
const (
	// Auto: chosen by the cost model per call (see Attention).
	Auto Method = iota
	// Ring: K/V blocks travel around the cp ranks by send/receive, the
	// next block's transfer overlapping this block's attention; partial
	// results are merged by log-sum-exp. Memory per rank stays 1/cp.
	Ring
	// AllGather: K and V are gathered whole once; each rank attends its
	// Q block to them. Fewer, larger transfers; cp× the K/V memory.
	AllGather
	// Ulysses: all-to-all from sequence-sharded to head-sharded, attention
	// over the whole sequence for heads/cp heads, and all-to-all back.
	// The local heads must divide by cp.
	Ulysses
	// Hybrid: Ulysses over an inner axis (WithUlyssesAxis), ring over the
	// cp axis across those groups: a 2-D cp mesh.
	Hybrid
)

var methodNames = []string{Auto: "auto", Ring: "ring", AllGather: "allgather", Ulysses: "ulysses", Hybrid: "hybrid"}

// String returns the method's name as ParseMethod reads it ("ring").
func (m Method) String() string {
	if int(m) < len(methodNames) {
		return methodNames[m]
	}
	return fmt.Sprintf("method(%d)", uint8(m))
}

// ParseMethod reads a method name ("auto", "ring", "allgather",
// "ulysses", "hybrid"), in any case. Errors wrap ErrInvalid.
func ParseMethod(s string) (Method, error) {
	for m, n := range methodNames {
		if strings.EqualFold(strings.TrimSpace(s), n) {
			return Method(m), nil
		}
	}
	return 0, invalidf("ParseMethod", "unknown method %q (want one of %s)", s, strings.Join(methodNames, ", "))
}

// MethodOf returns the method opts select, as Attention reads them: Auto
// when none does, Hybrid with WithUlyssesAxis; or the error an invalid
// option gives (wrapping ErrInvalid). It lets a caller check a layout
// against the method (Ulysses's heads divisible by cp) before any rank
// starts.
func MethodOf(opts ...Option) (Method, error) {
	var c config
	for _, o := range opts {
		o(&c)
	}
	if err := c.optionErr("MethodOf"); err != nil {
		return 0, err
	}
	if c.inner != "" && c.method == Auto {
		return Hybrid, nil
	}
	return c.method, nil
}

// optionErr is the error an invalid option left in c, for op, wrapping
// ErrInvalid once: numcheck's errors wrap it already.
func (c *config) optionErr(op string) error {
	switch {
	case c.err == nil:
		return nil
	case errors.Is(c.err, ErrInvalid):
		return c.err
	}
	return invalidf(op, "%v", c.err)
}

// Option configures Attention.
type Option func(*config)

type config struct {
	stats   *Stats
	method  Method
	inner   string
	model   *comm.CostModel
	flops   float64
	timeout time.Duration
	err     error
}

// WithMethod picks the method (default Auto).
func WithMethod(m Method) Option {
	return func(c *config) {
		if m > Hybrid && c.err == nil {
			c.err = fmt.Errorf("WithMethod: unknown method %d", m)
		}
		c.method = m
	}
}

// WithUlyssesAxis names the inner axis of Hybrid: the sequence is sharded
// over the cp axis (outer) and then this axis; Ulysses runs within each
// group along this axis and the ring across the groups.
func WithUlyssesAxis(name string) Option { return func(c *config) { c.inner = name } }

// WithCostModel prices the collectives Auto compares (default
// comm.BuiltinCostModel).
func WithCostModel(m *comm.CostModel) Option { return func(c *config) { c.model = m } }

// WithComputeRate sets the attention throughput Auto assumes, in
// floating-point operations a second per rank (default 1e10), to judge how
// much of the ring's transfers the block computations hide.
func WithComputeRate(flops float64) Option {
	return func(c *config) {
		if err := numcheck.Positive(ErrInvalid, "WithComputeRate", flops); err != nil && c.err == nil {
			c.err = err
		}
		c.flops = flops
	}
}

// Stats is what a rank's calls of Attention did, summed over calls,
// forward and backward (WithStats).
type Stats struct {
	// Compute is the time spent in the block kernels (on a device, in
	// queueing them), and Blocks the block pairs computed: a block
	// wholly above the causal diagonal is skipped.
	Compute time.Duration
	Blocks  int
	// Transfer is the ring's K/V transfer time, from each step's start to
	// the completion of its sends and receives, and Exposed the part of
	// it the rank waited for after the step's compute: 1 − Exposed/Transfer
	// is the fraction hidden behind attention.
	Transfer, Exposed time.Duration
	// Kept is the bytes the forwards keep for their backwards beyond the
	// inputs: the output and log-sum-exps of the attention group, the
	// gathered K/V (AllGather), the head-sharded q, k and v (Ulysses,
	// Hybrid). It falls as 1/cp for Ring and Ulysses.
	Kept int64
}

// WithStats adds this rank's timings to s (one Stats per rank: it is not
// safe for concurrent use).
func WithStats(s *Stats) Option { return func(c *config) { c.stats = s } }

// WithTimeout bounds each of the op's transfers (default 5 minutes); a
// transfer past it aborts the communicator, as every blocking call does.
func WithTimeout(d time.Duration) Option {
	return func(c *config) {
		if d <= 0 && c.err == nil {
			c.err = fmt.Errorf("WithTimeout: %v is not positive", d)
		}
		c.timeout = d
	}
}

// Attention is exact causal scaled-dot-product attention,
// softmax_causal(q·kᵀ/√Dh)·v, of q, k [..., H, T, Dh] and v [..., H, T, Dv]
// whose sequence dim T is sharded over the mesh axis axis (and, for
// Hybrid, then over the inner axis): every rank holds its rows of T and
// gets its rows of the result, [..., H, T, Dv], laid out like q. The
// causal mask is by global position, so any sharding of T works: plain
// Shard (uneven included) or placement.ShardBalanced, the causal load
// balancing. Leading dims (batch, heads) may be sharded over other axes
// (TP shards the heads) alike in q, k and v; Dh and Dv may not be, and no
// input may be Partial. q, k and v must be laid out alike (same
// placements and orders).
//
// It is recorded as one op whose backward is the method's own:
// the ring rotates K and V again with their gradients travelling beside
// them, the all-gather reduce-scatters dK and dV, Ulysses runs the
// all-to-alls backwards. A gradient that reaches it in another layout than
// the result's is redistributed to the result's first (every rank gets the
// same layout, so every rank does). Every rank of the mesh must call it in
// the same order. Results and gradients equal the one-rank attention's to
// floating-point rounding: partials merge by log-sum-exp in the inputs'
// precision, sums run in float64.
//
// Auto picks, from the cost model (WithCostModel) and the compute rate
// (WithComputeRate): Ulysses when the local heads divide by cp and its
// eight all-to-alls (forward and backward) cost no more than the ring's
// exposed time; else Ring when the ring's exposed time is at most the
// all-gather's (one all-gather of K and V forward and backward and a
// reduce-scatter of their gradients); else AllGather. The ring's exposed
// time is, per step, the transfer time beyond the block's attention time
// (4·batch·heads·rows²·Dh operations at the compute rate), never less
// than one latency. Hybrid is never chosen by Auto.
//
// Errors wrap ErrInvalid for layouts and options refused before any data
// moves (naming the dim, axis or sizes at fault; Ulysses with heads not
// divisible by cp names both), ErrUnsupported for device tensors whose
// kernels lack block attention; transfer errors are the communicator's.
func Attention(ctx context.Context, q, k, v *autograd.Value, axis string, opts ...Option) (*autograd.Value, error) {
	const op = "Attention"
	cfg := config{model: comm.BuiltinCostModel(), flops: 1e10, timeout: 5 * time.Minute}
	for _, o := range opts {
		o(&cfg)
	}
	if err := cfg.optionErr(op); err != nil {
		return nil, err
	}
	lay, err := newLayout(op, q, k, v, axis, cfg)
	if err != nil {
		return nil, err
	}
	if lay.method == Auto {
		lay.method = choose(lay, cfg)
	}
	if lay.method == Ulysses && lay.heads%lay.n != 0 {
		return nil, invalidf(op, "Ulysses splits the %d local heads over cp=%d (axis %q): heads must be divisible by cp; pick Ring or AllGather, or another cp", lay.heads, lay.n, axis)
	}
	if lay.method == Hybrid && lay.heads%lay.nInner != 0 {
		return nil, invalidf(op, "Hybrid's Ulysses splits the %d local heads over %d (axis %q): heads must be divisible by it", lay.heads, lay.nInner, cfg.inner)
	}
	if err := lay.groups(ctx); err != nil {
		return nil, fmt.Errorf("cp: %s: %w", op, err)
	}
	return attention(ctx, lay, q, k, v, cfg)
}

// choose is Auto's rule (see Attention).
func choose(l *layout, cfg config) Method {
	if l.method == Hybrid || l.n <= 1 {
		return Ring
	}
	m := cfg.model
	es := int64(l.dtype.Size())
	rows := int64(0)
	for i := range l.n {
		rows = max(rows, int64(len(l.rows(i))))
	}
	bq := int64(l.batch) * rows * int64(l.dh) * es // one local Q or K block
	bkv := int64(l.batch) * rows * int64(l.dh+l.dv) * es
	n := l.n
	flops := 4 * float64(l.batch) * float64(rows) * float64(rows) * float64(l.dh)
	block := time.Duration(flops / cfg.flops * 1e9)
	step := max(m.Estimate(comm.OpSend, 2, bkv)-block, m.Estimate(comm.OpSend, 2, 0))
	ring := time.Duration(3*(n-1)) * step
	gather := 2*m.Estimate(comm.OpAllGather, n, bkv) + m.Estimate(comm.OpReduceScatter, n, bkv*int64(n))
	if l.heads%n == 0 && 8*m.Estimate(comm.OpAllToAll, n, bq) <= min(ring, gather) {
		return Ulysses
	}
	if ring <= gather {
		return Ring
	}
	return AllGather
}

// attention records the op; o runs its kernels.
func attention(ctx context.Context, l *layout, q, k, v *autograd.Value, cfg config) (*autograd.Value, error) {
	name := "cp.Attention(" + l.method.String() + ")"
	var o ops
	d := q.Data().Device()
	switch {
	case d.Kind() != device.KindHost:
		do, err := newDevOps(d, q.Tape(), l.dtype)
		if err != nil {
			return nil, err // names the package, the op and the device
		}
		o = do
	case l.dtype == comm.Float64:
		o = hostOps[float64]{b: q.Tape().BLAS(), w: q.Tape().Workers()}
	default:
		o = hostOps[float32]{b: q.Tape().BLAS(), w: q.Tape().Workers()}
	}
	st := &state{l: l, timeout: cfg.timeout, scale: 1 / math.Sqrt(float64(l.dh)), o: o, stats: cfg.stats}
	outSpec, err := l.outSpec(q.Spec())
	if err != nil {
		return nil, err
	}
	specs := []*placement.Spec{q.Spec(), k.Spec(), v.Spec()}
	return autograd.Custom(name, []*autograd.Value{q, k, v},
		func() (*placement.DTensor, error) {
			out, err := st.forward(ctx, q.Data().LocalBuffer(), k.Data().LocalBuffer(), v.Data().LocalBuffer())
			if err != nil {
				return nil, err
			}
			return o.wrap(outSpec, out)
		},
		func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			if !g.Spec().Equal(outSpec) {
				var err error
				if g, err = placement.Redistribute(ctx, g, outSpec); err != nil {
					return nil, err
				}
			}
			dq, dk, dv, err := st.backward(ctx, g.LocalBuffer())
			if err != nil {
				return nil, err
			}
			grads := make([]*placement.DTensor, 3)
			for i, d := range []comm.Buffer{dq, dk, dv} {
				if grads[i], err = o.wrap(specs[i], d); err != nil {
					return nil, err
				}
			}
			return grads, nil
		})
}

// samePlacements reports whether specs a and b have equal placements and
// shard orders.
func samePlacements(a, b *placement.Spec) bool {
	if !slices.Equal(a.Placements(), b.Placements()) {
		return false
	}
	for d := range a.Shape() {
		if !slices.Equal(a.Order(d), b.Order(d)) {
			return false
		}
	}
	return true
}
