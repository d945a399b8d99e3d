package placement

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
)

// StepKind is what one plan step does.
type StepKind uint8

// The step kinds. AllGather, AllReduce, ReduceScatter, AllToAll and
// CrossMesh communicate; the others are local.
const (
	// StepAllGather: Shard(d) -> Replicate on one axis.
	StepAllGather StepKind = iota + 1
	// StepAllReduce: Partial(op) -> Replicate on one axis.
	StepAllReduce
	// StepReduceScatter: Partial(op) -> Shard(d) on one axis.
	StepReduceScatter
	// StepAllToAll: Shard(i) -> Shard(j) on one axis.
	StepAllToAll
	// StepChunk: Replicate -> Shard(d), a local slice.
	StepChunk
	// StepToPartial: Replicate -> Partial(op), local: for sum the rank at
	// coordinate 0 of the axis keeps the value and the others hold zeros;
	// for avg, max and min every rank keeps it.
	StepToPartial
	// StepShardToPartial: Shard(d) -> Partial(sum), local: the shard is
	// placed in zeros of the unsharded shape.
	StepShardToPartial
	// StepDirect: one all-to-all-v over every rank of the mesh (the world
	// when the mesh covers it) that moves exactly the boxes whose owner
	// changes. It is how a tensor moves between two meshes over the same
	// ranks, and the planner's alternative to several per-axis collectives
	// for misaligned nested shards.
	StepDirect
	// StepPermute: a local reorder of dims that every rank holds whole,
	// between the orders of two load-balanced (ShardBalanced) layouts, or
	// one and the natural order.
	StepPermute
)

// String names the step kind as plans print it.
func (k StepKind) String() string {
	switch k {
	case StepAllGather:
		return "allgather"
	case StepAllReduce:
		return "allreduce"
	case StepReduceScatter:
		return "reducescatter"
	case StepAllToAll:
		return "alltoall"
	case StepChunk:
		return "chunk(local)"
	case StepToPartial:
		return "to-partial(local)"
	case StepShardToPartial:
		return "shard-to-partial(local)"
	case StepDirect:
		return "direct alltoallv"
	case StepPermute:
		return "permute(local)"
	}
	return fmt.Sprintf("step(%d)", uint8(k))
}

// Step is one step of a redistribution plan.
type Step struct {
	// Kind is what the step does.
	Kind StepKind
	// Axis is the mesh axis index (-1 for a direct step, which runs over
	// every rank); AxisName and AxisSize describe it. Steps after a direct
	// step refer to the destination mesh.
	Axis     int
	AxisName string
	AxisSize int
	// Collective is the communication op the step issues, 0 for a local step.
	Collective comm.Op
	// Reduce is the reduce operator of AllReduce and ReduceScatter.
	Reduce comm.ReduceOp
	// Dim is the tensor dim the step gathers, scatters or slices (the
	// source dim of an all-to-all), -1 if none; ToDim is the destination
	// dim of an all-to-all, -1 otherwise.
	Dim, ToDim int
	// From and To are the placements on the axis before and after.
	From, To Placement
	// Bytes is the largest number of bytes any rank receives from other
	// ranks in this step, exact for uneven shards (padding excluded); for
	// an all-reduce it is the ring's 2(p-1)/p of the payload.
	Bytes int64
	// Payload is the largest per-rank payload (nccl-tests "size") the
	// collective is issued with; Time is the cost model's estimate for it
	// (0 without a model).
	Payload int64
	Time    time.Duration

	pre   *state     // the layout before the step
	cross *crossData // the schedule of a cross-mesh step
	perm  []dimPerm  // the reorders of a StepPermute
}

// Plan is a redistribution from one layout to another: a list of steps.
// A Plan holds no rank-specific data, so one plan serves every rank; it is
// immutable.
type Plan struct {
	src, dst *layout
	steps    []Step
	cross    int // index of the direct step, -1 if none
}

// Steps returns the steps in order.
func (p *Plan) Steps() []Step { return slices.Clone(p.steps) }

// Collectives returns the communicating steps' ops in order.
func (p *Plan) Collectives() []comm.Op {
	var out []comm.Op
	for _, s := range p.steps {
		if s.Collective != 0 {
			out = append(out, s.Collective)
		}
	}
	return out
}

// Bytes is the total of the steps' Bytes. Planning checks that it fits
// in an int (a plan that would move more is an ErrInvalid error), so it
// never wraps.
func (p *Plan) Bytes() int64 {
	var n int64
	for _, s := range p.steps {
		n += s.Bytes
	}
	return n
}

