package moe

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/placement"
)

// DefaultBiasRate is the expert-bias update rate used when
// RouterConfig.BiasRate is 0 (Megatron's moe_router_bias_update_rate).
const DefaultBiasRate = 1e-3

// sigmoidEps is added to the sum of sigmoid scores before dividing by it,
// as Megatron does (it keeps an all-zero sum finite).
const sigmoidEps = 1e-20

// RouterConfig configures a Router. Megatron-Core's names for the same
// options are given in parentheses. The zero value (with K set) is a
// dropless softmax top-K router without renormalisation or losses; the
// reference layer of reference/MOE_LAYER.md is {K: 2, Renormalize: true, AuxCoef:
// 0.01, ZCoef: 0.001}.
type RouterConfig struct {
	// K is the number of experts per token, 1 ≤ K ≤ E (moe_router_topk).
	K int
	// Score is the score function (moe_router_score_function).
	Score ScoreFunc
	// Renormalize divides each token's selected scores by their sum, so
	// that its gates sum to GateScale. With softmax scores this equals
	// a softmax over the K selected logits (Megatron's default, not
	// moe_router_pre_softmax); for sigmoid scores with K > 1 it is what
	// Megatron always does (with 1e-20 added to the sum).
	Renormalize bool
	// GateScale multiplies every gate (moe_router_topk_scaling_factor;
	// DeepSeek-V3's routed scaling factor 2.5). 0 means 1; it must not be
	// negative.
	GateScale float64

	// NumGroups and TopGroups enable group-limited routing
	// (moe_router_num_groups, moe_router_group_topk; DeepSeek-V2's
	// device-limited and V3's node-limited routing): the E experts form
	// NumGroups contiguous groups of E/NumGroups, and each token chooses
	// its K experts inside its TopGroups best groups, a group being scored
	// by the sum of its GroupScoreTop best selection scores (equal group
	// scores: the lower group first). Both 0 turn it off; otherwise
	// NumGroups divides E, 1 ≤ TopGroups ≤ NumGroups and K ≤
	// TopGroups·E/NumGroups.
	NumGroups, TopGroups int
	// GroupScoreTop is the number of best experts whose scores make a
	// group's score. 0 means Megatron's K/TopGroups (at least 1, at most
	// the group size), which is DeepSeek-V3's top-2 for K = 8 and
	// TopGroups = 4. Otherwise 1 ≤ GroupScoreTop ≤ E/NumGroups.
	GroupScoreTop int

	// AuxCoef is α, the coefficient of the Switch/GShard load-balancing
	// loss α·E·Σ_e f_e·P_e (moe_aux_loss_coeff). 0 turns the loss off
	// (Routing.Aux is nil). It must be finite and not negative.
	AuxCoef float64
	// ZCoef is β, the coefficient of the router z-loss β·mean_t(lse_t²)
	// of the raw logits (moe_z_loss_coeff; 1e-3 is usual). 0 turns it off
	// (Routing.Z is nil). It must be finite and not negative.
	ZCoef float64

	// ExpertBias enables auxiliary-loss-free balancing (DeepSeek-V3;
	// moe_router_enable_expert_bias): a per-expert bias added to the
	// scores for the choice of experts only (never to the gates), updated
	// by Router.UpdateExpertBias after each step.
	ExpertBias bool
	// BiasRate is the bias update rate u (moe_router_bias_update_rate):
	// each update moves every bias by u towards balance. 0 means
	// DefaultBiasRate; it must not be negative.
	BiasRate float64

	// CapacityFactor limits every expert to ⌈CapacityFactor·n·K/E⌉ slots
	// of a rank's n local tokens (moe_expert_capacity_factor; Megatron's
	// get_capacity, per rank); the slots beyond are dropped (Experts −1,
	// gate 0). 0 means dropless (the default); otherwise it must be
	// positive and finite.
	CapacityFactor float64
	// DropPolicy chooses the slots an over-full expert keeps
	// (moe_token_drop_policy).
	DropPolicy DropPolicy
	// PadToCapacity asks dispatch to pad every expert's rows from a rank
	// to the capacity (moe_pad_expert_input_to_capacity), reported in
	// Routing.Pad, Capacity and Padded. It needs a CapacityFactor.
	PadToCapacity bool
}

