package autograd

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Option configures NewTape.
type Option func(*Tape)

// WithPlanner makes the tape plan redistributions (forward and backward)
// with p, sharing its plan cache and cost model. Without it the tape uses
// a planner of its own with no cost model.
func WithPlanner(p *placement.Planner) Option { return func(t *Tape) { t.planner = p } }

// WithBLAS makes MatMul run on b. Without it the tape uses kernels.Default
// on first use. b's thread count (BLAS.Threads) also bounds the goroutines
// of the tape's other kernels (softmax, GELU, cross-entropy, attention),
// so a rank given its share of the cores keeps to it throughout.
func WithBLAS(b *kernels.BLAS) Option { return func(t *Tape) { t.blas = b } }

// WithDevice makes d the tape's device: where the modules built on the
// tape allocate their parameters, and where their gradients and the
// optimizer state follow. Ops run on the device of their inputs, not the
// tape's. Without it, or with nil, the device is the host.
//
// Op results on a device are device memory, which the garbage collector
// frees only when it gets round to it (a safety net): give a tape whose
// ops run on a device WithRecycling too, as the models' trainers do, so
// that each step's results go back to the device's allocator at Recycle
// and the device's memory stays flat.
func WithDevice(d device.Device) Option { return func(t *Tape) { t.device = d } }

// WithRecycling makes the tape reuse the memory of op results from one
// pass to the next, as it always does for saved values and intermediate
// gradients: results come from the tape's arena and go back to it when
// the caller declares them dead with Recycle. A training loop that calls
// Recycle once a step, before its forward pass, then allocates almost
// nothing per step, which saves the garbage collector's zeroing, the
// kernel's page faults and cache misses on fresh memory (tens of megabytes
// a step for a small GPT).
//
// The price is a lifetime rule Go cannot check: Recycle ends the life of
// every value the tape's ops produced since the previous Recycle, and of
// the tensors their Data returned. Such a Value's Data returns nil and ops
// reject it, but a *placement.DTensor taken from it earlier now shares
// memory with the results of later passes: copy out (or read) whatever
// must outlive the step before calling Recycle. Leaves (Param, Constant)
// are never recycled; a leaf's gradient is, at ZeroGrad: the next Backward
// copies the leaf's new gradient into its memory, so a gradient tensor
// taken before ZeroGrad changes then. A tape made WithRecycling whose
// Recycle is never called keeps every result it made.
func WithRecycling() Option { return func(t *Tape) { t.recycling = true } }

// WithAutocast makes the tape's float32 matrix products compute in
// bfloat16 with float32 accumulation, as PyTorch's
// torch.autocast(dtype=torch.bfloat16) does for matmul, bmm and linear
// (its lower-precision list): MatMul, BatchedMatMul and Linear, forward
// and backward, round both operands of each GEMM to bfloat16 and sum
// their products in float32 (device.GemmBF16; on the host a float32 GEMM
// over rounded copies, so the host and the emulated device agree bit for
// bit). Everything else stays float32: results and activations (PyTorch
// would keep a matmul's result in bfloat16), LayerNorm, softmax,
// cross-entropy and the other reductions (autocast's float32 list), the
// fused CausalAttention, parameters, gradients and optimizer state
// (float32 master weights). Float64 tensors are not cast, as autocast
// leaves float64 alone. Custom ops that run their own GEMMs read it with
// Tape.Autocast.
func WithAutocast() Option { return func(t *Tape) { t.autocast = true } }

// Autocast reports whether the tape was made WithAutocast: whether its
// float32 matrix products compute in bfloat16.
func (t *Tape) Autocast() bool { return t != nil && t.autocast }

// gemmPrecision is the precision of the tape's GEMMs on dtype dt:
// bfloat16 for float32 under WithAutocast.
func (t *Tape) gemmPrecision(dt comm.DType) device.GemmPrecision {
	if t.Autocast() && dt == comm.Float32 {
		return device.GemmBF16
	}
	return device.GemmF32
}

// WithPoisonRecycled is WithRecycling with a check: Recycle fills the memory
// it takes back with NaN, so that a value read after its Recycle (through
// a DTensor kept from it) shows up as NaN rather than as plausible numbers
// from a later pass. It is for tests and debugging: the filling costs a
// pass over every result.
func WithPoisonRecycled() Option {
	return func(t *Tape) { t.recycling, t.arena.poison = true, true }
}

// The phases an Observer is told about.
const (
	// PhaseForward is an op's forward computation: from the check of its
	// inputs to its result (recorded or not: ops under NoGrad count too).
	PhaseForward = "forward"
	// PhaseBackward is one recorded op's backward function during
	// Backward, with the accumulation of the gradients it returns.
	PhaseBackward = "backward"
	// PhaseHooks is the gradient-ready hooks of one leaf (op is the leaf's
	// name), such as DDP copying a gradient into a bucket and launching its
	// all-reduce.
	PhaseHooks = "hooks"
)

// Observer receives the wall-clock span [start, end] of each piece of work
// the tape does: op is the op's name ("Linear") or, for PhaseHooks, the
// leaf's name; phase is PhaseForward, PhaseBackward or PhaseHooks. It runs
// on the goroutine that uses the tape, synchronously, so it must be cheap
// and must not use the tape.
type Observer func(op, phase string, start, end time.Time)