// Time is the total of the steps' estimated times.
func (p *Plan) Time() time.Duration {
	var t time.Duration
	for _, s := range p.steps {
		t += s.Time
	}
	return t
}

// CrossMesh reports whether the plan moves the tensor to another mesh.
func (p *Plan) CrossMesh() bool { return !p.src.sameMesh(p.dst) }

// Source describes the layout the plan starts from.
func (p *Plan) Source() string { return p.src.String() }

// Destination describes the layout the plan ends in.
func (p *Plan) Destination() string { return p.dst.String() }

// String prints the plan, one step per line.
func (p *Plan) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "plan %s\n  -> %s", p.src, p.dst)
	if len(p.steps) == 0 {
		b.WriteString("\n  (no steps)")
	}
	for i, s := range p.steps {
		fmt.Fprintf(&b, "\n  %d. %s", i+1, s.String())
	}
	return b.String()
}

// String prints one step.
func (s Step) String() string {
	var b strings.Builder
	if s.Kind == StepDirect && s.Collective == 0 {
		fmt.Fprintf(&b, "%s(%d)  direct (local: nothing moves)", s.AxisName, s.AxisSize)
	} else if s.Kind == StepDirect {
		fmt.Fprintf(&b, "%s(%d)  %-24s", s.AxisName, s.AxisSize, s.Kind)
	} else {
		fmt.Fprintf(&b, "%s(%d)  %-24s %v->%v", s.AxisName, s.AxisSize, s.Kind, s.From, s.To)
	}
	if s.Reduce != 0 {
		fmt.Fprintf(&b, " op=%v", s.Reduce)
	}
	switch {
	case s.ToDim >= 0:
		fmt.Fprintf(&b, " dim %d->%d", s.Dim, s.ToDim)
	case s.Dim >= 0:
		fmt.Fprintf(&b, " dim %d", s.Dim)
	}
	if s.Collective != 0 {
		fmt.Fprintf(&b, "  %d B/rank", s.Bytes)
		if s.Time > 0 {
			fmt.Fprintf(&b, "  est %v", s.Time)
		}
	}
	return b.String()
}

// Planner plans redistributions and caches the plans by (source spec,
// destination spec). It is safe for concurrent use, and since plans hold no
// rank-specific data, one Planner may serve every rank of a process. The
// zero Planner is ready to use, with no cost model and no consistency check.
type Planner struct {
	model *comm.CostModel
	check bool

	mu    sync.Mutex
	cache map[string]*Plan
}

// PlannerOption configures NewPlanner.
type PlannerOption func(*Planner)

// WithCheckConsistency makes Redistribute and Execute compare the source and
// destination specs across the mesh (one small all-gather of fingerprints)
// before any tensor data moves, so ranks that disagree get ErrMismatch
// instead of a hang or wrong data. It costs one collective per call, an
// all-gather of 16 bytes per rank over the whole mesh: on comm/local the
// Redistribute of a [16 16] float32 tensor from Shard(0) to Replicate went
// from about 4.6 to 7.6 µs at p=2 and from 17 to 27 µs at p=4 (medians on
// a 2-core machine; BenchmarkRedistributeConsistency). It is off by
// default for that reason: a step of many small redistributes pays it on
// each.
func WithCheckConsistency() PlannerOption { return func(p *Planner) { p.check = true } }

// NewPlanner returns a planner that prices steps with model; a nil model
// means no time estimates.
func NewPlanner(model *comm.CostModel, opts ...PlannerOption) *Planner {
	p := &Planner{model: model, cache: map[string]*Plan{}}
	for _, o := range opts {
		o(p)
	}
	return p
}

// Plan returns the plan from src to dst, from the cache when it has one.
// Both specs must have the same global shape and dtype; if their meshes
// differ, they must cover the same world ranks of the same world.
func (p *Planner) Plan(src, dst *Spec) (*Plan, error) {
	if src == nil || dst == nil {
		return nil, invalidf("Plan", "nil spec")
	}
	if src.m.World() != dst.m.World() {
		return nil, invalidf("Plan", "the tensor's mesh %v and the destination mesh %v are built on different world communicators", src.m, dst.m)
	}
	return p.planLayouts(src.l, dst.l)
}