// normalized checks c for e experts and returns it with its defaults
// filled in.
func (c RouterConfig) normalized(e int) (RouterConfig, error) {
	bad := func(format string, args ...any) (RouterConfig, error) {
		return c, fmt.Errorf("moe: RouterConfig: %w: "+format, append([]any{ErrInvalid}, args...)...)
	}
	if e < 1 {
		return bad("%d experts; want at least 1", e)
	}
	if err := numcheck.Count(ErrInvalid, "K", c.K); err != nil {
		return c, fmt.Errorf("moe: RouterConfig: %w", err)
	}
	if c.K > e {
		return bad("K = %d experts per token; want 1 ≤ K ≤ E = %d", c.K, e)
	}
	if c.Score != Softmax && c.Score != Sigmoid {
		return bad("unknown score function %v", c.Score)
	}
	// Every one of these has a documented meaning for 0 (default, off,
	// dropless), so the rule is NonNegative for all.
	for _, err := range []error{
		numcheck.NonNegative(ErrInvalid, "GateScale", c.GateScale),
		numcheck.NonNegative(ErrInvalid, "AuxCoef", c.AuxCoef),
		numcheck.NonNegative(ErrInvalid, "ZCoef", c.ZCoef),
		numcheck.NonNegative(ErrInvalid, "BiasRate", c.BiasRate),
		numcheck.NonNegative(ErrInvalid, "CapacityFactor", c.CapacityFactor),
	} {
		if err != nil {
			return c, fmt.Errorf("moe: RouterConfig: %w", err)
		}
	}
	if c.GateScale == 0 {
		c.GateScale = 1
	}
	if c.BiasRate == 0 {
		c.BiasRate = DefaultBiasRate
	}
	if c.NumGroups != 0 || c.TopGroups != 0 {
		if c.NumGroups < 1 || e%c.NumGroups != 0 {
			return bad("NumGroups = %d must divide the %d experts", c.NumGroups, e)
		}
		if c.TopGroups < 1 || c.TopGroups > c.NumGroups {
			return bad("TopGroups = %d; want 1 ≤ TopGroups ≤ NumGroups = %d", c.TopGroups, c.NumGroups)
		}
		size := e / c.NumGroups
		if c.K > c.TopGroups*size {
			return bad("K = %d experts per token, but TopGroups = %d groups of %d experts hold only %d", c.K, c.TopGroups, size, c.TopGroups*size)
		}
		if c.GroupScoreTop == 0 {
			c.GroupScoreTop = min(max(c.K/c.TopGroups, 1), size)
		}
		if c.GroupScoreTop < 1 || c.GroupScoreTop > size {
			return bad("GroupScoreTop = %d; want 1 ≤ GroupScoreTop ≤ %d (the group size)", c.GroupScoreTop, size)
		}
	} else if c.GroupScoreTop != 0 {
		return bad("GroupScoreTop = %d without NumGroups and TopGroups", c.GroupScoreTop)
	}
	if c.DropPolicy != DropByProb && c.DropPolicy != DropByPosition {
		return bad("unknown drop policy %v", c.DropPolicy)
	}
	if c.PadToCapacity && c.CapacityFactor == 0 {
		return bad("PadToCapacity needs a CapacityFactor (dropless routing has no capacity)")
	}
	return c, nil
}

// Router is a top-K token router: a linear map Wr [E, D] of each token
// to E logits, a score function, the choice of experts, the gate weights
// and the load-balancing losses (see the package documentation). Its only
// state besides the weight is the expert bias. A Router belongs to one
// rank's tape, like its weight; every rank of the mesh holds its own, with
// the same configuration and the same bias.
type Router struct {
	// Weight is Wr [E, D] (no bias), laid out Replicate on every mesh
	// axis, usually a parameter (autograd.Tape.Param). Route checks it.
	Weight *autograd.Value

	cfg  RouterConfig
	bias []float64
}

// NewRouter returns a router with weight Wr [E, D] and configuration cfg,
// its expert bias zero. Errors wrap ErrInvalid: a nil weight, a weight
// that is not 2-D, a configuration that does not fit E.
func NewRouter(weight *autograd.Value, cfg RouterConfig) (*Router, error) {
	if weight == nil || weight.Spec() == nil {
		return nil, fmt.Errorf("%w: NewRouter: nil weight", ErrInvalid)
	}
	shape := weight.Spec().Shape()
	if len(shape) != 2 {
		return nil, fmt.Errorf("%w: NewRouter: the weight has shape %v; want [E, D]", ErrInvalid, shape)
	}
	c, err := cfg.normalized(shape[0])
	if err != nil {
		return nil, fmt.Errorf("moe: NewRouter: %w", err)
	}
	return &Router{Weight: weight, cfg: c, bias: make([]float64, shape[0])}, nil
}

