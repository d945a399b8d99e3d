package autograd

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/placement"
)

// Activation checkpointing: a region of ops that saves nothing for
// backward and is recomputed during it.

// CheckpointFunc is the region Checkpoint runs: a function of values that
// returns values, built from autograd ops on the inputs' tape. It runs
// twice (once in the forward pass, once during Backward) and must record
// the same ops in the same order both times, with the same results given
// the same inputs (it may communicate: every rank runs it at the same
// points).
type CheckpointFunc func(ctx context.Context, in []*Value) ([]*Value, error)

// CheckpointOption configures Checkpoint.
type CheckpointOption func(*checkpointConfig)

type checkpointConfig struct {
	keep map[string]bool
}

// WithKeepOps makes Checkpoint selective: the results of the region's ops
// named names (as Value.Name names them: "Linear", "MatMul",
// "BatchedMatMul", "CausalAttention") are kept from the first forward
// (fused CausalAttention keeps its probabilities as well) and reused when
// the region is recomputed, instead of being computed again; the other
// ops are recomputed. Reuse is implemented by Linear, MatMul,
// BatchedMatMul and fused CausalAttention; other ops named are kept in
// the count (ActivationBytes) but recomputed. Gradients are unchanged bit
// for bit. Options accumulate: WithKeepOps("Linear"), WithKeepOps("MatMul") keeps
// both.
func WithKeepOps(names ...string) CheckpointOption {
	return func(c *checkpointConfig) {
		if c.keep == nil {
			c.keep = map[string]bool{}
		}
		for _, n := range names {
			c.keep[n] = true
		}
	}
}

// WithKeepMatrixProducts is the usual selective policy: WithKeepOps("Linear",
// "MatMul", "BatchedMatMul", "CausalAttention"), the matrix products,
// whose recomputation costs the most time for the memory they hold; the
// cheap elementwise and normalisation ops are recomputed.
func WithKeepMatrixProducts() CheckpointOption {
	return WithKeepOps("Linear", "MatMul", "BatchedMatMul", "CausalAttention")
}

// frame is one checkpointed region whose function is running: its first
// forward (signatures recorded, kept results stored, values requiring
// grad collected) or its recomputation (signatures checked, kept results
// reused).
type frame struct {
	recompute bool
	keep      map[string]bool
	n         int // ops the region has run so far
	sigs      []opSig
	kept      map[int]*keptOp
	touched   []*Value // values requiring grad the region's ops read
	seen      map[*Value]bool
	made      []*Value // results of the region's ops, on a recycling tape
	err       error
}

// opSig is an op of a region: its name and its result's spec.
type opSig struct {
	op   string
	spec *placement.Spec
}

// keptOp is what a selective checkpoint kept of an op: its result's block
// and what it saved for backward (aux, nil for most ops).
type keptOp struct {
	out *placement.DTensor
	aux any
}

// inFrames registers op (result v, saved aux, inputs) with every region
// whose function is running.
func (t *Tape) inFrames(op string, v *Value, aux any, inputs []*Value) {
	spec := v.Spec()
	for _, f := range t.frames {
		pos := f.n
		f.n++
		if t.recycling {
			f.made = append(f.made, v)
		}
		if f.recompute {
			if f.err != nil {
				continue
			}
			if pos >= len(f.sigs) {
				f.err = invalidf("Checkpoint", "recomputing the region ran more ops than its forward did (%d); op %d is %s %v: the checkpointed function must run the same ops each time", len(f.sigs), pos, op, spec)
			} else if s := f.sigs[pos]; s.op != op || !s.spec.Equal(spec) {
				f.err = invalidf("Checkpoint", "op %d of the region is %s %v when recomputed but was %s %v in the forward: the checkpointed function must run the same ops each time", pos, op, spec, s.op, s.spec)
			}
			continue
		}
		f.sigs = append(f.sigs, opSig{op, spec})
		if f.keep[op] {
			f.kept[pos] = &keptOp{out: v.data, aux: aux}
		}
		for _, in := range inputs {
			if in.requiresGrad && !f.seen[in] {
				f.seen[in] = true
				f.touched = append(f.touched, in)
			}
		}
	}
}