func (p *Planner) planLayouts(src, dst *layout) (*Plan, error) {
	key := src.key + "\x00" + dst.key
	if p != nil {
		p.mu.Lock()
		pl, ok := p.cache[key]
		p.mu.Unlock()
		if ok {
			return pl, nil
		}
	}
	var model *comm.CostModel
	if p != nil {
		model = p.model
	}
	pl, err := makePlan(src, dst, model)
	if err != nil {
		return nil, err
	}
	if p != nil {
		p.mu.Lock()
		if old, ok := p.cache[key]; ok {
			pl = old
		} else {
			if p.cache == nil { // the zero Planner is ready to use
				p.cache = map[string]*Plan{}
			}
			p.cache[key] = pl
		}
		p.mu.Unlock()
	}
	return pl, nil
}

// CacheLen returns the number of cached plans.
func (p *Planner) CacheLen() int {
	if p == nil {
		return 0
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.cache)
}

// makePlan plans src -> dst.
func makePlan(src, dst *layout, model *comm.CostModel) (*Plan, error) {
	const op = "Plan"
	if !slices.Equal(src.shape, dst.shape) {
		return nil, invalidf(op, "global shapes differ: source %v, destination %v", src.shape, dst.shape)
	}
	if src.dtype != dst.dtype {
		return nil, invalidf(op, "dtypes differ: source %v, destination %v", src.dtype, dst.dtype)
	}
	if src.hasRouted() || dst.hasRouted() {
		return nil, unsupportedf(op, "Routed placements (%v -> %v) are moved by the MoE dispatch and combine of the moe package, not by Redistribute", src.places, dst.places)
	}
	pl := &Plan{src: src, dst: dst, cross: -1}
	if (src.hasPerm() || dst.hasPerm()) && !src.sameMesh(dst) {
		return nil, unsupportedf(op, "a load-balanced layout (%v -> %v) changes mesh through a plain Shard or Replicate on its own mesh first", src.places, dst.places)
	}
	if !src.sameMesh(dst) {
		return planDirect(src, dst, model)
	}
	if !slices.Equal(src.permKs(), dst.permKs()) {
		return planPermute(src, dst, model)
	}
	steps, err := planAxes(newState(src), newState(dst), src, model)
	if err != nil {
		return nil, err
	}
	pl.steps = steps
	if err := pl.checkBytes(); err != nil {
		return nil, err
	}
	if len(pl.Collectives()) < 2 {
		return pl, nil
	}
	// Several collectives: a direct all-to-all-v over the whole mesh may
	// be better (misaligned nested shards).
	direct, err := planDirect(src, dst, model)
	if err != nil {
		return nil, err
	}
	if better(direct, pl, model) {
		return direct, nil
	}
	return pl, nil
}

// checkBytes reports an error naming the shape when the steps' Bytes sum
// past an int, so that Bytes and the comparison of plans never wrap.
func (p *Plan) checkBytes() error {
	var bytes []int
	for _, s := range p.steps {
		bytes = append(bytes, int(s.Bytes))
	}
	if _, ok := checked.Sum(bytes); !ok {
		return invalidf("Plan", "the plan for %v %v: its steps' byte counts sum past the largest int", p.src.shape, p.src.dtype)
	}
	return nil
}

// better reports whether plan a beats plan b: by estimated time with a
// cost model; without one, by fewer collectives moving no more bytes.
func better(a, b *Plan, model *comm.CostModel) bool {
	if model != nil {
		return a.Time() < b.Time()
	}
	return len(a.Collectives()) < len(b.Collectives()) && a.Bytes() <= b.Bytes()
}

// state is a layout during planning: placements and shard orders, with
// size-1 mesh axes removed from the orders (they change nothing).
type state struct {
	mshape []int
	places []Placement
	order  [][]int
}

func newState(l *layout) *state {
	s := &state{mshape: l.mshape, places: slices.Clone(l.places), order: make([][]int, len(l.order))}
	for d, o := range l.order {
		for _, a := range o {
			if l.mshape[a] > 1 {
				s.order[d] = append(s.order[d], a)
			}
		}
	}
	return s
}

func (s *state) clone() *state {
	c := &state{mshape: s.mshape, places: slices.Clone(s.places), order: make([][]int, len(s.order))}
	for d, o := range s.order {
		c.order[d] = slices.Clone(o)
	}
	return c
}

func (s *state) equal(o *state) bool {
	if !slices.Equal(s.places, o.places) {
		return false
	}
	for d := range s.order {
		if !slices.Equal(s.order[d], o.order[d]) {
			return false
		}
	}
	return true
}

// lcp is the length of the common prefix of a and b.
func lcp(a, b []int) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

// canAppend reports whether appending axis a to dim j's order moves toward
// the target order.
func canAppend(cur, want *state, a, j int) bool {
	c, w := cur.order[j], want.order[j]
	return len(c) < len(w) && slices.Equal(c, w[:len(c)]) && w[len(c)] == a
}