// Config returns the router's configuration with its defaults filled in
// (GateScale, BiasRate, GroupScoreTop); the zero config for a nil router.
func (r *Router) Config() RouterConfig {
	if r == nil {
		return RouterConfig{}
	}
	return r.cfg
}

// NumExperts returns E (0 for a nil router).
func (r *Router) NumExperts() int {
	if r == nil {
		return 0
	}
	return len(r.bias)
}

// OwnParams returns the router weight, so that a Router is a
// parallel.ParamHolder (nil for a nil router).
func (r *Router) OwnParams() []*autograd.Value {
	if r == nil {
		return nil
	}
	return []*autograd.Value{r.Weight}
}

// ExpertBias returns a copy of the expert bias [E] (zeros unless
// RouterConfig.ExpertBias is set and the bias has been updated; nil for a
// nil router).
func (r *Router) ExpertBias() []float64 {
	if r == nil {
		return nil
	}
	return slices.Clone(r.bias)
}

// SetExpertBias replaces the expert bias, e.g. from a checkpoint. It
// needs RouterConfig.ExpertBias and E finite values; errors wrap
// ErrInvalid and leave the bias unchanged.
func (r *Router) SetExpertBias(bias []float64) error {
	if r == nil {
		return fmt.Errorf("%w: Router.SetExpertBias: nil router", ErrInvalid)
	}
	if !r.cfg.ExpertBias {
		return fmt.Errorf("%w: Router.SetExpertBias: the expert bias is off (RouterConfig.ExpertBias)", ErrInvalid)
	}
	if len(bias) != len(r.bias) {
		return fmt.Errorf("%w: Router.SetExpertBias: %d values for %d experts", ErrInvalid, len(bias), len(r.bias))
	}
	for e, b := range bias {
		if math.IsNaN(b) || math.IsInf(b, 0) {
			return fmt.Errorf("%w: Router.SetExpertBias: bias of expert %d is %v", ErrInvalid, e, b)
		}
	}
	copy(r.bias, bias)
	return nil
}

// UpdateExpertBias is the auxiliary-loss-free balancing update of
// DeepSeek-V3, which the training loop calls after each optimizer step
// with the Counts of the routings since the previous update (one per
// micro-batch; they are added): with c_e the summed tokens of expert e and
// c̄ their mean over the experts, every bias moves by
//
//	b_e += BiasRate · sign(c̄ − c_e)
//
// so that over-loaded experts become less attractive and under-loaded
// ones more. Routing.Counts are global and identical on every rank, so
// every rank makes the same update without communicating; when some
// data-parallel axis does not shard the router's tokens, all-reduce the
// counts over it first, or the replicas' biases drift apart. It needs
// RouterConfig.ExpertBias; errors (wrapping ErrInvalid: no counts, a
// vector of the wrong length, a negative count) leave the bias unchanged.
func (r *Router) UpdateExpertBias(counts ...[]int64) error {
	const op = "moe: Router.UpdateExpertBias"
	if r == nil {
		return fmt.Errorf("%s: %w: nil router", op, ErrInvalid)
	}
	if !r.cfg.ExpertBias {
		return fmt.Errorf("%s: %w: the expert bias is off (RouterConfig.ExpertBias)", op, ErrInvalid)
	}
	if len(counts) == 0 {
		return fmt.Errorf("%s: %w: no counts", op, ErrInvalid)
	}
	e := len(r.bias)
	sum := make([]float64, e)
	total := 0.0
	for i, c := range counts {
		if len(c) != e {
			return fmt.Errorf("%s: %w: counts %d hold %d values for %d experts", op, ErrInvalid, i, len(c), e)
		}
		for x, v := range c {
			if v < 0 {
				return fmt.Errorf("%s: %w: counts %d: expert %d has %d tokens", op, ErrInvalid, i, x, v)
			}
			sum[x] += float64(v)
			total += float64(v)
		}
	}
	mean := total / float64(e)
	for x, c := range sum {
		switch {
		case c < mean:
			r.bias[x] += r.cfg.BiasRate
		case c > mean:
			r.bias[x] -= r.cfg.BiasRate
		}
	}
	return nil
}

