package autograd

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Backward seeded from a stage boundary, and split in two (zero-bubble
// pipeline schedules run the halves at different times).
//
// The input half walks the scope's nodes as Backward does, but computes no
// gradient of a weight (a leaf that requires grad and is not among the
// given inputs): a node whose inputs needing grad are all weights is not
// run at all, and ops that compute their inputs' gradients separately
// (Linear, MatMul, BatchedMatMul, LayerNorm, Add, Mul: splitAware) leave
// the weights out. Both keep their output's gradient and saved values for
// the weight half, which runs their backward again for the weights alone.
// Other ops compute every gradient in the input half; the weights' are
// kept and added in by the weight half. Either way each leaf receives the
// same tensors in the same order as from Backward, so the sum is bit for
// bit the unsplit backward's.

// gradMode says which inputs' gradients a backward function computes.
type gradMode uint8

const (
	modeAll    gradMode = iota
	modeInput           // all but the weights
	modeWeight          // the weights only
)

// splitRun is the state of one split backward, from BackwardInput to
// BackwardWeight.
type splitRun struct {
	mode    gradMode
	inputs  map[*Value]bool // leaves whose gradients the input half computes
	entries []deferredOp    // in walk order
	// kept are the gradients entries hold: live, so that nothing frees or
	// updates their memory in place before the weight half.
	kept []*placement.DTensor
}

// deferredOp is the weight half's work for one node: run its backward
// again with g (rerun), or add the weight gradients it computed.
type deferredOp struct {
	index  int
	n      *node
	g      *placement.DTensor // the output's gradient, for a rerun
	leaves []*Value           // weights whose gradients were computed
	grads  []*placement.DTensor
}

// weight reports whether v is a weight for this split backward.
func (s *splitRun) weight(v *Value) bool {
	return v != nil && v.leaf && v.requiresGrad && !s.inputs[v]
}

// keeps reports whether the weight half reruns node n (so it keeps its
// saved values and output gradient).
func (s *splitRun) keeps(n *node) bool {
	k := len(s.entries) - 1
	return k >= 0 && s.entries[k].n == n && s.entries[k].g != nil
}

// before decides, ahead of node n's backward in the input half, whether
// the node waits for the weight half whole (every input that needs a
// gradient is a weight) or is run again there for its weights (a
// splitAware op with a weight input).
func (s *splitRun) before(i int, n *node, consumed []*placement.DTensor) (deferred bool, err error) {
	if n.outs != nil {
		return false, invalidf("BackwardInput", "op %d (%s) is a checkpointed region, which the split backward does not run: use BackwardFrom for this stage", i, n.op)
	}
	weights, others := false, false
	for _, in := range n.inputs {
		if s.weight(in) {
			weights = true
		} else if in.requiresGrad {
			others = true
		}
	}
	if !weights || (others && !n.split) {
		return false, nil
	}
	s.entries = append(s.entries, deferredOp{index: i, n: n, g: consumed[0]})
	s.kept = append(s.kept, consumed[0])
	return !others, nil
}

// stash keeps the gradient g of weight v that node n (op i) computed in
// the input half.
func (s *splitRun) stash(i int, n *node, v *Value, g *placement.DTensor) {
	k := len(s.entries) - 1
	if k < 0 || s.entries[k].n != n {
		s.entries = append(s.entries, deferredOp{index: i, n: n})
		k++
	}
	s.entries[k].leaves = append(s.entries[k].leaves, v)
	s.entries[k].grads = append(s.entries[k].grads, g)
	s.kept = append(s.kept, g)
}

// need reports whether a backward function computes v's gradient now:
// v requires grad and the split backward in progress (if any) wants it.
// Ops whose node is marked splitAware ask it at backward time.
func (t *Tape) need(v *Value) bool {
	if v == nil || !v.requiresGrad {
		return false
	}
	if s := t.split; s != nil {
		switch s.mode {
		case modeInput:
			return !s.weight(v)
		case modeWeight:
			return s.weight(v)
		}
	}
	return true
}

// splitAware marks v's node (if recorded) as computing each input's
// gradient only when need says so.
func splitAware(v *Value) *Value {
	if v != nil && v.node != nil {
		v.node.split = true
	}
	return v
}

// WeightGrads is the weight half of a split backward, returned by
// BackwardInput and run by BackwardWeight. It holds the output gradients
// and saved values of the ops it runs again, which count in the tape's
// ActivationBytes until it runs.
type WeightGrads struct {
	t     *Tape
	graph *Graph // the scope walked; nil for the default one
	gen   uint64
	run   *splitRun
	final [][]*Value
	got   map[*Value]bool
	done  bool
}

// Ops returns how many ops the weight half will run or add the gradients
// of.
func (w *WeightGrads) Ops() int {
	if w == nil || w.run == nil {
		return 0
	}
	return len(w.run.entries)
}

// BackwardFrom runs backward from outs, the outputs of a pipeline stage:
// grads[i] is the gradient of outs[i] (global shape, dtype and mesh of
// outs[i], on its device, in any layout the op that made it accepts: the
// gradient a later stage sent back), or nil when outs[i] is a scalar loss,
// which is seeded with ones as Backward seeds it. Gradients accumulate
// into every leaf that requires grad (parameters, and a stage's input
// leaves), as Backward's do; BackwardFrom(ctx, []*Value{loss}, nil) is
// Backward(ctx, loss). grads is not modified. The scope is cleared
// afterwards, as by Backward. Errors wrap ErrInvalid for bad arguments
// (refused before the walk starts, leaving the scope as it was), and are
// Backward's otherwise.
func (t *Tape) BackwardFrom(ctx context.Context, outs []*Value, grads []*placement.DTensor) error {
	const op = "BackwardFrom"
	if err := t.checkWalk(op, outs); err != nil {
		return err
	}
	seeds, err := t.seeds(op, outs, grads)
	if err != nil {
		return err
	}
	defer t.Reset()
	return t.walkFrom(ctx, outs, seeds, nil)
}

// BackwardInput is the first half of a split backward from outs (seeded
// as BackwardFrom seeds them): it accumulates the gradients of inputs
// (leaves of this tape that require grad: a stage's received activations)
// and of every value between them and outs, but of no other leaf (the
// weights). It returns the weight half, which BackwardWeight runs; the
// scope keeps what that needs and may record nothing until then (other
// Graphs may). Gradient-ready hooks of inputs fire here, of weights in
// BackwardWeight. A scope holding a checkpointed region is refused with
// ErrInvalid (its recomputation is not split). Bad arguments are refused
// with ErrInvalid before the walk, leaving the scope as it was; on an
// error of the walk the scope is cleared and no weight half remains.
func (t *Tape) BackwardInput(ctx context.Context, outs []*Value, grads []*placement.DTensor, inputs []*Value) (*WeightGrads, error) {
	const op = "BackwardInput"
	if err := t.checkWalk(op, outs); err != nil {
		return nil, err
	}
	run := &splitRun{mode: modeInput, inputs: map[*Value]bool{}}
	for i, in := range inputs {
		if in == nil || in.tape != t || !in.leaf || !in.requiresGrad {
			return nil, invalidf(op, "input %d is not a leaf of this tape that requires grad (make a stage's input with Tape.Param)", i)
		}
		run.inputs[in] = true
	}
	seeds, err := t.seeds(op, outs, grads)
	if err != nil {
		return nil, err
	}
	final := finalAt(t.nodes)
	if err := t.walkFrom(ctx, outs, seeds, run); err != nil {
		t.Reset()
		return nil, err
	}
	t.weights = true
	return &WeightGrads{t: t, graph: t.graphs.cur, gen: t.gen, run: run, final: final, got: map[*Value]bool{}}, nil
}

// BackwardWeight runs the weight half w of a split backward (from
// BackwardInput on this tape): it accumulates the weights' gradients, in
// the order Backward would, fires their gradient-ready hooks with ctx as
// each becomes final, and clears the scope BackwardInput walked (it
// switches to that scope itself, so it may run while another Graph is
// recording). It runs once; a second call, or one after the scope was
// Reset, fails with ErrInvalid.
func (t *Tape) BackwardWeight(ctx context.Context, w *WeightGrads) error {
	const op = "BackwardWeight"
	switch {
	case t == nil || w == nil:
		return invalidf(op, "nil tape or weight half")
	case w.t != t:
		return invalidf(op, "the weight half belongs to another tape")
	case w.done:
		return invalidf(op, "the weight half has already run")
	case t.walking || t.walk != nil || len(t.frames) > 0:
		return invalidf(op, "called during a backward walk or inside a checkpointed function")
	}
	w.done = true
	restore := t.use(w.graph)
	defer restore()
	if t.gen != w.gen || !t.weights {
		return invalidf(op, "the scope was cleared since BackwardInput")
	}
	defer func() {
		t.weights = false
		t.Reset()
	}()
	t.walking = true
	defer func() { t.walking = false }()
	w.run.mode = modeWeight
	t.split = w.run
	defer func() { t.split = nil }()
	next := len(w.final) - 1 // the next node whose final leaves may fire
	fireDown := func(to int) error {
		for ; next > to; next-- {
			for _, leaf := range w.final[next] {
				if w.got[leaf] && w.run.weight(leaf) {
					if err := fire(ctx, leaf); err != nil {
						return err
					}
				}
			}
		}
		return nil
	}
	for _, e := range w.run.entries {
		if err := fireDown(e.index); err != nil {
			return err
		}
		if err := w.apply(ctx, e); err != nil {
			return err
		}
		t.unhold(e.n)
	}
	return fireDown(-1)
}

// apply runs one deferred op: its backward again for the weights, or the
// weight gradients it computed.
func (w *WeightGrads) apply(ctx context.Context, e deferredOp) error {
	t := w.t
	if e.g == nil {
		for k, leaf := range e.leaves {
			if err := t.accumulateLeaf(ctx, leaf, e.grads[k]); err != nil {
				return err
			}
			w.got[leaf] = true
		}
		return nil
	}
	if t.trace != nil {
		t.trace("backward weights " + e.n.op)
	}
	var start time.Time
	if t.observe != nil {
		start = time.Now()
	}
	grads, err := e.n.back(ctx, e.g)
	if err != nil {
		return fmt.Errorf("autograd: weight backward of %s (op %d of the tape): %w", e.n.op, e.index, err)
	}
	if len(grads) != len(e.n.inputs) {
		return fmt.Errorf("autograd: weight backward of %s returned %d gradients for %d inputs", e.n.op, len(grads), len(e.n.inputs))
	}
	for j, in := range e.n.inputs {
		if grads[j] == nil || !w.run.weight(in) {
			continue
		}
		if err := t.accumulateLeaf(ctx, in, grads[j]); err != nil {
			return err
		}
		w.got[in] = true
	}
	if t.observe != nil {
		t.observe(e.n.op, PhaseBackward, start, time.Now())
	}
	return nil
}

// seeds checks grads against outs and returns the walk's seeds: grads[i],
// or ones for a scalar loss where grads[i] is nil (or grads is nil).
func (t *Tape) seeds(op string, outs []*Value, grads []*placement.DTensor) ([]*placement.DTensor, error) {
	if grads != nil && len(grads) != len(outs) {
		return nil, invalidf(op, "%d gradients for %d outputs", len(grads), len(outs))
	}
	seeds := make([]*placement.DTensor, len(outs))
	for i, out := range outs {
		var g *placement.DTensor
		if grads != nil {
			g = grads[i]
		}
		if g == nil {
			s, err := t.seedLoss(op, out)
			if err != nil {
				return nil, fmt.Errorf("%w (output %d has no gradient given, so it must be a loss)", err, i)
			}
			seeds[i] = s
			continue
		}
		os, gs := out.Spec(), g.Spec()
		if !slices.Equal(os.Shape(), gs.Shape()) || os.DType() != gs.DType() {
			return nil, invalidf(op, "the gradient of output %d (%q) is %v %v; the output is %v %v", i, out.name, gs.DType(), gs.Shape(), os.DType(), os.Shape())
		}
		if err := sameMeshes(op, os, gs); err != nil {
			return nil, err
		}
		if err := device.Same(op, out.data.Device(), g.Device()); err != nil {
			return nil, fmt.Errorf("autograd: %w (the gradient of output %d, %q): %w", err, i, out.name, ErrInvalid)
		}
		seeds[i] = g
	}
	return seeds, nil
}
