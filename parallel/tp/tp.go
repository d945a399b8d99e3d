package tp

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/parallel/internal/tree"
	"github.com/b7ea7098/loom/placement"
)

// Style is a placement plan for one module on one mesh axis: how its
// parameters are laid out and which layouts its inputs and outputs are
// redistributed to. Apply reshards the parameters (a local slice: every
// rank holds the replicated value) and installs Boundary hooks; it runs
// before training starts, before ddp.New or fsdp wraps the model (they
// take the parameters' layouts as they find them). Resharding lays a
// parameter out anew in place (autograd.Value.Relayout), so a parameter
// list collected before Apply, for an optimizer say, still holds the
// model's parameters.
type Style interface {
	Apply(ctx context.Context, m parallel.Module, axis string) error
}

// Rule applies Style to every module whose path matches Pattern: dotted
// segments, each a literal or "*" (any one segment), e.g. "h.*.attn.qkv".
type Rule struct {
	Pattern string
	Style   Style
}

// Plan is an ordered list of rules, in the spirit of PyTorch's
// parallelize_module plan. Rules apply in order; a module may match several.
type Plan []Rule

// Parallelize applies plan to root's module tree on the named mesh axis.
// Every rank calls it with the same plan. A rule that matches no module is
// an error (a misspelt path would otherwise silently leave a layer
// replicated), and so is a style that does not fit the module it matches.
//
// The plan is checked first, before any module changes: every rule has a
// style and matches some module, and the axis is one of the parameters'
// mesh. A module reachable at several paths gets each rule's style once. A
// parameter leaf shared by several modules (tied weights) stays one leaf
// when every style that reshards it lays it out the same way; laying it out
// two ways, or resharding it in one module while another keeps the
// replicated leaf, is an error. An error from a style (a module that does
// not fit it) leaves the earlier rules applied: rebuild the model rather
// than reuse it.
//
// Parameters keep their identity: a resharded parameter is the same
// *autograd.Value, laid out anew (autograd.Value.Relayout), so a
// parameter list collected before Parallelize (parallel.Params, for an
// optimizer)
// works as one collected after.
func Parallelize(ctx context.Context, root parallel.Module, axis string, plan Plan) error {
	type match struct {
		path string
		m    parallel.Module
	}
	var mods []match
	if err := parallel.Walk(root, func(p string, m parallel.Module) error {
		mods = append(mods, match{p, m})
		return nil
	}); err != nil {
		return err
	}
	params, err := parallel.Params(root)
	if err != nil {
		return err
	}
	if len(params) > 0 && params[0].Spec() != nil {
		if _, err := axisIndex(params[0].Spec(), axis); err != nil {
			return err
		}
	}
	matches := make([][]match, len(plan))
	for k, r := range plan {
		if r.Style == nil {
			return fmt.Errorf("%w: Parallelize: rule %q has no style", ErrInvalid, r.Pattern)
		}
		pat := strings.Split(r.Pattern, ".")
		seen := map[parallel.Module]bool{}
		for _, mm := range mods {
			if !tree.MatchPath(pat, mm.path) {
				continue
			}
			if tree.Comparable(mm.m) {
				if seen[mm.m] {
					continue // the same module at another path
				}
				seen[mm.m] = true
			}
			if mm.m.Boundary() == nil {
				return fmt.Errorf("%w: Parallelize: module %q (%T) has no Boundary hooks", ErrInvalid, mm.path, mm.m)
			}
			matches[k] = append(matches[k], mm)
		}
		if len(matches[k]) == 0 {
			return fmt.Errorf("%w: Parallelize: rule %q matches no module", ErrInvalid, r.Pattern)
		}
	}
	cache := &reshardCache{new: map[*autograd.Value]*reshardEntry{}}
	ctx = context.WithValue(ctx, reshardCacheKey{}, cache)
	for k, r := range plan {
		for _, mm := range matches[k] {
			cache.cur = reshardBy(mm)
			if err := r.Style.Apply(ctx, mm.m, axis); err != nil {
				return styleError(err, mm.path, axis)
			}
		}
	}
	// A tied parameter resharded by one module's style must be resharded
	// by the style of every module that holds it: another module's
	// computation and hooks expect it replicated.
	if len(cache.new) == 0 {
		return nil
	}
	return parallel.Walk(root, func(path string, m parallel.Module) error {
		h, ok := m.(parallel.ParamHolder)
		if !ok {
			return nil
		}
		for _, p := range h.OwnParams() {
			if e, ok := cache.new[p]; ok && !slices.ContainsFunc(e.by, func(b reshardBy) bool { return b.is(path, m) }) {
				return fmt.Errorf("%w: Parallelize: parameter %q is shared with module %q, which the plan leaves replicated on axis %q while another module lays it out %v; tied parameters must be laid out alike in every module that holds them", ErrInvalid, p.Name(), path, axis, e.pl)
			}
		}
		return nil
	})
}