// Route routes this rank's tokens x [n, D] (global [N, D]), laid out
// Shard(0) on the token-sharding mesh axes, in mesh-axis order, and
// Replicate on the others (Replicate everywhere on a one-rank mesh or
// when every rank holds all tokens). Ranks may hold unequal numbers of
// tokens, or none. x must have the weight's dtype (float32 or float64)
// and mesh; the weight must be [E, D] and Replicate everywhere.
//
// It records the logits (autograd.Linear of x and the weight) and local
// functions for the gates and the losses on x's tape, so that Backward
// sends gradient to the weight (Partial(sum) on the token-sharding axes)
// and to x. The Routing is described with its type; its slots are ordered
// by selection score, ties to the lower expert index.
//
// Route is collective over the token-sharding axes: it issues one
// all-reduce(sum) of int64 counts (E+1 values, 2E+1 with a capacity
// limit) on the communicator of those axes (mesh.Mesh.Group), and every
// rank of the mesh must call it in the same order with the same
// configuration and expert bias. All arguments are checked before it
// communicates; errors wrap ErrInvalid (with autograd's and placement's
// errors beside it). Logits that are not finite on any rank (NaN or ±Inf,
// say from a diverged step) are reported after the all-reduce, by every
// rank alike. Communication errors are wrapped with the op's name.
func (r *Router) Route(ctx context.Context, x *autograd.Value) (*Routing, error) {
	const op = "moe: Router.Route"
	if r == nil || r.Weight == nil || r.Weight.Spec() == nil {
		return nil, fmt.Errorf("%s: %w: nil router or router weight", op, ErrInvalid)
	}
	if r.bias == nil {
		return nil, fmt.Errorf("%s: %w: the router was not made by NewRouter", op, ErrInvalid)
	}
	if x == nil || x.Spec() == nil {
		return nil, fmt.Errorf("%s: %w: nil tokens", op, ErrInvalid)
	}
	ws, xs := r.Weight.Spec(), x.Spec()
	wshape, xshape := ws.Shape(), xs.Shape()
	e := len(r.bias)
	if len(wshape) != 2 || wshape[0] != e {
		return nil, fmt.Errorf("%s: %w: the weight has shape %v; this router has %d experts, want [%d, D]", op, ErrInvalid, wshape, e, e)
	}
	if len(xshape) != 2 || xshape[1] != wshape[1] {
		return nil, fmt.Errorf("%s: %w: tokens of shape %v for a weight %v; want [N, %d] (reshape [B, T, D] tokens to [B·T, D] first)", op, ErrInvalid, xshape, wshape, wshape[1])
	}
	if xs.DType() != ws.DType() {
		return nil, fmt.Errorf("%s: %w: tokens are %v, the weight %v; they must match", op, ErrInvalid, xs.DType(), ws.DType())
	}
	m := xs.Mesh()
	names := m.Names()
	if !slices.Equal(names, ws.Mesh().Names()) || !slices.Equal(m.Shape(), ws.Mesh().Shape()) || !slices.Equal(m.WorldRanks(), ws.Mesh().WorldRanks()) {
		return nil, fmt.Errorf("%s: %w: tokens on %v, the weight on %v; they must share a mesh", op, ErrInvalid, m, ws.Mesh())
	}
	for a, p := range ws.Placements() {
		if !p.IsReplicate() {
			return nil, fmt.Errorf("%s: %w: the weight is %v on mesh axis %q; the router weight must be Replicate on every axis", op, ErrInvalid, p, names[a])
		}
	}
	var tokenAxes []string
	tokenRanks := 1
	for a, p := range xs.Placements() {
		switch {
		case p == placement.Shard(0):
			tokenAxes = append(tokenAxes, names[a])
			tokenRanks *= m.Shape()[a]
		case !p.IsReplicate():
			return nil, fmt.Errorf("%s: %w: tokens are %v on mesh axis %q; want S(0) (sharded tokens) or R: redistribute them first", op, ErrInvalid, p, names[a])
		}
	}
	if !slices.Equal(xs.Order(0), tokenAxes) {
		return nil, fmt.Errorf("%s: %w: the tokens are sharded over mesh axes %v in that order; the router needs mesh-axis order %v: redistribute them first", op, ErrInvalid, xs.Order(0), tokenAxes)
	}

	logits, err := autograd.Linear(x, r.Weight, nil)
	if err != nil {
		// Everything else was checked: x and the weight are on different
		// tapes, or the like.
		return nil, fmt.Errorf("%s: %w: logits: %w", op, ErrInvalid, err)
	}
	rc := &routeCall{
		r: r, x: xs, logits: logits, n: xs.LocalShape()[0], nGlobal: xshape[0], e: e, k: r.cfg.K,
		tokenAxes: tokenAxes, tokenRanks: tokenRanks,
	}
	// On a device the choice of experts is made on the host (device.go):
	// the logits come over, the gates and losses go back.
	dev := logits.Data().Device()
	if dev.Kind() != device.KindHost {
		if rc.logits, err = autograd.To(logits, device.Host()); err != nil {
			return nil, fmt.Errorf("%s: logits to the host: %w", op, err)
		}
	}
	var rt *Routing
	if xs.DType() == comm.Float32 {
		rt, err = routeAs[float32](ctx, rc)
	} else {
		rt, err = routeAs[float64](ctx, rc)
	}
	if err != nil || dev.Kind() == device.KindHost {
		return rt, err
	}
	for _, v := range []**autograd.Value{&rt.Gates, &rt.Aux, &rt.Z} {
		if *v == nil {
			continue
		}
		if *v, err = autograd.To(*v, dev); err != nil {
			return nil, fmt.Errorf("%s: gates and losses to %s: %w", op, dev.Name(), err)
		}
	}
	return rt, nil
}

