package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Block is one rank's local block of a tensor: its shape and its elements
// in row-major order (len(Data) is the product of Shape, 1 for a scalar).
type Block[T float32 | float64] struct {
	Shape []int
	Data  []T
}

// LocalFunc is loom's local escape hatch (docs/design.md §4): a computation on
// this rank's local blocks, wrapped as an op with declared input, output
// and gradient placements. It is PyTorch's local_map with two differences:
// inputs are checked against their declared placements, never
// redistributed, and gradient placements have no defaults. A gradient
// placement says what the local block the user's Backward returns means
// globally, and only the author of the function knows it: the gradient of
// a replicated weight computed from this rank's rows of a batch is a
// Partial(sum) contribution, while the same code on replicated rows gives
// the whole gradient (Replicate). Guessing wrong either drops the other
// ranks' contributions or counts a contribution once per rank, which is
// where other frameworks silently double-count gradients.
//
// Placements are given per input (one per mesh axis) and are validated by
// Apply before any user code runs:
//
//   - In[i] must equal input i's placements exactly (its shard order, set
//     with placement.WithOrder, is accepted as it is and kept for its
//     gradient). A mismatch is ErrRule: redistribute explicitly first.
//   - GradIn[i] is required for every input, whether or not it requires
//     grad at this call, so the function means the same thing for
//     parameters and constants. On a mesh axis where the input is
//     Shard(d) the gradient must be Shard(d) (the local gradient block has
//     the input block's shape); where the input is Replicate or
//     Partial(sum|avg) it must be Replicate (this rank's block is the
//     whole gradient, the same on every rank) or Partial(sum) (this rank's
//     block is a contribution; the blocks sum to the gradient).
//   - Out and GradOut follow the same pairing: GradOut is Shard(d) where
//     Out is Shard(d), and Replicate or Partial(sum) elsewhere.
//   - Routed and Partial(max|min) are rejected everywhere: their local
//     blocks have no static shape or no linear gradient.
//
// In backward, the output's gradient arrives in whatever placements the
// downstream ops produced. If they differ from GradOut it is moved to
// GradOut only when that needs no collective (Replicate -> Partial(sum)
// keeps the value on one rank and zeroes the rest; Replicate -> Shard
// takes the local chunk); otherwise backward fails with ErrGradPlacement
// naming both, since autograd inserts no communication. In particular a
// Partial(sum) gradient never reaches a Backward that declared it wants
// Replicate: redistribute the result (autograd.Redistribute) to make the
// all-reduce explicit.
//
// The output's global shape is OutShape, or input 0's global shape when
// OutShape is nil. Its dtype is the inputs' (all inputs share one, which
// must be T's), and it uses mesh-axis shard order.
//
// Forward and Backward get the local blocks of the inputs (and of the
// output and its gradient) as host slices. Inputs on a device other than
// the host are copied to the host first and the result is copied back to
// their device (autograd.To, whose backward copies the gradients the same
// way), so the functions see host copies of the device blocks and each
// Apply and its backward wait for the device's work. They must not modify
// the blocks, and must not keep the output's gradient block after
// Backward returns (the tape may reuse its memory). The blocks they return are owned by autograd afterwards.
// Each returned block's Shape must equal the local shape its declared spec
// implies on this rank (shards may be empty) and its Data must have that
// many elements; anything else is ErrInvalid naming the function and the
// input. Errors returned by Forward or Backward are wrapped with the
// function's name (errors.Is still finds them). Neither may communicate:
// Forward runs at Apply time on each rank independently, and any
// collective belongs outside, in an explicit Redistribute.
type LocalFunc[T float32 | float64] struct {
	// Name names the op on the tape and in errors. Required.
	Name string
	// In holds, per input, the placements it must have (one per mesh axis).
	In [][]placement.Placement
	// GradIn holds, per input, the placements of its gradient, as returned
	// by Backward. Required for every input: there is no default.
	GradIn [][]placement.Placement
	// Out is the output's placements.
	Out []placement.Placement
	// OutShape is the output's global shape; nil means input 0's.
	OutShape []int
	// GradOut is the placement the output's gradient must be in when it
	// reaches Backward. Required: there is no default.
	GradOut []placement.Placement
	// Forward computes the output's local block from the inputs' blocks.
	Forward func(in []Block[T]) (Block[T], error)
	// Backward returns one gradient block per input, laid out by GradIn,
	// from the output's gradient block (laid out by GradOut), the inputs'
	// blocks and the output's block. Blocks for inputs that do not require
	// grad are ignored (return a zero Block). Required when the op is
	// recorded (some input requires grad and recording is on).
	Backward func(gradOut Block[T], in []Block[T], out Block[T]) ([]Block[T], error)
}