// WithObserver makes the tape report the time of every op's forward, every
// op's backward and every leaf's gradient-ready hooks to fn (the trace
// package turns them into a timeline). Without it, or with a nil fn,
// nothing is timed.
//
// Several WithObserver options compose: each observer is called, in the
// order given, with every span.
func WithObserver(fn Observer) Option {
	return func(t *Tape) {
		switch prev := t.observe; {
		case fn == nil:
		case prev == nil:
			t.observe = fn
		default:
			t.observe = func(op, phase string, start, end time.Time) {
				prev(op, phase, start, end)
				fn(op, phase, start, end)
			}
		}
	}
}

// Tape records the ops of one rank's forward pass so that Backward can run
// them in reverse. There is one tape per rank: a Tape and its Values are
// not safe for concurrent use and must not be shared between the
// goroutines of simulated ranks. Every rank records the same ops in the
// same order (SPMD), since Redistribute and the backward of some ops are
// collective.
//
// Backward clears the recorded ops (successful or not); leaves and their
// gradients survive, so a training step records a fresh forward pass on
// the same tape. Reset clears the ops without running backward.
type Tape struct {
	planner *placement.Planner
	blas    *kernels.BLAS
	device  device.Device // WithDevice; nil is the host
	// graphState is the active recording scope's: the default scope's,
	// or a Graph's while Graph.Do runs (graph.go).
	graphState
	noGrad  int  // depth of NoGrad scopes
	walking bool // inside Backward (hooks run with recording off)
	trace   func(event string)
	observe Observer  // WithObserver; nil: nothing is timed
	opStart time.Time // when the op being computed checked its inputs
	// recycling (WithRecycling) puts op results in the arena too; results
	// lists the values made since the last Recycle, to invalidate them.
	recycling bool
	results   []*Value
	autocast  bool // WithAutocast
	// walk is the reverse walk in progress (nil outside Backward); frames
	// are the checkpointed regions whose function is running, innermost
	// last; recomputing counts the regions being recomputed in backward.
	walk        *walker
	frames      []*frame
	recomputing int
	acct        activations
	graphs      graphs    // the Graphs made on the tape (graph.go)
	split       *splitRun // the split backward in progress (split.go)
}

// NewTape returns an empty tape.
func NewTape(opts ...Option) *Tape {
	t := &Tape{}
	t.arena = &arena{}
	for _, o := range opts {
		o(t)
	}
	if t.planner == nil {
		t.planner = placement.NewPlanner(nil)
	}
	return t
}

// Planner returns the planner the tape redistributes with.
func (t *Tape) Planner() *placement.Planner {
	if t == nil {
		return nil
	}
	return t.planner
}

// Device returns the tape's device (WithDevice): device.Host() unless
// another was given.
func (t *Tape) Device() device.Device {
	if t == nil || t.device == nil {
		return device.Host()
	}
	return t.device
}

// Len returns the number of ops recorded since the tape was last cleared.
func (t *Tape) Len() int {
	if t == nil {
		return 0
	}
	return len(t.nodes)
}

// Reset discards the recorded ops without running backward. Leaves keep
// their gradients; values produced by the discarded ops can no longer be
// used in recorded ops.
func (t *Tape) Reset() {
	if t == nil {
		return
	}
	if t.graphs.made == 0 {
		t.acct.reset()
	} else {
		// Other graphs' nodes still hold their blocks: release only
		// this graph's.
		for _, n := range t.nodes {
			if n != nil {
				t.unhold(n)
			}
		}
	}
	clear(t.nodes)
	t.nodes = t.nodes[:0]
	t.weights = false
	t.graphs.gens++
	t.gen = t.graphs.gens // unique across graphs, so a value of one is refused in another
	t.arena.reset()
}

// Recycle, on a tape made WithRecycling, ends the life of every value the
// tape's ops have produced since the last Recycle and returns their memory
// to the tape for the results of the next pass (see WithRecycling for the
// rule this imposes). It first discards the recorded ops, as Reset does;
// on other tapes that is all it does. A recycled Value's Data and Spec
// return nil, and using it as an op's input fails with ErrInvalid. Leaves
// and their gradients are untouched.
func (t *Tape) Recycle() {
	if t == nil {
		return
	}
	t.Reset()
	for _, v := range t.results {
		v.data, v.recycled = nil, true
	}
	clear(t.results)
	t.results = t.results[:0]
	t.arena.recycle()
}

// NoGrad runs fn with recording off: ops inside it record nothing and
// produce values that do not require grad (leaves created inside still do).
// Scopes nest. It returns fn's error.
func (t *Tape) NoGrad(fn func() error) error {
	if t == nil || fn == nil {
		return invalidf("NoGrad", "nil tape or function")
	}
	t.noGrad++
	defer func() { t.noGrad-- }()
	return fn()
}

// recording reports whether ops are recorded now.
func (t *Tape) recording() bool { return t.noGrad == 0 && !t.walking }

// backwardFunc maps the gradient of a node's output to the gradients of
// its inputs (nil where an input needs none).
type backwardFunc func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error)

// node is one recorded op.
type node struct {
	op     string
	inputs []*Value
	out    *Value
	back   backwardFunc
	index  int
	gen    uint64
	// outs and multi replace out and back for a node of several outputs
	// (a checkpoint): multi gets one gradient per output, nil where none
	// arrived.
	outs  []*Value
	multi func(ctx context.Context, gs []*placement.DTensor) ([]*placement.DTensor, error)
	// held lists the blocks the node holds for backward, counted in the
	// tape's activation bytes until the walk passes the node.
	held []heldBlock
	// split says the op computes an input's gradient only when Tape.need
	// says so (split.go).
	split bool
}