// routeCall is one Route call's layout and sizes.
type routeCall struct {
	r          *Router
	x          *placement.Spec
	logits     *autograd.Value
	n, nGlobal int
	e, k       int
	tokenAxes  []string
	tokenRanks int
}

// localRoute is this rank's routing before the gates are recorded, in
// float64 copies of values rounded to the router's dtype. The scores are
// not kept: the backward functions recompute them from the logits block
// (scoreRow), bit for bit.
type localRoute struct {
	lse       []float64 // [n]: log-sum-exp of the logits
	sel       []int32   // [n, K]: chosen experts, before the capacity limit
	kept      []bool    // [n, K]: slot kept by the capacity limit
	denom     []float64 // [n]: renormalisation denominator (1 without)
	gates     []float64 // [n, K]: gates, 0 for dropped slots
	pSum      []float64 // [E]: Σ over local tokens of the aux loss's P_t[e]
	nonFinite int64     // logits that are NaN or ±Inf
}

func round[T float32 | float64](v float64) float64 { return float64(T(v)) }

func sigmoid(z float64) float64 {
	if z >= 0 {
		return 1 / (1 + math.Exp(-z))
	}
	ez := math.Exp(z)
	return ez / (1 + ez)
}

// scoreRow writes a token's scores (softmax or σ of its logits z, rounded
// to T) into p and returns the log-sum-exp of z and the number of logits
// that are not finite (then p and lse are left unset).
func scoreRow[T float32 | float64](score ScoreFunc, z []T, p []float64) (lse float64, bad int64) {
	mx := math.Inf(-1)
	for _, v := range z {
		f := float64(v)
		if math.IsNaN(f) || math.IsInf(f, 0) {
			bad++
		}
		mx = max(mx, f)
	}
	if bad > 0 {
		return 0, bad
	}
	s := 0.0
	for _, v := range z {
		s += math.Exp(float64(v) - mx)
	}
	for x, v := range z {
		if score == Softmax {
			p[x] = round[T](math.Exp(float64(v)-mx) / s)
		} else {
			p[x] = round[T](sigmoid(float64(v)))
		}
	}
	return mx + math.Log(s), 0
}

// auxRow turns a token's scores p into the aux loss's probabilities P in
// place (sigmoid scores normalised to sum to 1) and returns the
// normalising sum (1 for softmax).
func auxRow(score ScoreFunc, p []float64) float64 {
	if score == Softmax {
		return 1
	}
	s := sigmoidEps
	for _, v := range p {
		s += v
	}
	for x := range p {
		p[x] /= s
	}
	return s
}