// reuse returns what the first forward of a region being recomputed kept
// of the op about to run (nil when nothing was kept), checking that it is
// the same op with the same result spec.
func (t *Tape) reuse(op string, spec *placement.Spec) (*keptOp, error) {
	for i := len(t.frames) - 1; i >= 0; i-- {
		f := t.frames[i]
		if !f.recompute {
			continue
		}
		k := f.kept[f.n]
		if k == nil {
			continue
		}
		if s := f.sigs[f.n]; s.op != op || !s.spec.Equal(spec) {
			return nil, invalidf("Checkpoint", "op %d of the region is %s %v when recomputed but was %s %v in the forward: the checkpointed function must run the same ops each time", f.n, op, spec, s.op, s.spec)
		}
		return k, nil
	}
	return nil, nil
}

// keeping reports whether a region in its first forward keeps op's
// results, so that the op must save for backward even when not recorded.
func (t *Tape) keeping(op string) bool {
	for _, f := range t.frames {
		if !f.recompute && f.keep[op] {
			return true
		}
	}
	return false
}

// Recomputing reports whether a checkpointed region's function is being
// run again during Backward to recompute its activations (see
// Checkpoint). Module hooks inside the region run again then; FSDP's
// output hook asks it so as not to reshard parameters that the region's
// backward, which follows at once, needs gathered.
func (t *Tape) Recomputing() bool { return t != nil && t.recomputing > 0 }

// checkpoint is a recorded checkpoint node's state.
type checkpoint struct {
	t      *Tape
	fn     CheckpointFunc
	in     []*Value // the inputs fn is called with
	node   *node
	sigs   []opSig
	kept   map[int]*keptOp
	unique []bool // node input j is its first occurrence among the node's inputs
}

// Checkpoint runs fn on inputs without saving activations: its ops record
// nothing, and one node, recorded in their place, recomputes them during
// Backward. It returns fn's results as values that require grad through
// that node. It trades compute for memory: what the tape holds for the
// region between forward and backward is its inputs and outputs (and what
// WithKeepOps keeps), not every intermediate result (see ActivationBytes).
//
// The node's inputs are inputs plus every value that requires grad that
// fn's ops read and that fn did not make: parameter leaves, and values
// computed before the region that fn captures. During Backward, when the
// walk reaches the node, fn runs again with recording on (Recomputing
// reports true meanwhile) on the same inputs, and a nested walk
// differentiates the recomputed ops: it continues the gradients the walk
// has pending for the inputs, accumulates into the leaves' Grad directly
// and hands the inputs' gradients back to the walk. Gradients are the same
// bit for bit as without checkpointing, since the same kernels run on the
// same values in the same order. A leaf's OnGradReady hooks fire once per
// Backward as always: after the backward of its earliest consumer, which
// for a leaf read inside the region is the checkpoint node. Checkpoints
// nest (an inner region is then recomputed when the outer one's
// recomputation is differentiated), and fn may communicate (Redistribute,
// tensor and sequence parallelism), since every rank recomputes at the
// same point of its walk.
//
// On a tape made WithRecycling the memory of the results fn's ops made in
// the forward, other than fn's results and what WithKeepOps kept, goes back to
// the tape as soon as fn returns, and everything the recomputation and
// its walk took from the tape's arena goes back when the node's backward
// is over (except the gradients handed on): values made inside fn must not
// be used outside it, and a Custom op or hook inside fn must not keep a
// ResultBlock or ScratchBlock beyond the region.
//
// fn must run the same ops, with the same results' specs, each time: the
// recomputation checks the ops' number, names and specs (and the kept
// results') against the forward's and fails Backward with ErrInvalid on a
// mismatch. Under NoGrad, inside a gradient hook or inside the forward of
// an enclosing checkpoint (recording off), Checkpoint just runs fn. When
// nothing fn reads requires grad, its results are returned as they are.
// Errors: ErrInvalid for no inputs, a nil fn or input, inputs of several
// tapes, results that are nil or of another tape; fn's errors are returned
// wrapped.
func Checkpoint(ctx context.Context, inputs []*Value, fn CheckpointFunc, opts ...CheckpointOption) ([]*Value, error) {
	const op = "Checkpoint"
	if fn == nil {
		return nil, invalidf(op, "nil function")
	}
	if len(inputs) == 0 {
		return nil, invalidf(op, "no inputs; a checkpoint needs at least one to know its tape")
	}
	t, err := checkInputs(op, inputs...)
	if err != nil {
		return nil, err
	}
	t.opStart = time.Time{} // not an op: the region's ops time themselves
	var cfg checkpointConfig
	for _, o := range opts {
		o(&cfg)
	}
	if !t.recording() {
		return fn(ctx, inputs)
	}
	in := slices.Clone(inputs)
	f := &frame{keep: cfg.keep, kept: map[int]*keptOp{}, seen: map[*Value]bool{}}
	t.frames = append(t.frames, f)
	t.noGrad++
	outs, err := fn(ctx, in)
	t.noGrad--
	t.frames = t.frames[:len(t.frames)-1]
	if err != nil {
		return nil, fmt.Errorf("autograd: Checkpoint: %w", err)
	}
	if f.err != nil {
		return nil, f.err
	}
	if err := checkResults(t, outs); err != nil {
		return nil, err
	}
	// The node's inputs: the given ones, then what else the region read.
	nodeIns := slices.Clone(in)
	unique := make([]bool, 0, len(in)+len(f.touched))
	first := map[*Value]bool{}
	for _, v := range in {
		unique = append(unique, !first[v])
		first[v] = true
	}
	for _, v := range f.touched {
		if !first[v] {
			first[v] = true
			nodeIns = append(nodeIns, v)
			unique = append(unique, true)
		}
	}
	if !slices.ContainsFunc(nodeIns, (*Value).RequiresGrad) {
		return outs, nil
	}
	c := &checkpoint{t: t, fn: fn, in: in, sigs: f.sigs, kept: f.kept, unique: unique}
	n := &node{op: op, inputs: nodeIns, index: len(t.nodes), gen: t.gen, multi: c.backward}
	res := make([]*Value, len(outs))
	for j, o := range outs {
		v := &Value{tape: t, data: o.data, name: op, requiresGrad: true, node: n}
		if t.recycling {
			t.results = append(t.results, v)
		}
		res[j] = v
		t.hold(n, o.data)
	}
	n.out, n.outs, c.node = res[0], res, n
	for _, v := range nodeIns {
		if !v.leaf {
			t.hold(n, v.data)
		}
	}
	for _, k := range f.kept {
		t.hold(n, k.out, k.aux)
	}
	t.nodes = append(t.nodes, n)
	if t.recycling {
		c.releaseForward(f.made, outs)
	}
	return res, nil
}