// removable returns the tensor dim whose order ends with axis a beyond the
// common prefix with the target (so a must stop sharding it), or -1.
func removable(cur, want *state, a int) int {
	p := cur.places[a]
	if !p.IsShard() {
		return -1
	}
	o := cur.order[p.dim]
	if len(o) == 0 || o[len(o)-1] != a {
		return -1
	}
	if lcp(o, want.order[p.dim]) >= len(o) {
		return -1
	}
	return p.dim
}

// planAxes is the greedy per-axis planner (see docs/design.md §3 and DTensor's
// greedy planner). Each round takes the first applicable move of:
//  1. local moves that reach the target on an axis: R->S chunk (when the
//     shard order allows it), R->P, and S->P(sum);
//  2. reductions of Partial axes, outer to inner, while the data is still
//     small: P->S reduce-scatter (when the order allows), P->R all-reduce;
//  3. removals, inner to outer, of shards that are not in the target
//     (or not at the same place in a dim's order): S->R all-gather, or
//     S(i)->S(j) all-to-all when the axis lands exactly where the target
//     wants it;
//  4. when nothing else applies, the innermost waiting removal gathers to
//     Replicate (it is re-chunked later): misaligned nested shards.
//
// Steps on size-1 axes are never emitted.
func planAxes(cur, want *state, l *layout, model *comm.CostModel) ([]Step, error) {
	n := len(cur.places)
	for a := range n {
		if cur.mshape[a] == 1 {
			cur.places[a] = want.places[a]
		}
	}
	var steps []Step
	limit := 4*n + 4
	for !cur.equal(want) {
		if len(steps) > limit {
			return nil, fmt.Errorf("placement: internal error: planning %v -> %v did not converge (steps so far %v)", l.places, want.places, steps)
		}
		st, ok := nextStep(cur, want)
		if !ok {
			return nil, fmt.Errorf("placement: internal error: no step from %v %v to %v %v", cur.places, cur.order, want.places, want.order)
		}
		st.pre = cur.clone()
		st.AxisName = l.names[st.Axis]
		st.AxisSize = cur.mshape[st.Axis]
		apply(cur, &st)
		if err := price(&st, l.shape, l.dtype, model); err != nil {
			return nil, err
		}
		steps = append(steps, st)
	}
	return steps, nil
}

func nextStep(cur, want *state) (Step, bool) {
	n := len(cur.places)
	mk := func(k StepKind, a int, to Placement) Step {
		return Step{Kind: k, Axis: a, From: cur.places[a], To: to, Dim: -1, ToDim: -1}
	}
	// 1. Local moves.
	for a := range n {
		c, w := cur.places[a], want.places[a]
		if c == w {
			continue
		}
		switch {
		case c.IsReplicate() && w.IsShard() && canAppend(cur, want, a, w.dim):
			s := mk(StepChunk, a, w)
			s.Dim = w.dim
			return s, true
		case c.IsReplicate() && w.IsPartial():
			return mk(StepToPartial, a, w), true
		case c.IsShard() && w.IsPartial() && w.op == comm.Sum && removable(cur, want, a) >= 0:
			s := mk(StepShardToPartial, a, w)
			s.Dim = c.dim
			return s, true
		}
	}
	// 2. Reductions, outer to inner.
	for a := range n {
		c, w := cur.places[a], want.places[a]
		if c == w || !c.IsPartial() {
			continue
		}
		switch {
		case w.IsShard():
			if canAppend(cur, want, a, w.dim) {
				s := mk(StepReduceScatter, a, w)
				s.Collective, s.Reduce, s.Dim = comm.OpReduceScatter, c.op, w.dim
				return s, true
			}
		default: // Replicate, or Partial with another op (via Replicate)
			s := mk(StepAllReduce, a, Replicate())
			s.Collective, s.Reduce = comm.OpAllReduce, c.op
			return s, true
		}
	}
	// 3. Removals, inner to outer.
	waiting := -1
	for a := n - 1; a >= 0; a-- {
		d := removable(cur, want, a)
		if d < 0 {
			continue
		}
		w := want.places[a]
		switch {
		case w.IsShard() && w.dim != d:
			if canAppend(cur, want, a, w.dim) {
				s := mk(StepAllToAll, a, w)
				s.Collective, s.Dim, s.ToDim = comm.OpAllToAll, d, w.dim
				return s, true
			}
			if waiting < 0 {
				waiting = a
			}
			continue
		default: // Replicate, Partial(not sum), or Shard(d) at another place
			s := mk(StepAllGather, a, Replicate())
			s.Collective, s.Dim = comm.OpAllGather, d
			return s, true
		}
	}
	// 4. Misaligned: gather the innermost waiting shard.
	if waiting >= 0 {
		s := mk(StepAllGather, waiting, Replicate())
		s.Collective, s.Dim = comm.OpAllGather, cur.places[waiting].dim
		return s, true
	}
	return Step{}, false
}