// Value is a distributed tensor in a computation: its data (a DTensor),
// whether it requires grad, the op that produced it (none for a leaf) and,
// for leaves that require grad, the gradient accumulated so far.
//
// A gradient is a DTensor of the value's global shape. Its placements are
// whatever backward produced, which may differ from
// placement.GradSpec(value): a replicated weight multiplied by a
// batch-sharded input gets a gradient that is Partial(sum) on the batch
// axis. Autograd keeps it that way (no hidden communication); data
// parallelism all-reduces it (DDP) or reduce-scatters it (FSDP), typically
// from an OnGradReady hook.
type Value struct {
	tape         *Tape
	data         *placement.DTensor
	grad         *placement.DTensor
	requiresGrad bool
	leaf         bool
	node         *node
	name         string
	hooks        []GradHook
	recycled     bool // its memory went back to the tape (Recycle)
	// spare is the local block of the gradient ZeroGrad dropped on a
	// recycling tape (or KeepGradBuffer gave), for the next gradient to be
	// copied into.
	spare any
	// ownGrad says grad's block was allocated by Backward for this leaf
	// alone (not given by SetGrad), so ReleaseGrad may hand it on;
	// ownSpare says the same of spare.
	ownGrad, ownSpare bool
	// fresh is the tape generation + 1 in which Backward made grad (0: a
	// gradient from an earlier pass or from SetGrad); later arrivals in
	// that pass add into it, as nobody else has seen it yet.
	fresh uint64
}

// Param makes a leaf that requires grad (a parameter) named name, holding
// dt. Its gradient accumulates across Backward calls until ZeroGrad.
func (t *Tape) Param(name string, dt *placement.DTensor) (*Value, error) {
	if t == nil {
		return nil, invalidf("Param", "nil tape")
	}
	if dt == nil {
		return nil, invalidf("Param", "nil tensor for %q", name)
	}
	return &Value{tape: t, data: dt, requiresGrad: true, leaf: true, name: name}, nil
}

// Relayout gives the parameter leaf v a new layout in place: dt becomes
// its data, so that everything holding v (a module's field, a parameter
// list collected for an optimizer or for data parallelism) sees the new
// layout and keeps holding the parameter. It is for layout changes made
// before training (tensor parallelism resharding a weight, FSDP keeping a
// rank's shard), not for changing a parameter's values: dt must hold the
// same tensor, made from v's own data by a redistribution or a slice,
// which Relayout cannot check. It checks what it can: dt has v's dtype,
// mesh and number of elements (the global shape may change, as for a
// fused weight viewed as [C, out/C, in]); v is a leaf that requires grad,
// has no gradient and no gradient hooks (nothing has taken it for
// gradients yet: DDP registers hooks), and no op recorded on its tape
// since the tape was last cleared uses it. Memory kept for v's next
// gradient is dropped, as its size may change. Errors wrap ErrInvalid and
// leave v unchanged.
func (v *Value) Relayout(dt *placement.DTensor) error {
	const op = "Relayout"
	switch {
	case v == nil || dt == nil:
		return invalidf(op, "nil value or tensor")
	case !v.leaf || !v.requiresGrad || v.data == nil:
		return invalidf(op, "%q is not a parameter (a leaf that requires grad)", v.name)
	case v.grad != nil:
		return invalidf(op, "%q already has a gradient; change layouts before training", v.name)
	case len(v.hooks) > 0:
		return invalidf(op, "%q has gradient hooks (DDP or FSDP took it); change layouts before wrapping", v.name)
	case v.tape != nil && v.tape.walking:
		return invalidf(op, "%q: called during Backward", v.name)
	}
	if v.tape != nil {
		for _, n := range v.tape.nodes {
			if slices.Contains(n.inputs, v) {
				return invalidf(op, "%q is used by the recorded op %s; change layouts before the forward pass (or Reset the tape)", v.name, n.op)
			}
		}
	}
	old, s := v.data.Spec(), dt.Spec()
	if old.DType() != s.DType() {
		return invalidf(op, "%q: new layout of dtype %v for a parameter of dtype %v", v.name, s.DType(), old.DType())
	}
	om, sm := old.Mesh(), s.Mesh()
	if om.World() != sm.World() || !slices.Equal(om.Names(), sm.Names()) || !slices.Equal(om.Shape(), sm.Shape()) || !slices.Equal(om.WorldRanks(), sm.WorldRanks()) {
		return invalidf(op, "%q: new layout on mesh %v for a parameter on mesh %v", v.name, sm, om)
	}
	if prod(old.Shape()) != prod(s.Shape()) {
		return invalidf(op, "%q: new global shape %v does not hold the %v elements of %v", v.name, s.Shape(), prod(old.Shape()), old.Shape())
	}
	v.data, v.spare, v.ownSpare = dt, nil, false
	return nil
}

// Constant makes a leaf that does not require grad.
func (t *Tape) Constant(dt *placement.DTensor) (*Value, error) {
	if t == nil {
		return nil, invalidf("Constant", "nil tape")
	}
	if dt == nil {
		return nil, invalidf("Constant", "nil tensor")
	}
	return &Value{tape: t, data: dt, leaf: true, name: "constant"}, nil
}

// Data returns the value's distributed tensor. It must not be modified.
// It is nil once the value has been recycled (Tape.Recycle).
func (v *Value) Data() *placement.DTensor {
	if v == nil {
		return nil
	}
	return v.data
}