// checkResults checks a region's results: at least one, none nil, all on
// t and not recycled.
func checkResults(t *Tape, outs []*Value) error {
	if len(outs) == 0 {
		return invalidf("Checkpoint", "the function returned no values")
	}
	for j, o := range outs {
		if o == nil || o.data == nil || o.recycled {
			return invalidf("Checkpoint", "the function's result %d is nil or recycled", j)
		}
		if o.tape != t {
			return invalidf("Checkpoint", "the function's result %d (%q) is on another tape", j, o.name)
		}
	}
	return nil
}

// releaseForward gives the tape back the blocks of the results the
// region's ops made in its forward (made), except those sharing memory
// with the region's results or with what was kept; those values are
// marked recycled.
func (c *checkpoint) releaseForward(made, outs []*Value) {
	var keep []*placement.DTensor
	for _, o := range outs {
		keep = append(keep, o.data)
	}
	var keepAux []span
	for _, k := range c.kept {
		keep = append(keep, k.out)
		if b, ok := heldOf(k.aux); ok {
			keepAux = append(keepAux, b.span())
		}
	}
	for _, v := range made {
		s, ok := spanOf(v.data)
		if !ok || overlapsAny(s, keep) || slices.ContainsFunc(keepAux, s.overlaps) {
			continue
		}
		if c.t.arena.giveBack(s) {
			v.data, v.recycled = nil, true
		}
	}
}