// styleError adds the module and axis to a style's error. An error that
// already says "tp: " (this package's styles wrap ErrInvalid) gets them at
// the end, so the prefix stays once and in front; any other error (a
// user's Style, another package's) gets "tp: Parallelize" in front.
func styleError(err error, path, axis string) error {
	if strings.HasPrefix(err.Error(), "tp: ") {
		return fmt.Errorf("%w (Parallelize: module %q, axis %q)", err, path, axis)
	}
	return fmt.Errorf("tp: Parallelize %q on axis %q: %w", path, axis, err)
}

// reshardCache records, during one Parallelize call, every parameter leaf
// a style resharded, how and by which modules, so that a leaf shared by
// several modules (tied weights) is laid out once and alike.
type reshardCache struct {
	new map[*autograd.Value]*reshardEntry
	cur reshardBy // the module whose style is being applied
}

type reshardEntry struct {
	from  []int // the global shape before resharding
	axis  string
	shape []int
	pl    placement.Placement
	by    []reshardBy // the modules whose styles resharded it
}

// reshardBy is a module a style was applied to: compared by identity where
// it can be, else by path.
type reshardBy struct {
	path string
	m    parallel.Module
}

func (b reshardBy) is(path string, m parallel.Module) bool {
	if tree.Comparable(b.m) && tree.Comparable(m) {
		return b.m == m
	}
	return b.path == path
}

type reshardCacheKey struct{}

// ColwiseParallel shards a Linear's output features over the axis: the
// weight [out, in] becomes Shard(0) and the bias Shard(0); for a fused
// Linear (Chunks > 1) each block is sharded (weight [C, out/C, in]
// Shard(1)). The input is redistributed to Replicate on the axis (with
// sequence parallelism that is the all-gather; otherwise a no-op whose
// backward all-reduces the input gradient). The output is Shard(last),
// or Output if set.
type ColwiseParallel struct {
	Output placement.Placement // zero value: keep Shard(last)
}

// Apply implements Style.
func (s ColwiseParallel) Apply(ctx context.Context, m parallel.Module, axis string) error {
	l, ok := m.(*parallel.Linear)
	if !ok {
		return fmt.Errorf("%w: ColwiseParallel applies to *Linear, not %T", ErrInvalid, m)
	}
	w, err := paramShape("weight", l.Weight, 2)
	if err != nil {
		return err
	}
	out, in := w[0], w[1]
	if c := max(l.Chunks, 1); c > 1 {
		if out%c != 0 {
			return fmt.Errorf("%w: ColwiseParallel: %d output features in %d chunks", ErrInvalid, out, c)
		}
		if l.Weight, err = reshard(ctx, l.Weight, axis, []int{c, out / c, in}, placement.Shard(1)); err != nil {
			return err
		}
		if l.Bias != nil {
			if l.Bias, err = reshard(ctx, l.Bias, axis, []int{c, out / c}, placement.Shard(1)); err != nil {
				return err
			}
		}
	} else {
		if l.Weight, err = reshard(ctx, l.Weight, axis, nil, placement.Shard(0)); err != nil {
			return err
		}
		if l.Bias != nil {
			if l.Bias, err = reshard(ctx, l.Bias, axis, nil, placement.Shard(0)); err != nil {
				return err
			}
		}
	}
	l.OnInput(ToLayout(axis, placement.Replicate()))
	if s.Output != (placement.Placement{}) {
		l.OnOutput(ToLayout(axis, s.Output))
	}
	return nil
}

// RowwiseParallel shards a Linear's input features over the axis (weight
// Shard(1), bias Replicate and added once), so its output is Partial(sum)
// there and is redistributed to Output (default Replicate: an all-reduce;
// Shard(1) with sequence parallelism: a reduce-scatter). The input is
// redistributed to Shard(last) first (a no-op after a ColwiseParallel
// layer). On an Embedding it is vocab parallelism: the table [V, D] becomes
// Shard(0), each rank looks up the ids in its rows, and the Partial(sum)
// result is redistributed to Output.
type RowwiseParallel struct {
	Output placement.Placement // zero value: Replicate
}