// Tape returns the tape the value was made on (nil for a nil value).
// Parallel styles use it to make resharded copies of parameters.
func (v *Value) Tape() *Tape {
	if v == nil {
		return nil
	}
	return v.tape
}

// Spec returns the value's spec.
func (v *Value) Spec() *placement.Spec {
	if v == nil || v.data == nil {
		return nil
	}
	return v.data.Spec()
}

// Name returns the value's name: the parameter's name for leaves, the
// op's name for op results.
func (v *Value) Name() string {
	if v == nil {
		return ""
	}
	return v.name
}

// RequiresGrad reports whether gradients flow to or through the value.
func (v *Value) RequiresGrad() bool { return v != nil && v.requiresGrad }

// IsLeaf reports whether the value was made by Param or Constant rather
// than by an op.
func (v *Value) IsLeaf() bool { return v != nil && v.leaf }

// Grad returns the gradient accumulated in a leaf by the Backward calls
// since its last ZeroGrad, or nil if none has arrived. Results of ops do
// not retain gradients. The returned tensor is owned by the value; later
// Backward calls replace it rather than modify it, except after ZeroGrad
// on a tape made WithRecycling, and except on a device, where a gradient
// Backward allocated is summed into in place (or freed when a sum of
// another layout replaces it): copy it to keep it across passes.
func (v *Value) Grad() *placement.DTensor {
	if v == nil {
		return nil
	}
	return v.grad
}

// GradBytes returns the bytes of gradient memory the leaf holds: its
// gradient's local block or, after ZeroGrad on a tape made WithRecycling,
// the dropped block kept for the next gradient (0 when it holds neither).
// Memory accounting counts it; a gradient shared with other memory (a DDP
// bucket view) is counted here too.
func (v *Value) GradBytes() int64 {
	if v == nil {
		return 0
	}
	d := v.spare
	if v.grad != nil {
		d = v.grad.LocalData()
	}
	switch b := d.(type) {
	case []float32:
		return 4 * int64(len(b))
	case []float64:
		return 8 * int64(len(b))
	case device.Buffer:
		return int64(b.Len() * b.DType().Size())
	}
	return 0
}

// ReleaseGrad drops the accumulated gradient and, unlike ZeroGrad on a
// tape made WithRecycling, keeps no memory for the next one: for a
// gradient that is consumed once and would otherwise hold its memory
// between steps (FSDP drops a gathered parameter's gradient once it is
// reduce-scattered). It may be called from a gradient hook. It returns
// the dropped gradient's local block ([]float32 or []float64, or the
// device.Buffer of a gradient on a device, which the caller then owns) when
// Backward allocated it for this leaf alone, for the caller to pass to
// another leaf's KeepGradBuffer, and nil otherwise (no gradient, one
// given by SetGrad, or an empty host block; an empty device block is
// returned, as it holds an allocation).
func (v *Value) ReleaseGrad() any {
	if v == nil {
		return nil
	}
	var block any
	// An empty device block still holds an allocation (the allocator's
	// smallest block): hand it over too, for the caller to free.
	if v.grad != nil && v.ownGrad && (v.GradBytes() > 0 || bufOf(v.grad) != nil) {
		block = v.grad.LocalData()
	}
	v.freeOwnedSpare(block)
	v.grad, v.spare, v.fresh, v.ownGrad, v.ownSpare = nil, nil, 0, false, false
	return block
}

// KeepGradBuffer gives the leaf memory for its next gradient, as ZeroGrad
// keeps the dropped gradient's on a tape made WithRecycling: Backward
// copies the leaf's first gradient into block instead of allocating.
// block must be a []float32 or []float64, or a device.Buffer, that nothing
// else uses (one that ReleaseGrad returned); one whose type, length or
// device differs from the next gradient's block is not used. It replaces any memory kept before and
// does nothing on a leaf that holds a gradient.
func (v *Value) KeepGradBuffer(block any) {
	if v == nil || v.grad != nil {
		return
	}
	switch block.(type) {
	case []float32, []float64, device.Buffer:
		v.freeOwnedSpare(block)
		v.spare, v.ownSpare = block, true
	}
}

// ZeroGrad drops the accumulated gradient. On a tape made WithRecycling
// the next Backward writes the leaf's gradient into the dropped
// gradient's memory instead of allocating. On other tapes a gradient on a
// device that Backward allocated for this leaf is freed (device memory
// has no garbage collector): it must not be used afterwards.
func (v *Value) ZeroGrad() {
	if v == nil {
		return
	}
	if v.grad != nil && v.tape != nil && v.tape.recycling {
		v.freeOwnedSpare(v.grad.LocalData())
		v.spare, v.ownSpare = v.grad.LocalData(), v.ownGrad
	} else if v.grad != nil && v.ownGrad {
		if b := bufOf(v.grad); b != nil {
			_ = b.Free() // a failure means a closed device, which holds nothing
		}
	}
	v.grad, v.fresh, v.ownGrad = nil, 0, false
}

// GradHook is a gradient-ready hook (OnGradReady). It runs during
// Backward with Backward's context and the leaf whose gradient is final. A
// non-nil error stops Backward, which returns it wrapped with the leaf's
// name; since Backward is collective, a hook should fail only where every
// rank fails alike (a broken communicator, a cancelled context) and report
// a rank-local problem later instead (DDP reports it at Finish).
type GradHook func(ctx context.Context, v *Value) error