// applyOn is Apply for inputs on device d: the functions take host
// slices, so the inputs are copied to the host with To, Apply runs
// there, and its result is copied back to d with To; To's backward
// carries the gradients across the same way.
func (f LocalFunc[T]) applyOn(d device.Device, inputs []*Value) (*Value, error) {
	hosts := make([]*Value, len(inputs))
	for i, v := range inputs {
		h, err := To(v, device.Host())
		if err != nil {
			return nil, fmt.Errorf("autograd: %s: copying input %d (%q) from %s to the host: %w", f.op(), i, v.name, d.Name(), err)
		}
		hosts[i] = h
	}
	out, err := f.Apply(hosts...)
	if err != nil {
		return nil, err
	}
	res, err := To(out, d)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: copying the result to %s: %w", f.op(), d.Name(), err)
	}
	return res, nil
}

// op is the name of the op on the tape and in errors.
func (f *LocalFunc[T]) op() string { return fmt.Sprintf("LocalMap(%q)", f.Name) }

// dtype is the comm dtype of T.
func (f *LocalFunc[T]) dtype() comm.DType {
	var z T
	if _, ok := any(z).(float32); ok {
		return comm.Float32
	}
	return comm.Float64
}

// Apply validates the declarations against the inputs, runs Forward on this
// rank's local blocks and returns the result laid out by Out (and
// OutShape). When some input requires grad and recording is on it records
// a node whose backward runs Backward (see LocalFunc for how the output's
// gradient is brought to GradOut). Apply never communicates; like every op
// it must be called on every rank in the same order. Errors wrap
// ErrInvalid (counts, nil values, meshes, dtypes, shapes, missing
// declarations, block shapes) or ErrRule (placements), and name the
// function and the input.
func (f LocalFunc[T]) Apply(inputs ...*Value) (*Value, error) {
	op := f.op()
	if f.Name == "" {
		return nil, invalidf("LocalMap", "the function has no Name; errors and the tape name ops by it")
	}
	if f.Forward == nil {
		return nil, invalidf(op, "nil Forward")
	}
	if len(inputs) == 0 {
		return nil, invalidf(op, "no inputs; a local function needs at least one to know its mesh")
	}
	if len(f.In) != len(inputs) {
		return nil, invalidf(op, "called with %d inputs, In declares %d", len(inputs), len(f.In))
	}
	if len(f.GradIn) != len(inputs) {
		return nil, invalidf(op, "called with %d inputs, GradIn declares %d: every input needs a declared gradient placement (there is no default)", len(inputs), len(f.GradIn))
	}
	t, err := checkInputsOn(op, true, inputs...)
	if err != nil {
		return nil, err
	}
	if d, ok := onDevice(inputs[0].data); ok {
		return f.applyOn(d, inputs)
	}
	first := inputs[0].Spec()
	names := first.Mesh().Names()
	want := f.dtype()
	inSpecs := make([]*placement.Spec, len(inputs))
	gradSpecs := make([]*placement.Spec, len(inputs))
	for i, v := range inputs {
		s := v.Spec()
		what := fmt.Sprintf("input %d (%q)", i, v.name)
		if err := sameMeshes(op+" "+what, first, s); err != nil {
			return nil, err
		}
		if s.DType() != want {
			return nil, invalidf(op, "%s is %v; this LocalFunc works on %v blocks", what, s.DType(), want)
		}
		if err := checkPlacements(op, what, "In", f.In[i], len(names)); err != nil {
			return nil, err
		}
		if got := s.Placements(); !slices.Equal(got, f.In[i]) {
			return nil, rulef(op, "%s is %v, In declares %v; local functions check their inputs and never redistribute them: use autograd.Redistribute first", what, got, f.In[i])
		}
		if len(f.GradIn[i]) == 0 {
			return nil, invalidf(op, "%s has no declared gradient placement (GradIn[%d] is empty); there is no default: say whether this rank's gradient block is the whole gradient (Replicate), a contribution to sum (Partial(sum)) or its shard (Shard)", what, i)
		}
		if err := checkPlacements(op, what, "GradIn", f.GradIn[i], len(names)); err != nil {
			return nil, err
		}
		if err := pairGrad(op, what, names, f.In[i], f.GradIn[i]); err != nil {
			return nil, err
		}
		inSpecs[i] = s
		if gradSpecs[i], err = specWith(s, s.Shape(), f.GradIn[i], ordersOf(s)); err != nil {
			return nil, fmt.Errorf("autograd: %s: GradIn of %s: %w", op, what, err)
		}
	}
	if err := checkPlacements(op, "the output", "Out", f.Out, len(names)); err != nil {
		return nil, err
	}
	if len(f.GradOut) == 0 {
		return nil, invalidf(op, "the output has no declared gradient placement (GradOut is empty); there is no default: say which placement Backward expects the output's gradient in")
	}
	if err := checkPlacements(op, "the output", "GradOut", f.GradOut, len(names)); err != nil {
		return nil, err
	}
	if err := pairGrad(op, "the output", names, f.Out, f.GradOut); err != nil {
		return nil, err
	}
	shape := f.OutShape
	if shape == nil {
		shape = first.Shape()
	}
	outSpec, err := placement.NewSpec(first.Mesh(), shape, want, f.Out)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: the output (shape %v, Out %v): %w", op, shape, f.Out, err)
	}
	gradOutSpec, err := outSpec.With(f.GradOut)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: GradOut %v: %w", op, f.GradOut, err)
	}
	recorded := t.recording() && slices.ContainsFunc(inputs, (*Value).RequiresGrad)
	if recorded && f.Backward == nil {
		return nil, invalidf(op, "nil Backward, but an input requires grad; run it under NoGrad or give a Backward")
	}

	blocks := make([]Block[T], len(inputs))
	for i, v := range inputs {
		if blocks[i], err = blockOf[T](v.data); err != nil {
			return nil, fmt.Errorf("autograd: %s: input %d: %w", op, i, err)
		}
	}
	outBlock, err := f.Forward(blocks)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: forward: %w", op, err)
	}
	out, err := wrapBlock(op, "forward", "the output", outSpec, outBlock)
	if err != nil {
		return nil, err
	}
	if !recorded {
		return t.record(op, out, inputs, nil), nil
	}
	needs := make([]bool, len(inputs))
	for i, v := range inputs {
		needs[i] = v.requiresGrad
	}
	back := f.Backward
	return t.record(op, out, inputs, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		gs := g.Spec()
		if !slices.Equal(gs.Shape(), outSpec.Shape()) || gs.DType() != outSpec.DType() {
			return nil, invalidf(op, "the output's gradient %v does not match the output %v in shape or dtype", gs, outSpec)
		}
		if !gs.Equal(gradOutSpec) {
			moved, ops, err := t.moveLocal(ctx, g, gradOutSpec)
			if err != nil {
				return nil, err
			}
			if moved == nil {
				return nil, gradPlacementf(op, "the output's gradient arrives as %v but GradOut declares %v; bringing it there needs %v, and autograd inserts no communication: redistribute the result explicitly (autograd.Redistribute) so its gradient arrives as declared, or declare the placement it arrives in if Backward handles it", gs.Placements(), f.GradOut, ops)
			}
			g = moved
		}
		gb, err := blockOf[T](g)
		if err != nil {
			return nil, fmt.Errorf("autograd: %s: the output's gradient: %w", op, err)
		}
		grads, err := back(gb, blocks, outBlock)
		if err != nil {
			return nil, fmt.Errorf("autograd: %s: backward: %w", op, err)
		}
		if len(grads) != len(inputs) {
			return nil, invalidf(op, "Backward returned %d gradient blocks for %d inputs", len(grads), len(inputs))
		}
		res := make([]*placement.DTensor, len(inputs))
		for i, gi := range grads {
			if !needs[i] {
				continue
			}
			what := fmt.Sprintf("the gradient of input %d (%q)", i, inputs[i].name)
			if res[i], err = wrapBlock(op, "backward", what, gradSpecs[i], gi); err != nil {
				return nil, err
			}
		}
		return res, nil
	}), nil
}