// apply moves the state through one step.
func apply(s *state, st *Step) {
	a := st.Axis
	switch st.Kind {
	case StepAllGather, StepShardToPartial:
		d := st.Dim
		s.order[d] = s.order[d][:len(s.order[d])-1]
	case StepAllToAll:
		s.order[st.Dim] = s.order[st.Dim][:len(s.order[st.Dim])-1]
		s.order[st.ToDim] = append(s.order[st.ToDim], a)
	case StepChunk, StepReduceScatter:
		s.order[st.Dim] = append(s.order[st.Dim], a)
	}
	s.places[a] = st.To
}

// price fills in Bytes, Payload and Time of a per-axis step from the state
// before it, looking at every rank of the mesh (ranks differ only with
// uneven shards). It also checks that the largest buffer the step
// allocates on any rank (padding included) fits in an int of bytes, so
// that stepExec's sizes need no checks: a count that overflows is an
// error naming the shape, on every rank alike, before any data moves.
func price(st *Step, shape []int, dt comm.DType, model *comm.CostModel) error {
	if st.Collective == 0 {
		return nil
	}
	es := dt.Size()
	pre := st.pre
	k := pre.mshape[st.Axis]
	total := prod(pre.mshape)
	overflow := false
	mul := func(v ...int) int {
		n, ok := checked.Product(v)
		overflow = overflow || !ok
		return n
	}
	var bytes, payload int
	for r := range total {
		coord := unravel(r, pre.mshape)
		_, sz := boxOf(shape, pre.mshape, pre.order, coord)
		local := prod(sz)
		// Elements this rank receives from others, its payload, and its
		// largest buffer.
		var recv, pay, buf int
		switch st.Kind {
		case StepAllReduce:
			pay, buf = local, local
			// The ring's 2(k-1)/k of local, exactly, without forming
			// 2(k-1)·local.
			var ok bool
			recv, ok = checked.Add(mul(2*(k-1), local/k), 2*(k-1)*(local%k)/k)
			overflow = overflow || !ok
		case StepAllGather:
			par := parentLen(shape, pre, st.Dim, coord)
			rest := restOf(sz, st.Dim)
			_, maxp := chunk(par, k, 0)
			pay = mul(par, rest)
			recv = pay - local
			buf = mul(k, maxp, rest)
		case StepReduceScatter:
			par := sz[st.Dim]
			rest := restOf(sz, st.Dim)
			_, mine := chunk(par, k, coord[st.Axis])
			_, maxp := chunk(par, k, 0)
			pay = mul(par, rest)
			recv = mul(k-1, mine, rest)
			buf = mul(k, maxp, rest)
		case StepAllToAll:
			i, j := st.Dim, st.ToDim
			parI := parentLen(shape, pre, i, coord)
			_, mineJ := chunk(sz[j], k, coord[st.Axis])
			rest := restOf2(sz, i, j)
			pay = local
			recv = mul(parI-sz[i], mineJ, rest)
			buf = max(local, mul(parI, mineJ, rest))
		}
		bytes = max(bytes, mul(recv, es))
		payload = max(payload, mul(pay, es))
		mul(buf, es)
	}
	if overflow {
		return invalidf("Plan", "step %s of %v %v: its byte count overflows int", st.Kind, shape, dt)
	}
	st.Bytes, st.Payload = int64(bytes), int64(payload)
	if model != nil {
		st.Time = model.Estimate(st.Collective, k, st.Payload)
	}
	return nil
}

// parentLen is the length along dim d of the block this rank holds with
// the innermost axis sharding d removed.
func parentLen(shape []int, s *state, d int, coord []int) int {
	n := shape[d]
	o := s.order[d]
	for _, a := range o[:len(o)-1] {
		_, n = chunk(n, s.mshape[a], coord[a])
	}
	return n
}

// restOf is the product of every dim but d (a sub-product of a block's
// size, which fits).
func restOf(sz []int, d int) int {
	r := 1
	for i, v := range sz {
		if i != d {
			r *= v
		}
	}
	return r
}

// restOf2 is the product of every dim but i and j.
func restOf2(sz []int, i, j int) int {
	r := 1
	for x, v := range sz {
		if x != i && x != j {
			r *= v
		}
	}
	return r
}