// OnGradReady registers fn to run during Backward the moment this leaf's
// gradient for that pass is final: right after the backward of the
// earliest recorded op that uses it, before the backward of any op
// recorded before that one. It fires exactly once per Backward in which the
// leaf receives a gradient (not for a leaf the loss does not depend on),
// and sees Grad() with every pass accumulated so far. Hooks of leaves
// finalised by the same op fire in the order the leaves appear among that
// op's inputs; hooks of one leaf fire in registration order. Hooks run with
// recording off, with the context given to Backward; the first error stops
// Backward (see GradHook). Only leaves that require grad take hooks.
func (v *Value) OnGradReady(fn GradHook) error {
	if fn == nil || v == nil {
		return invalidf("OnGradReady", "nil hook or value")
	}
	if !v.leaf || !v.requiresGrad {
		return invalidf("OnGradReady", "%q is not a leaf that requires grad; hooks are for parameters", v.name)
	}
	v.hooks = append(v.hooks, fn)
	return nil
}

// checkInputs validates op inputs: non-nil, on this tape and, when they
// need gradients, recorded in the tape's current pass; on one device, and
// on the host unless op has a device form (deviceForm).
func checkInputs(op string, vs ...*Value) (*Tape, error) {
	return checkInputsOn(op, deviceForm(op), vs...)
}

// checkInputsOn is checkInputs for an op that runs on devices when onDev
// is set.
func checkInputsOn(op string, onDev bool, vs ...*Value) (*Tape, error) {
	var t *Tape
	for i, v := range vs {
		if v != nil && v.recycled {
			return nil, invalidf(op, "input %d (%q) was recycled (Tape.Recycle); recompute it", i, v.name)
		}
		if v == nil || v.data == nil || v.tape == nil {
			return nil, invalidf(op, "input %d is nil", i)
		}
		if t == nil {
			t = v.tape
			if t.weights && !t.walking {
				return nil, invalidf(op, "the recording scope has a weight backward pending (BackwardInput ran, BackwardWeight not yet); record in another Graph")
			}
			if t.observe != nil {
				t.opStart = time.Now()
			}
		} else if v.tape != t {
			return nil, invalidf(op, "inputs come from different tapes (input %d, %q)", i, v.name)
		}
		if v.requiresGrad && !v.leaf && v.node.gen != t.gen {
			return nil, invalidf(op, "input %d (%q) was recorded before the tape was last cleared (by Backward or Reset); recompute it", i, v.name)
		}
		if i > 0 {
			if err := device.Same(op, vs[0].data.Device(), v.data.Device()); err != nil {
				// Both sentinels match: autograd's ErrInvalid as for any
				// rejected input, and device.ErrMixed for the cause.
				return nil, fmt.Errorf("autograd: %w (input 0, %q, and input %d, %q; copy one with autograd.To): %w", err, vs[0].name, i, v.name, ErrInvalid)
			}
		}
	}
	if d, ok := onDevice(vs[0].data); ok && !onDev {
		return nil, hostOnly(op, d)
	}
	return t, nil
}

// record makes the result of an op; when recording and some input requires
// grad it adds a node whose backward is back.
func (t *Tape) record(op string, out *placement.DTensor, inputs []*Value, back backwardFunc) *Value {
	return t.recordAux(op, out, nil, inputs, back)
}

// recordAux is record for an op that also saves aux (a float block of
// the tape's arena) for its backward: aux counts in the activation bytes,
// and a checkpoint that keeps the op keeps aux with its result.
func (t *Tape) recordAux(op string, out *placement.DTensor, aux any, inputs []*Value, back backwardFunc) *Value {
	if t.observe != nil && !t.opStart.IsZero() {
		t.observe(op, PhaseForward, t.opStart, time.Now())
		t.opStart = time.Time{}
	}
	v := &Value{tape: t, data: out, name: op}
	if t.recycling {
		t.results = append(t.results, v)
	}
	if len(t.frames) > 0 {
		t.inFrames(op, v, aux, inputs)
	}
	if !t.recording() || !slices.ContainsFunc(inputs, (*Value).RequiresGrad) {
		return v
	}
	n := &node{op: op, inputs: inputs, out: v, back: back, index: len(t.nodes), gen: t.gen}
	v.requiresGrad, v.node = true, n
	t.hold(n, out, aux)
	t.nodes = append(t.nodes, n)
	return v
}

// Backward computes the gradient of loss with respect to every leaf that
// requires grad and accumulates it into the leaves' Grad. loss must be on
// this tape, require grad, and be a scalar (global shape [] or [1]) laid
// out Replicate or Partial(sum) on every mesh axis; its seed gradient is
// ones laid out as placement.GradSpec(loss) (Replicate everywhere). Every
// rank of the mesh calls Backward with the same loss (backward ops may be
// collective).
//
// Gradients meeting at one value are added locally when their specs are
// equal. When they differ, one is redistributed to the other's spec if that
// plan has no collective (incoming to existing first, then existing to
// incoming: Replicate -> Partial(sum) keeps the value on one rank and
// zeroes the rest, Replicate -> Shard takes the local chunk); otherwise
// Backward fails with ErrGradPlacement naming both placements.
//
// Gradient-ready hooks (OnGradReady) run with ctx as their leaves'
// gradients become final; the first hook error stops Backward and is
// returned wrapped.
//
// Backward clears the tape whether or not it succeeds. On an error some
// leaves may hold partial gradients for the pass: ZeroGrad before retrying.
func (t *Tape) Backward(ctx context.Context, loss *Value) error {
	const op = "Backward"
	if t != nil && (loss == nil || loss.data == nil) {
		return invalidf(op, "nil loss")
	}
	if err := t.checkWalk(op, []*Value{loss}); err != nil {
		return err
	}
	defer t.Reset()
	seed, err := t.seedLoss(op, loss)
	if err != nil {
		return err
	}
	return t.walkFrom(ctx, []*Value{loss}, []*placement.DTensor{seed}, nil)
}