// checkPlacements validates one declaration: one placement per mesh axis,
// none Routed or Partial(max|min).
func checkPlacements(op, what, field string, places []placement.Placement, axes int) error {
	if len(places) != axes {
		return invalidf(op, "%s: %s declares %d placements %v for a %d-axis mesh", what, field, len(places), places, axes)
	}
	for a, p := range places {
		if p.IsRouted() {
			return rulef(op, "%s: %s is Routed on mesh axis %d; Routed blocks have no static shape (the moe package moves them)", what, field, a)
		}
		if p.IsPartial() && p.Op() != comm.Sum && p.Op() != comm.Avg {
			return rulef(op, "%s: %s is %v on mesh axis %d, which has no linear gradient; reduce it to Replicate or Shard first", what, field, p, a)
		}
	}
	return nil
}

// pairGrad checks that a gradient placement fits its value's placement
// axis by axis: Shard(d) with Shard(d), and Replicate or Partial(sum) for
// a Replicate or Partial value.
func pairGrad(op, what string, names []string, val, grad []placement.Placement) error {
	for a, p := range val {
		g := grad[a]
		if p.IsShard() {
			if !g.IsShard() || g.Dim() != p.Dim() {
				return rulef(op, "%s is %v on mesh axis %q but its gradient is declared %v; this rank's gradient block has the shape of its value block, so it must be %v there", what, p, names[a], g, p)
			}
			continue
		}
		if !(g.IsReplicate() || (g.IsPartial() && g.Op() == comm.Sum)) {
			return rulef(op, "%s is %v on mesh axis %q but its gradient is declared %v; this rank's gradient block covers the whole dim there, so it must be R (the same whole gradient on every rank) or P(sum) (a contribution; the blocks sum to the gradient)", what, p, names[a], g)
		}
	}
	return nil
}

// blockOf exposes dt's local block (not a copy).
func blockOf[T float32 | float64](dt *placement.DTensor) (Block[T], error) {
	d, ok := dt.LocalData().([]T)
	if !ok {
		return Block[T]{}, fmt.Errorf("local data of type %T, want %T", dt.LocalData(), []T(nil))
	}
	return Block[T]{Shape: dt.LocalShape(), Data: d}, nil
}

// wrapBlock checks a block returned by user code against spec's local
// shape and lays it out by spec.
func wrapBlock[T float32 | float64](op, phase, what string, spec *placement.Spec, b Block[T]) (*placement.DTensor, error) {
	want := spec.LocalShape()
	if !slices.Equal(b.Shape, want) {
		return nil, invalidf(op, "%s returned a block of shape %v for %s; %v implies a local block of shape %v on this rank", phase, b.Shape, what, spec, want)
	}
	if n := prod(want); len(b.Data) != n {
		return nil, invalidf(op, "%s returned %d elements for %s; its local block %v holds %d", phase, len(b.Data), what, want, n)
	}
	return placement.NewLocal(spec, b.Data)
}