// computeLocal scores, selects and gates the n local tokens (logits z
// [n, E]) and applies the capacity limit.
func computeLocal[T float32 | float64](rc *routeCall, z []T, capacity int) *localRoute {
	cfg := rc.r.cfg
	n, e, k := rc.n, rc.e, rc.k
	lr := &localRoute{
		lse:   make([]float64, n),
		sel:   make([]int32, n*k),
		kept:  make([]bool, n*k),
		denom: make([]float64, n),
		gates: make([]float64, n*k),
		pSum:  make([]float64, e),
	}
	var g *groupLimit
	if cfg.NumGroups > 0 {
		g = &groupLimit{groups: cfg.NumGroups, top: cfg.TopGroups, sumTop: cfg.GroupScoreTop}
	}
	choose := newSelector(e, g)
	keys := make([]float64, e)
	p := make([]float64, e)
	for t := range n {
		sel := lr.sel[t*k : (t+1)*k]
		lse, bad := scoreRow(cfg.Score, z[t*e:(t+1)*e], p)
		if bad > 0 {
			// Reported after the all-reduce; keep the slots valid.
			lr.nonFinite += bad
			for j := range sel {
				sel[j] = int32(j)
			}
			lr.denom[t] = 1
			continue
		}
		lr.lse[t] = lse
		for x := range keys {
			if cfg.ExpertBias {
				keys[x] = float64(T(p[x]) + T(rc.r.bias[x]))
			} else {
				keys[x] = p[x]
			}
		}
		choose.choose(keys, sel)
		d := 1.0
		if cfg.Renormalize {
			d = 0
			for _, x := range sel {
				d += p[x]
			}
			if cfg.Score == Sigmoid {
				d += sigmoidEps
			}
		}
		lr.denom[t] = d
		for j, x := range sel {
			lr.gates[t*k+j] = round[T](cfg.GateScale * p[x] / d)
		}
		if cfg.AuxCoef != 0 {
			auxRow(cfg.Score, p)
			for x, v := range p {
				lr.pSum[x] += v
			}
		}
	}
	for i := range lr.kept {
		lr.kept[i] = true
	}
	if cfg.CapacityFactor > 0 {
		dropOverCapacity(lr.sel, lr.gates, e, capacity, cfg.DropPolicy, lr.kept)
		for i, ok := range lr.kept {
			if !ok {
				lr.gates[i] = 0
			}
		}
	}
	return lr
}

func routeAs[T float32 | float64](ctx context.Context, rc *routeCall) (*Routing, error) {
	const op = "moe: Router.Route"
	cfg := rc.r.cfg
	n, e, k := rc.n, rc.e, rc.k
	z, ok := rc.logits.Data().LocalData().([]T)
	if !ok || len(z) != n*e {
		return nil, fmt.Errorf("%s: %w: logits block of %d values for %d local tokens and %d experts", op, ErrInvalid, len(z), n, e)
	}
	capacity := 0
	if cfg.CapacityFactor > 0 {
		capacity = capacityOf(n, k, e, cfg.CapacityFactor)
	}
	lr := computeLocal(rc, z, capacity)

	// Counts: kept per expert, then (with a capacity limit) selected per
	// expert, then the number of non-finite logits.
	dropping := cfg.CapacityFactor > 0
	width := e + 1
	if dropping {
		width = 2*e + 1
	}
	counts := make([]int64, width)
	for i, x := range lr.sel {
		if lr.kept[i] {
			counts[x]++
		}
		if dropping {
			counts[e+int(x)]++
		}
	}
	counts[width-1] = lr.nonFinite
	if rc.tokenRanks > 1 {
		c, err := rc.x.Mesh().Group(ctx, rc.tokenAxes...)
		if err != nil {
			return nil, fmt.Errorf("%s: communicator of mesh axes %v: %w", op, rc.tokenAxes, err)
		}
		global := make([]int64, width)
		if err := comm.AllReduce(ctx, c, comm.Host(counts), comm.Host(global), comm.Sum); err != nil {
			return nil, fmt.Errorf("%s: all-reduce of the tokens per expert over %v: %w", op, rc.tokenAxes, err)
		}
		counts = global
	}
	if bad := counts[width-1]; bad > 0 {
		return nil, fmt.Errorf("%s: %w: %d router logits over the global batch are NaN or infinite", op, ErrInvalid, bad)
	}
	kept := counts[:e:e]
	selected := kept
	if dropping {
		selected = counts[e : 2*e]
	}
	rt := &Routing{
		NumExperts: e,
		K:          k,
		Experts:    make([]int32, n*k),
		Counts:     slices.Clone(kept),
		Capacity:   capacity,
		Pad:        cfg.PadToCapacity,
		logits:     rc.logits,
		score:      cfg.Score,
	}
	var sumKept, sumSel int64
	for x := range e {
		sumKept += kept[x]
		sumSel += selected[x]
	}
	rt.Dropped = sumSel - sumKept
	for i, x := range lr.sel {
		rt.Experts[i] = x
		if !lr.kept[i] {
			rt.Experts[i] = -1
		}
	}
	if cfg.PadToCapacity {
		slots, err := rc.paddedSlots()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", op, err)
		}
		rt.Padded = slots - sumKept
	}

	rows := rc.x.Placements()
	sumPl := slices.Clone(rows)
	repPl := slices.Clone(rows)
	for a, p := range rows {
		repPl[a] = placement.Replicate()
		if p.IsShard() {
			sumPl[a] = placement.Partial(comm.Sum)
		}
	}
	var err error
	if rt.Gates, err = gatesFunc[T](rc, lr, rows).Apply(rc.logits); err != nil {
		return nil, fmt.Errorf("%s: gates: %w", op, err)
	}
	if cfg.AuxCoef != 0 {
		if rt.Aux, err = auxFunc[T](rc, lr, selected, rows, sumPl, repPl).Apply(rc.logits); err != nil {
			return nil, fmt.Errorf("%s: load-balancing loss: %w", op, err)
		}
	}
	if cfg.ZCoef != 0 {
		if rt.Z, err = zFunc[T](rc, lr, rows, sumPl, repPl).Apply(rc.logits); err != nil {
			return nil, fmt.Errorf("%s: z-loss: %w", op, err)
		}
	}
	return rt, nil
}