// checkWalk checks that a backward may start on t from outs: the tape is
// not walking or inside a checkpointed function, and every out is this
// scope's, requires grad and is of the current pass.
func (t *Tape) checkWalk(op string, outs []*Value) error {
	if t == nil {
		return invalidf(op, "nil tape")
	}
	if t.walking || t.walk != nil {
		return invalidf(op, "%s called from a gradient hook or during another backward", op)
	}
	if len(t.frames) > 0 {
		return invalidf(op, "%s called inside a checkpointed function", op)
	}
	if t.weights {
		return invalidf(op, "the recording scope has a weight backward pending (BackwardInput ran, BackwardWeight not yet)")
	}
	if len(outs) == 0 {
		return invalidf(op, "no outputs to start from")
	}
	for i, out := range outs {
		switch {
		case out == nil || out.data == nil:
			return invalidf(op, "nil output %d", i)
		case out.tape != t:
			return invalidf(op, "output %d (%q) was recorded on another tape", i, out.name)
		case !out.requiresGrad:
			return invalidf(op, "output %d (%q) does not require grad (built from constants only, or under NoGrad)", i, out.name)
		case !out.leaf && out.node.gen != t.gen:
			return invalidf(op, "output %d (%q) was recorded before its scope was last cleared (Backward has already run on it) or in another Graph", i, out.name)
		case slices.Index(outs, out) != i:
			return invalidf(op, "output %d (%q) is given twice", i, out.name)
		}
	}
	return nil
}

// seedLoss checks that loss is a scalar (global shape [] or [1]) laid out
// Replicate or Partial(sum) on every mesh axis, and returns its seed: ones
// laid out as placement.GradSpec(loss), in scratch on a device.
func (t *Tape) seedLoss(op string, loss *Value) (*placement.DTensor, error) {
	spec := loss.Spec()
	if sh := spec.Shape(); !(len(sh) == 0 || (len(sh) == 1 && sh[0] == 1)) {
		return nil, invalidf(op, "the loss %q has global shape %v; want a scalar (shape [] or [1]): reduce it with Sum", loss.name, sh)
	}
	for a, p := range spec.Placements() {
		if !(p.IsReplicate() || (p.IsPartial() && p.Op() == comm.Sum)) {
			return nil, invalidf(op, "the loss %q is %v on mesh axis %q; want Replicate or Partial(sum) on every axis", loss.name, p, spec.Mesh().Names()[a])
		}
	}
	seedSpec, err := placement.GradSpec(spec)
	if err != nil {
		return nil, err
	}
	if d, ok := onDevice(loss.data); ok {
		// Scratch, freed when the walk is over, as the host's seed is
		// left to the garbage collector.
		return filledOn(t.scratch(), d, seedSpec, 1)
	}
	return filled(seedSpec, 1)
}

// walkFrom runs the reverse walk over the active scope's nodes from outs,
// whose gradients are seeds (owned by the caller or scratch: never
// modified). split, when not nil, makes it the input half of a split
// backward (split.go).
func (t *Tape) walkFrom(ctx context.Context, outs []*Value, seeds []*placement.DTensor, split *splitRun) error {
	t.walking = true
	defer func() { t.walking = false }()
	t.split = split
	defer func() { t.split = nil }()
	pending := map[*Value]*placement.DTensor{}
	got := map[*Value]bool{}
	for i, out := range outs {
		if !out.leaf {
			pending[out] = seeds[i]
			continue
		}
		if err := t.accumulateLeaf(ctx, out, seeds[i]); err != nil {
			return err
		}
		got[out] = true
		if err := fire(ctx, out); err != nil {
			return err
		}
	}
	if len(pending) == 0 {
		return nil
	}
	w := &walker{t: t, nodes: t.nodes, pending: pending, got: got, finalAt: finalAt(t.nodes), split: split}
	return w.run(ctx)
}

// finalAt lists, for each node i, the leaves whose earliest consumer is
// node i, in order of first appearance: their gradient is final once node
// i's backward has run.
func finalAt(nodes []*node) [][]*Value {
	out := make([][]*Value, len(nodes))
	seen := map[*Value]bool{}
	for i, n := range nodes {
		for _, in := range n.inputs {
			if in.leaf && in.requiresGrad && !seen[in] {
				seen[in] = true
				out[i] = append(out[i], in)
			}
		}
	}
	return out
}

// walker is one reverse walk over recorded nodes: Backward's, or the
// nested walk of a checkpoint node over its recomputed region (whose
// parent is the walk that reached the checkpoint node).
type walker struct {
	t       *Tape
	nodes   []*node
	pending map[*Value]*placement.DTensor // gradients of values still to be consumed
	got     map[*Value]bool               // leaves that received a gradient in this Backward (shared by nested walks)
	finalAt [][]*Value                    // leaves whose hooks fire after node i (nil in a nested walk: they fire in Backward's)
	parent  *walker
	// seeds are gradients the parent walk owns (those it handed to the
	// checkpoint node): never returned to the arena here.
	seeds []*placement.DTensor
	// split is the input half of a split backward (nil otherwise).
	split *splitRun
}