// backward is the checkpoint node's backward: it recomputes the region
// and walks it with the output gradients gs.
func (c *checkpoint) backward(ctx context.Context, gs []*placement.DTensor) ([]*placement.DTensor, error) {
	t := c.t
	parent := t.walk
	if parent == nil {
		return nil, fmt.Errorf("autograd: Checkpoint: internal: backward outside a walk")
	}
	// From here on the node holds only what the recomputation reuses: its
	// outputs are no longer needed (the walk has their gradients), and its
	// inputs are held by the ops that made them.
	t.unhold(c.node)
	for _, k := range c.kept {
		t.hold(c.node, k.out, k.aux)
	}
	f := &frame{recompute: true, sigs: c.sigs, kept: c.kept}
	savedNodes, savedFrames, savedNoGrad := t.nodes, t.frames, t.noGrad
	t.nodes, t.frames, t.noGrad = nil, []*frame{f}, 0
	t.walking = false
	t.recomputing++
	t.arena.track()
	var grads []*placement.DTensor
	defer func() { t.arena.untrack(grads) }()
	outs, err := c.fn(ctx, c.in)
	t.recomputing--
	t.walking = true
	inner := t.nodes
	t.nodes, t.frames, t.noGrad = savedNodes, savedFrames, savedNoGrad
	if err != nil {
		return nil, fmt.Errorf("autograd: Checkpoint: recomputing: %w", err)
	}
	if f.err != nil {
		return nil, f.err
	}
	if f.n != len(c.sigs) {
		return nil, invalidf("Checkpoint", "recomputing the region ran %d ops, its forward %d: the checkpointed function must run the same ops each time", f.n, len(c.sigs))
	}
	if err := checkResults(t, outs); err != nil {
		return nil, err
	}
	if len(outs) != len(c.node.outs) {
		return nil, invalidf("Checkpoint", "recomputing the region returned %d values, its forward %d", len(outs), len(c.node.outs))
	}
	w := &walker{t: t, nodes: inner, pending: map[*Value]*placement.DTensor{}, got: parent.got, parent: parent}
	for _, g := range gs {
		if g != nil {
			w.seeds = append(w.seeds, g)
		}
	}
	for j, o := range outs {
		if !o.Spec().Equal(c.node.outs[j].Spec()) {
			return nil, invalidf("Checkpoint", "recomputing the region gave result %d as %v, its forward as %v", j, o.Spec(), c.node.outs[j].Spec())
		}
		g := gs[j]
		if g == nil || !o.requiresGrad {
			continue
		}
		if o.leaf {
			if err := t.accumulateLeaf(ctx, o, g); err != nil {
				return nil, err
			}
			w.got[o] = true
			continue
		}
		if err := w.add(ctx, o, g); err != nil {
			return nil, err
		}
	}
	// The walk continues the gradients it has pending for the inputs, so
	// that they are accumulated in the order they would be without the
	// checkpoint.
	for _, in := range c.node.inputs {
		if in.leaf || !in.requiresGrad {
			continue
		}
		if pg, ok := parent.pending[in]; ok {
			delete(parent.pending, in)
			if err := w.add(ctx, in, pg); err != nil {
				return nil, err
			}
		}
	}
	if err := w.run(ctx); err != nil {
		return nil, err
	}
	grads = make([]*placement.DTensor, len(c.node.inputs))
	for j, in := range c.node.inputs {
		if c.unique[j] && !in.leaf && in.requiresGrad {
			grads[j] = w.pending[in]
		}
	}
	c.releaseKept(grads)
	return grads, nil
}

// add accumulates g into v's pending gradient.
func (w *walker) add(ctx context.Context, v *Value, g *placement.DTensor) error {
	prev := w.pending[v]
	if prev == nil {
		w.pending[v] = g
		return nil
	}
	acc, err := w.t.accumulate(ctx, v.name, prev, g, true)
	if err != nil {
		return err
	}
	w.pending[v] = acc
	return nil
}

// releaseKept gives the tape back what the first forward kept, once the
// recomputation has used it, except blocks shared with the region's
// results (which may be in use downstream) or with the gradients handed
// on.
func (c *checkpoint) releaseKept(grads []*placement.DTensor) {
	keep := slices.Clone(grads)
	for _, o := range c.node.outs {
		keep = append(keep, o.data)
	}
	for _, k := range c.kept {
		for _, x := range []any{k.out, k.aux} {
			b, ok := heldOf(x)
			if !ok {
				continue
			}
			s := b.span()
			if !overlapsAny(s, keep) {
				c.t.arena.giveBack(s)
			}
		}
	}
	c.kept = nil
}