// paddedSlots returns Σ E·capacity over the distinct token shards: the
// rows every expert buffer holds when padded to capacity.
func (rc *routeCall) paddedSlots() (int64, error) {
	m := rc.x.Mesh()
	seen := map[int]bool{}
	var slots int64
	for mr := range m.Size() {
		off, size, err := rc.x.Box(mr)
		if err != nil {
			return 0, err
		}
		if size[0] == 0 || seen[off[0]] {
			continue
		}
		seen[off[0]] = true
		slots += int64(rc.e) * int64(capacityOf(size[0], rc.k, rc.e, rc.r.cfg.CapacityFactor))
	}
	return slots, nil
}

// gatesFunc is the local function logits [N, E] -> gates [N, K]; its
// backward goes through the renormalisation and the score function
// (reference/MOE_LAYER.md §4).
func gatesFunc[T float32 | float64](rc *routeCall, lr *localRoute, rows []placement.Placement) autograd.LocalFunc[T] {
	cfg := rc.r.cfg
	n, e, k := rc.n, rc.e, rc.k
	return autograd.LocalFunc[T]{
		Name:     "moe.Router.gates",
		In:       [][]placement.Placement{rows},
		GradIn:   [][]placement.Placement{rows},
		Out:      rows,
		OutShape: []int{rc.nGlobal, k},
		GradOut:  rows,
		Forward: func([]autograd.Block[T]) (autograd.Block[T], error) {
			out := make([]T, n*k)
			for i, g := range lr.gates {
				out[i] = T(g)
			}
			return autograd.Block[T]{Shape: []int{n, k}, Data: out}, nil
		},
		Backward: func(g autograd.Block[T], in []autograd.Block[T], _ autograd.Block[T]) ([]autograd.Block[T], error) {
			z := in[0].Data
			dz := make([]T, n*e)
			dq := make([]float64, k)
			acc := make([]float64, e)
			p := make([]float64, e)
			for t := range n {
				scoreRow(cfg.Score, z[t*e:(t+1)*e], p)
				sel := lr.sel[t*k : (t+1)*k]
				dot := 0.0
				for j := range k {
					dot += float64(g.Data[t*k+j]) * lr.gates[t*k+j]
				}
				for j := range k {
					m := 0.0
					if lr.kept[t*k+j] {
						m = cfg.GateScale * float64(g.Data[t*k+j])
					}
					if cfg.Renormalize {
						dq[j] = (m - dot) / lr.denom[t]
					} else {
						dq[j] = m
					}
				}
				row := dz[t*e : (t+1)*e]
				if cfg.Score == Softmax {
					// dz = p ⊙ (dp − Σ p·dp), dp nonzero at the selected experts.
					s := 0.0
					for j, x := range sel {
						s += p[x] * dq[j]
					}
					for x := range e {
						acc[x] = -p[x] * s
					}
					for j, x := range sel {
						acc[x] += p[x] * dq[j]
					}
					for x, v := range acc {
						row[x] = T(v)
					}
				} else {
					for j, x := range sel {
						row[x] = T(dq[j] * p[x] * (1 - p[x]))
					}
				}
			}
			return []autograd.Block[T]{{Shape: []int{n, e}, Data: dz}}, nil
		},
	}
}