// run walks w.nodes in reverse: each node with a pending output gradient
// runs its backward and its inputs' gradients are accumulated (leaves'
// into Grad); leaves' hooks fire as their gradients become final. A node
// is dropped from the list (and from the activation count) once passed.
func (w *walker) run(ctx context.Context) error {
	t := w.t
	prev := t.walk
	t.walk = w
	defer func() { t.walk = prev }()
	var dead []*placement.DTensor // gradients consumed by the current node
	for i := len(w.nodes) - 1; i >= 0; i-- {
		n := w.nodes[i]
		var err error
		if dead, err = w.step(ctx, i, n, dead[:0]); err != nil {
			return err
		}
		if w.split == nil || !w.split.keeps(n) {
			t.unhold(n)
			w.nodes[i] = nil
		}
		if w.finalAt == nil {
			continue
		}
		for _, leaf := range w.finalAt[i] {
			if w.got[leaf] && (w.split == nil || !w.split.weight(leaf)) {
				if err := fire(ctx, leaf); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// step runs node n's backward if one of its outputs has a pending
// gradient, and accumulates the gradients it returns.
func (w *walker) step(ctx context.Context, i int, n *node, dead []*placement.DTensor) ([]*placement.DTensor, error) {
	t := w.t
	var consumed []*placement.DTensor
	if n.outs == nil {
		g, ok := w.pending[n.out]
		if !ok {
			return dead, nil
		}
		delete(w.pending, n.out)
		consumed = []*placement.DTensor{g}
	} else {
		consumed = make([]*placement.DTensor, len(n.outs))
		found := false
		for j, o := range n.outs {
			if g, ok := w.pending[o]; ok {
				consumed[j], found = g, true
				delete(w.pending, o)
			}
		}
		if !found {
			return dead, nil
		}
	}
	if w.split != nil {
		deferred, err := w.split.before(i, n, consumed)
		if err != nil || deferred {
			return dead, err
		}
	}
	if t.trace != nil {
		t.trace("backward " + n.op)
	}
	var start time.Time
	if t.observe != nil {
		start = time.Now()
	}
	var grads []*placement.DTensor
	var err error
	if n.outs == nil {
		grads, err = n.back(ctx, consumed[0])
	} else {
		grads, err = n.multi(ctx, consumed)
	}
	if err != nil {
		return dead, fmt.Errorf("autograd: backward of %s (op %d of the tape): %w", n.op, i, err)
	}
	if len(grads) != len(n.inputs) {
		return dead, fmt.Errorf("autograd: backward of %s returned %d gradients for %d inputs", n.op, len(grads), len(n.inputs))
	}
	if w.split == nil || !w.split.keeps(n) {
		dead = append(dead, consumed...)
	}
	busy := append(slices.Clone(grads), consumed...)
	for j, in := range n.inputs {
		gj := grads[j]
		if gj == nil || !in.requiresGrad {
			dead = append(dead, gj)
			continue
		}
		if w.split != nil && w.split.weight(in) {
			// Computed by an op that cannot leave it out: kept for
			// BackwardWeight to add in, in the order Backward would.
			w.split.stash(i, n, in, gj)
			continue
		}
		if in.leaf {
			if err := t.accumulateLeaf(ctx, in, gj); err != nil {
				return dead, err
			}
			w.got[in] = true
			dead = append(dead, gj) // the leaf keeps a copy
			continue
		}
		prev := w.pending[in]
		if prev != nil && prev.Spec().Equal(gj.Spec()) && w.exclusive(prev, in, busy) {
			// prev is scratch nothing else sees: add in place.
			if err := addInPlace(prev, gj); err != nil {
				return dead, err
			}
			dead = append(dead, gj)
			continue
		}
		acc, err := t.accumulate(ctx, in.name, prev, gj, true)
		if err != nil {
			return dead, err
		}
		if prev != nil {
			dead = append(dead, prev, gj)
		}
		w.pending[in] = acc
	}
	// Buffers of consumed gradients go back to the arena unless a
	// pending gradient shares their memory (Add passes one tensor
	// to both inputs, Reshape a view of it).
	t.arena.releaseDead(dead, w.live())
	if t.observe != nil {
		t.observe(n.op, PhaseBackward, start, time.Now())
	}
	return dead, nil
}

// live returns the tensors whose memory must survive this step: the
// pending gradients of this walk and of the walks enclosing it, and the
// gradients those walks handed to checkpoint nodes.
func (w *walker) live() []*placement.DTensor {
	var out []*placement.DTensor
	for x := w; x != nil; x = x.parent {
		for _, g := range x.pending {
			out = append(out, g)
		}
		out = append(out, x.seeds...)
		if x.split != nil {
			out = append(out, x.split.kept...)
		}
	}
	return out
}

// exclusive reports whether v's pending gradient g may be updated in
// place (see arena.exclusive): nothing else live shares its memory.
func (w *walker) exclusive(g *placement.DTensor, v *Value, busy []*placement.DTensor) bool {
	var others []*placement.DTensor
	for x := w; x != nil; x = x.parent {
		for u, l := range x.pending {
			if u != v {
				others = append(others, l)
			}
		}
		others = append(others, x.seeds...)
		if x.split != nil {
			others = append(others, x.split.kept...)
		}
	}
	return w.t.arena.exclusive(g, append(others, busy...))
}

// fire runs a leaf's hooks with Backward's context; the first error stops
// them and Backward.
func fire(ctx context.Context, v *Value) error {
	if v.tape.trace != nil {
		v.tape.trace("ready " + v.name)
	}
	if len(v.hooks) == 0 {
		return nil
	}
	obs := v.tape.observe
	var start time.Time
	if obs != nil {
		start = time.Now()
	}
	for _, h := range v.hooks {
		if err := h(ctx, v); err != nil {
			return fmt.Errorf("autograd: Backward: gradient hook of %q: %w", v.name, err)
		}
	}
	if obs != nil {
		obs(v.name, PhaseHooks, start, time.Now())
	}
	return nil
}

// accumulateLeaf adds g into a leaf's gradient; the leaf owns its gradient,
// so the first one is copied (backward functions may share tensors).
func (t *Tape) accumulateLeaf(ctx context.Context, v *Value, g *placement.DTensor) error {
	if v.grad == nil {
		c, own := copyInto(v.spare, g), v.ownSpare
		if c == nil {
			var err error
			if c, err = clone(g); err != nil {
				return err
			}
			own = true
		}
		v.grad, v.spare, v.fresh, v.ownGrad, v.ownSpare = c, nil, t.gen+1, own, false
		return nil
	}
	// A device gradient Backward allocated for the leaf is summed into
	// in place in later passes too, and freed when a sum of another
	// layout replaces it: nothing else frees device memory, and a new
	// block per pass would grow the device's memory with every
	// accumulated micro-batch.
	old := bufOf(v.grad)
	if !v.ownGrad {
		old = nil
	}
	if (v.fresh == t.gen+1 || old != nil) && v.grad.Spec().Equal(g.Spec()) {
		if err := addInPlace(v.grad, g); err != nil {
			return err
		}
		v.fresh = t.gen + 1
		return nil
	}
	acc, err := t.accumulate(ctx, v.name, v.grad, g, false)
	if err != nil {
		return err
	}
	v.grad, v.fresh, v.ownGrad = acc, t.gen+1, true // accumulate allocates a leaf's sum
	if old != nil {
		return old.Free()
	}
	return nil
}

// copyInto copies g's local block into spare and returns it laid out like
// g, or returns nil when spare is not a block of g's type and length.
func copyInto(spare any, g *placement.DTensor) *placement.DTensor {
	var data any
	switch d := g.LocalData().(type) {
	case []float32:
		if s, ok := spare.([]float32); ok && len(s) == len(d) && len(d) > 0 {
			copy(s, d)
			data = s
		}
	case []float64:
		if s, ok := spare.([]float64); ok && len(s) == len(d) && len(d) > 0 {
			copy(s, d)
			data = s
		}
	case device.Buffer:
		s, ok := spare.(device.Buffer)
		if !ok || s.Owner() != d.Owner() || s.DType() != d.DType() || s.Len() != d.Len() || d.Len() == 0 {
			return nil
		}
		if d.Owner().Copy(s, d) != nil {
			return nil
		}
		c, err := placement.NewLocalOn(g.Spec(), s)
		if err != nil {
			return nil
		}
		return c
	}
	if data == nil {
		return nil
	}
	c, err := placement.NewLocal(g.Spec(), data)
	if err != nil {
		return nil
	}
	return c
}

// accumulate returns existing + incoming as a new tensor (neither is
// modified), moving one to the other's spec only by a plan with no
// collective. The sum is in arena memory when scratch is set (a pending
// gradient of an intermediate value) and freshly allocated otherwise (a
// leaf's gradient, which the user may keep).
func (t *Tape) accumulate(ctx context.Context, name string, existing, incoming *placement.DTensor, scratch bool) (*placement.DTensor, error) {
	if existing == nil {
		return incoming, nil
	}
	dst := alloc{} // a leaf's gradient: fresh
	if scratch {
		dst = t.scratch()
	}
	sum := func(spec *placement.Spec, x, y *placement.DTensor) (*placement.DTensor, error) {
		return add(dst, spec, x, y)
	}
	es, is := existing.Spec(), incoming.Spec()
	if es.Equal(is) {
		return sum(es, existing, incoming)
	}
	var needs []comm.Op
	if moved, ops, err := t.moveLocal(ctx, incoming, es); err != nil {
		return nil, err
	} else if moved != nil {
		return sum(es, existing, moved)
	} else {
		needs = ops
	}
	if moved, _, err := t.moveLocal(ctx, existing, is); err != nil {
		return nil, err
	} else if moved != nil {
		return sum(is, moved, incoming)
	}
	return nil, gradPlacementf("Backward", "gradients of %q arrive as %v and %v (%v and %v); combining them needs %v, and autograd inserts no communication: redistribute the value explicitly (autograd.Redistribute) before its uses so their gradients agree", name, es.Placements(), is.Placements(), es, is, needs)
}

// moveLocal redistributes dt to spec if the plan has no collective; it
// returns nil and the plan's collectives otherwise.
func (t *Tape) moveLocal(ctx context.Context, dt *placement.DTensor, spec *placement.Spec) (*placement.DTensor, []comm.Op, error) {
	pl, err := t.planner.Plan(dt.Spec(), spec)
	if err != nil {
		return nil, nil, err
	}
	if ops := pl.Collectives(); len(ops) > 0 {
		return nil, ops, nil
	}
	out, err := t.execute(ctx, pl, dt, spec.Mesh(), t.scratch())
	return out, nil, err
}