// Apply implements Style.
func (s RowwiseParallel) Apply(ctx context.Context, m parallel.Module, axis string) error {
	out := s.Output
	if out == (placement.Placement{}) {
		out = placement.Replicate()
	}
	switch l := m.(type) {
	case *parallel.Linear:
		if _, err := paramShape("weight", l.Weight, 2); err != nil {
			return err
		}
		if max(l.Chunks, 1) > 1 {
			return fmt.Errorf("%w: RowwiseParallel on a fused Linear (%d chunks)", ErrInvalid, l.Chunks)
		}
		var err error
		if l.Weight, err = reshard(ctx, l.Weight, axis, nil, placement.Shard(1)); err != nil {
			return err
		}
		l.OnInput(toLastShard(axis))
	case *parallel.Embedding:
		if _, err := paramShape("table", l.Table, 2); err != nil {
			return err
		}
		var err error
		if l.Table, err = reshard(ctx, l.Table, axis, nil, placement.Shard(0)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("%w: RowwiseParallel applies to *Linear or *Embedding, not %T", ErrInvalid, m)
	}
	m.Boundary().OnOutput(ToLayout(axis, out))
	return nil
}

// SequenceParallel runs a module on activations sharded over the axis on
// the sequence dim: its input is redistributed to Layout (default
// Shard(1), for [B, T, D] activations) and its parameters stay Replicate.
// Their gradients come out Partial(sum) on the axis, since each rank saw
// only its part of the sequence: ReduceGrads sums them after backward.
type SequenceParallel struct {
	Layout placement.Placement // zero value: Shard(1)
}

// Apply implements Style.
func (s SequenceParallel) Apply(_ context.Context, m parallel.Module, axis string) error {
	if _, ok := m.(*parallel.Embedding); ok {
		return fmt.Errorf("%w: SequenceParallel on an Embedding, whose ids take no input hooks; shard its output with RowwiseParallel{Output: ...} or PrepareModuleOutput", ErrInvalid)
	}
	p := s.Layout
	if p == (placement.Placement{}) {
		p = placement.Shard(1)
	}
	m.Boundary().OnInput(ToLayout(axis, p))
	return nil
}

// PrepareModuleInput redistributes a module's inputs to Layout on the
// axis (PyTorch's PrepareModuleInput with one desired layout), e.g.
// Replicate before a tensor-parallel region entered from sequence-sharded
// activations.
type PrepareModuleInput struct{ Layout placement.Placement }

// Apply implements Style.
func (s PrepareModuleInput) Apply(_ context.Context, m parallel.Module, axis string) error {
	if s.Layout == (placement.Placement{}) {
		return fmt.Errorf("%w: PrepareModuleInput without a layout", ErrInvalid)
	}
	if _, ok := m.(*parallel.Embedding); ok {
		return fmt.Errorf("%w: PrepareModuleInput on an Embedding, whose ids take no input hooks", ErrInvalid)
	}
	m.Boundary().OnInput(ToLayout(axis, s.Layout))
	return nil
}

// PrepareModuleOutput redistributes a module's outputs to Layout on the
// axis (PyTorch's PrepareModuleOutput with one desired layout).
type PrepareModuleOutput struct{ Layout placement.Placement }

// Apply implements Style.
func (s PrepareModuleOutput) Apply(_ context.Context, m parallel.Module, axis string) error {
	if s.Layout == (placement.Placement{}) {
		return fmt.Errorf("%w: PrepareModuleOutput without a layout", ErrInvalid)
	}
	m.Boundary().OnOutput(ToLayout(axis, s.Layout))
	return nil
}

// ToLayout returns a Hook that redistributes a value so that it is laid out
// p on the named mesh axis, keeping its other axes. It always records a
// Redistribute, even when the layout already matches, because the backward
// may still need a collective (a Partial(sum) gradient arriving at a
// Replicate input is all-reduced there).
func ToLayout(axis string, p placement.Placement) parallel.Hook {
	return func(ctx context.Context, v *autograd.Value) (*autograd.Value, error) {
		if v == nil {
			return nil, fmt.Errorf("%w: redistribute on %q: nil input", ErrInvalid, axis)
		}
		spec := v.Spec()
		i, err := axisIndex(spec, axis)
		if err != nil {
			return nil, err
		}
		places := spec.Placements()
		places[i] = p
		dst, err := spec.With(places, orders(spec, places)...)
		if err != nil {
			return nil, fmt.Errorf("tp: redistribute %v to %v on %q: %w", spec, p, axis, err)
		}
		return autograd.Redistribute(ctx, v, dst)
	}
}

// toLastShard is ToLayout(axis, Shard(last dim of the value)).
func toLastShard(axis string) parallel.Hook {
	return func(ctx context.Context, v *autograd.Value) (*autograd.Value, error) {
		if v == nil {
			return nil, fmt.Errorf("%w: redistribute on %q: nil input", ErrInvalid, axis)
		}
		return ToLayout(axis, placement.Shard(len(v.Spec().Shape())-1))(ctx, v)
	}
}

// orders keeps the shard orders of spec's dims that stay sharded by more
// than one axis under places.
func orders(spec *placement.Spec, places []placement.Placement) []placement.SpecOption {
	var opts []placement.SpecOption
	for d := range spec.Shape() {
		o := spec.Order(d)
		if len(o) < 2 {
			continue
		}
		var keep []string
		names := spec.Mesh().Names()
		for _, a := range o {
			if i := slices.Index(names, a); i >= 0 && places[i].Dim() == d {
				keep = append(keep, a)
			}
		}
		if len(keep) > 1 {
			opts = append(opts, placement.WithOrder(d, keep...))
		}
	}
	return opts
}

func axisIndex(spec *placement.Spec, axis string) (int, error) {
	i := slices.Index(spec.Mesh().Names(), axis)
	if i < 0 {
		return 0, fmt.Errorf("%w: mesh %v has no axis %q", ErrInvalid, spec.Mesh(), axis)
	}
	return i, nil
}

// paramShape checks that p is present with dims dims and returns its
// global shape.
func paramShape(what string, p *autograd.Value, dims int) ([]int, error) {
	if p == nil {
		return nil, fmt.Errorf("%w: no %s", ErrInvalid, what)
	}
	sh := p.Spec().Shape()
	if len(sh) != dims {
		return nil, fmt.Errorf("%w: %s %q has shape %v; want %d dims", ErrInvalid, what, p.Name(), sh, dims)
	}
	return sh, nil
}

// reshard lays parameter p out pl on axis, in place (autograd's
// Relayout: p stays the parameter, so lists that hold it stay valid), with
// global shape shape (nil: unchanged; a new shape must have p's elements in
// the same row-major order, and p must then be Replicate on every axis),
// and returns p. p must be Replicate on axis and carry no gradient yet.
// Inside Parallelize, a leaf already resharded by another module (a tied
// parameter) is left as it is when the layout agrees, and is an error
// when it does not.
func reshard(ctx context.Context, p *autograd.Value, axis string, shape []int, pl placement.Placement) (*autograd.Value, error) {
	cache, _ := ctx.Value(reshardCacheKey{}).(*reshardCache)
	if cache != nil {
		// The module that resharded it already, by a second rule, gets
		// the plain "already laid out" error below.
		if e, ok := cache.new[p]; ok && !slices.ContainsFunc(e.by, func(b reshardBy) bool { return b.is(cache.cur.path, cache.cur.m) }) {
			want := shape
			if want == nil {
				want = e.from
			}
			if e.axis == axis && e.pl == pl && slices.Equal(e.shape, want) {
				e.by = append(e.by, cache.cur)
				return p, nil // a tied parameter, already laid out
			}
			return nil, fmt.Errorf("%w: tied parameter %q is laid out as %v %v on axis %q by module %q and as %v %v by another", ErrInvalid, p.Name(), e.shape, e.pl, e.axis, e.by[0].path, want, pl)
		}
	}
	if !p.IsLeaf() || !p.RequiresGrad() {
		return nil, fmt.Errorf("%w: %q is not a parameter", ErrInvalid, p.Name())
	}
	if p.Grad() != nil {
		return nil, fmt.Errorf("%w: %q already has a gradient; parallelize before training", ErrInvalid, p.Name())
	}
	spec := p.Spec()
	i, err := axisIndex(spec, axis)
	if err != nil {
		return nil, err
	}
	places := spec.Placements()
	if !places[i].IsReplicate() {
		return nil, fmt.Errorf("%w: %q is already %v on axis %q", ErrInvalid, p.Name(), places[i], axis)
	}
	data := p.Data()
	if shape != nil && !slices.Equal(shape, spec.Shape()) {
		for a, q := range places {
			if !q.IsReplicate() {
				return nil, fmt.Errorf("%w: reshaping %q from %v to %v needs it Replicate, but it is %v on axis %d", ErrInvalid, p.Name(), spec.Shape(), shape, q, a)
			}
		}
		rs, err := placement.NewSpec(spec.Mesh(), shape, spec.DType(), places)
		if err != nil {
			return nil, fmt.Errorf("reshaping %q: %w", p.Name(), err)
		}
		if data, err = reshaped(rs, data); err != nil {
			return nil, fmt.Errorf("reshaping %q: %w", p.Name(), err)
		}
		spec = rs
	}
	places[i] = pl
	dst, err := spec.With(places, orders(spec, places)...)
	if err != nil {
		return nil, fmt.Errorf("laying out %q: %w", p.Name(), err)
	}
	dt, err := p.Tape().Planner().Redistribute(ctx, data, dst)
	if err != nil {
		return nil, fmt.Errorf("laying out %q: %w", p.Name(), err)
	}
	from := p.Spec().Shape()
	old := p.Data()
	if err := p.Relayout(dt); err != nil {
		return nil, errors.Join(fmt.Errorf("laying out %q: %w", p.Name(), err), blocks.FreeLocal(dt))
	}
	// On a device nothing else frees the replaced block (Redistribute's
	// result never shares its memory): the whole replicated weight would
	// stay allocated beside the shard.
	if err := blocks.FreeLocal(old); err != nil {
		return nil, fmt.Errorf("laying out %q: freeing the replaced block: %w", p.Name(), err)
	}
	if cache != nil {
		cache.new[p] = &reshardEntry{from: from, axis: axis, shape: dst.Shape(), pl: pl, by: []reshardBy{cache.cur}}
	}
	return p, nil
}

// reshaped returns dt's local block viewed with spec rs (same elements in
// the same row-major order): a copy of a host block, the same buffer for a
// block on a device (the caller's Redistribute copies it, and the block
// is freed once, as the parameter's old data).
func reshaped(rs *placement.Spec, dt *placement.DTensor) (*placement.DTensor, error) {
	switch s := dt.LocalData().(type) {
	case []float32:
		return placement.NewLocal(rs, slices.Clone(s))
	case []float64:
		return placement.NewLocal(rs, slices.Clone(s))
	case device.Buffer:
		return placement.NewLocalOn(rs, s)
	}
	return nil, fmt.Errorf("%w: local block of type %T", ErrInvalid, dt.LocalData())
}

// ReduceGrads makes every gradient laid out like its parameter: a gradient
// that is Partial(sum) on an axis where the parameter is Replicate (a
// norm's weight under sequence parallelism, a replicated weight whose
// input was sharded) is summed over that axis. Run it after backward (and
// after ddp.DDP.Finish, which handles the dp axis with overlap), on every rank
// with the same parameters in the same order. Parameters without a
// gradient, or whose gradient already matches, are skipped without
// communication. Every gradient is checked before any is communicated.
// The sums are made in place, in the gradient's own memory: a DTensor
// given to SetGrad and still used elsewhere changes with it.
func ReduceGrads(ctx context.Context, params []*autograd.Value) error {
	var todo []*autograd.Value
	for _, p := range params {
		g := p.Grad() // nil for a nil parameter: skipped
		if g == nil || g.Spec().Equal(p.Spec()) {
			continue
		}
		gp := g.Spec().Placements()
		pp := p.Spec().Placements()
		for a := range gp {
			if gp[a].IsPartial() && (gp[a].Op() != comm.Sum || !pp[a].IsReplicate()) {
				return fmt.Errorf("%w: ReduceGrads: gradient of %q is %v on axis %d where the parameter is %v", ErrInvalid, p.Name(), gp[a], a, pp[a])
			}
		}
		todo = append(todo, p)
	}
	for _, p := range todo {
		// In place: the gradient's memory is the parameter's own (or its
		// DDP bucket's), so the reduction allocates nothing.
		r, err := p.Tape().Planner().Redistribute(ctx, p.Grad(), p.Spec(), placement.WithReuseInput())
		if err != nil {
			return fmt.Errorf("tp: ReduceGrads %q: %w", p.Name(), err)
		}
		if err := p.SetGrad(r); err != nil {
			return fmt.Errorf("tp: ReduceGrads %q: %w", p.Name(), err)
		}
	}
	return nil
}