// auxFunc is the local function logits -> α·aux, this rank's share
// Σ_{t local} Σ_e w_e·P_t[e] with w_e = α·E·f_e/N and f_e = c_e/(N·K)
// constant.
func auxFunc[T float32 | float64](rc *routeCall, lr *localRoute, selected []int64, rows, sumPl, repPl []placement.Placement) autograd.LocalFunc[T] {
	cfg := rc.r.cfg
	n, e := rc.n, rc.e
	nn := float64(rc.nGlobal)
	w := make([]float64, e)
	for x, c := range selected {
		w[x] = cfg.AuxCoef * float64(e) * (float64(c) / (nn * float64(rc.k))) / nn
	}
	forward := func() float64 {
		total := 0.0
		for x, v := range lr.pSum {
			total += w[x] * v
		}
		return total
	}
	return scalarLoss("moe.Router.aux", rows, sumPl, repPl, forward,
		func(z []T, gs float64) []T {
			dz := make([]T, n*e)
			p := make([]float64, e)
			sg := make([]float64, e)
			for t := range n {
				scoreRow(cfg.Score, z[t*e:(t+1)*e], p)
				copy(sg, p)
				norm := auxRow(cfg.Score, p)
				s := 0.0
				for x := range e {
					s += p[x] * w[x]
				}
				for x := range e {
					d := gs * (w[x] - s)
					if cfg.Score == Softmax {
						// dz = P ⊙ (dP − Σ P·dP).
						dz[t*e+x] = T(p[x] * d)
					} else {
						// P = σ/Σσ: dσ = (dP − Σ P·dP)/Σσ, dz = dσ·σ(1−σ).
						dz[t*e+x] = T(d / norm * sg[x] * (1 - sg[x]))
					}
				}
			}
			return dz
		})
}

// zFunc is the local function logits -> β·zloss, this rank's share
// β/N·Σ_{t local} lse_t²; its backward is g·β·2·lse_t/N·softmax(z_t).
func zFunc[T float32 | float64](rc *routeCall, lr *localRoute, rows, sumPl, repPl []placement.Placement) autograd.LocalFunc[T] {
	cfg := rc.r.cfg
	n, e := rc.n, rc.e
	c := cfg.ZCoef / float64(rc.nGlobal)
	forward := func() float64 {
		total := 0.0
		for _, l := range lr.lse {
			total += l * l
		}
		return c * total
	}
	return scalarLoss("moe.Router.zloss", rows, sumPl, repPl, forward,
		func(z []T, gs float64) []T {
			dz := make([]T, n*e)
			for t := range n {
				l := lr.lse[t]
				f := gs * c * 2 * l
				for x := range e {
					dz[t*e+x] = T(f * math.Exp(float64(z[t*e+x])-l))
				}
			}
			return dz
		})
}

// scalarLoss is the local function of a router loss: the logits [n, e]
// (laid out by rows) to this rank's share of a scalar (sumPl; its gradient
// arrives as repPl). forward returns the share; backward maps the logits
// z and the scalar's gradient gs to the logits' gradient.
func scalarLoss[T float32 | float64](name string, rows, sumPl, repPl []placement.Placement, forward func() float64, backward func(z []T, gs float64) []T) autograd.LocalFunc[T] {
	return autograd.LocalFunc[T]{
		Name:     name,
		In:       [][]placement.Placement{rows},
		GradIn:   [][]placement.Placement{rows},
		Out:      sumPl,
		OutShape: []int{},
		GradOut:  repPl,
		Forward: func([]autograd.Block[T]) (autograd.Block[T], error) {
			return autograd.Block[T]{Shape: []int{}, Data: []T{T(forward())}}, nil
		},
		Backward: func(g autograd.Block[T], in []autograd.Block[T], _ autograd.Block[T]) ([]autograd.Block[T], error) {
			return []autograd.Block[T]{{Shape: in[0].Shape, Data: backward(in[0].Data, float64(g.Data[0]))}}, nil
		},
	}
}
