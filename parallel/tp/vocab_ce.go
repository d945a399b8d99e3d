package tp

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/parallel/internal/blocks"
	"github.com/b7ea7098/loom/placement"
)

// VocabParallelCrossEntropy is autograd.CrossEntropy for logits [N, V]
// (or [..., V], N the product of the leading dims, as context parallelism
// keeps [B, T, V] with T sharded) whose vocab dim is sharded on the mesh
// axis named axis, as a colwise output projection or a tied
// vocab-parallel embedding leaves them; the logits are never gathered (Megatron's
// vocab_parallel_cross_entropy). It returns the mean over the N rows of
// logsumexp(logits_r) − logits_r[targets_r] (natural log), a scalar laid
// out like autograd.CrossEntropy's: Partial(sum) on the axes that shard
// the rows (each rank contributes its rows' sum divided by the global N)
// and Replicate elsewhere, axis included.
//
// Layout: on axis the logits are Shard of the vocab (last) dim (uneven
// and empty vocab shards are fine) and no other axis shards it; elsewhere
// they are Replicate or Shard of a leading dim (rows, e.g. data or
// context parallelism), never Partial. The targets [N] (or [...]) are
// laid out like the logits' leading dims: sharded on the same axes in the
// same order, Replicate elsewhere (axis included). Every target must
// lie in [0, V).
//
// Communication, over axis only, per row: an all-reduce(max) of the local
// maxima (a constant: the loss does not depend on the shift), then one
// all-reduce(sum) of [N_local, 2] pairs: Σ exp(x − max) over the local
// vocab slice, and the target's logit on the rank whose slice holds it (0
// on the others). The loss is then log(sumexp) + max − target on every
// rank of axis. Backward is local: g·(softmax − onehot)/N on each rank's
// vocab slice, laid out like the logits.
//
// It is built from public autograd pieces, since an op's local function
// may not communicate (autograd.LocalFunc): a LocalFunc computing the
// pairs (Partial(sum) on axis), an explicit autograd.Redistribute to
// Replicate (the all-reduce; its backward, with the Replicate gradient the
// next op produces, is the identity) and a LocalFunc for the loss. The
// max is computed outside the tape. The incoming gradient of the loss must
// be Replicate on the row-sharded axes, as the default Backward seed is.
//
// Logits on a device (not the host) are copied to the host for the
// arithmetic above and the loss copied back (autograd.To, both
// differentiable): the result and the gradient are on the logits' device
// and bit for bit the host's.
//
// Every rank of the mesh calls it with the same layouts (it is
// collective over axis). Errors wrap ErrInvalid (and autograd.ErrRule
// for placements) and are returned before any communication; collective
// failures are wrapped with context.
func VocabParallelCrossEntropy(ctx context.Context, logits *autograd.Value, targets *autograd.Indices, axis string) (*autograd.Value, error) {
	if logits == nil || logits.Spec() == nil || targets == nil {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: nil logits or targets", ErrInvalid)
	}
	ls := logits.Spec()
	m := ls.Mesh()
	shape := ls.Shape()
	if len(shape) < 2 {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: want logits [N, V] or [..., V]; got %v", ErrInvalid, shape)
	}
	vd := len(shape) - 1 // the vocab dim
	names := m.Names()
	ax := slices.Index(names, axis)
	if ax < 0 {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: mesh %v has no axis %q", ErrInvalid, m, axis)
	}
	places := ls.Placements()
	if places[ax] != placement.Shard(vd) {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w: the logits are %v on mesh axis %q; they must be S(%d) (vocab sharded) there: use autograd.CrossEntropy for logits with a whole vocab dim", ErrInvalid, autograd.ErrRule, places[ax], axis, vd)
	}
	if o := ls.Order(vd); len(o) != 1 {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w: the vocab dim is sharded over mesh axes %v; only %q may shard it", ErrInvalid, autograd.ErrRule, o, axis)
	}
	for a, p := range places {
		if p.IsPartial() {
			return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w: the logits are %v on mesh axis %q; cross entropy is nonlinear: redistribute them to Replicate or Shard first", ErrInvalid, autograd.ErrRule, p, names[a])
		}
	}
	// The rows' layout must be in mesh-axis order: the local functions
	// below lay their outputs out that way.
	for d := range vd {
		rowAxes := ls.Order(d)
		if !slices.IsSortedFunc(rowAxes, func(a, b string) int { return slices.Index(names, a) - slices.Index(names, b) }) {
			return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w: dim %d is sharded over mesh axes %v, not in mesh order; redistribute it to mesh order first", ErrInvalid, autograd.ErrRule, d, rowAxes)
		}
	}
	// The same layout with a whole vocab dim: CrossEntropyRule checks the
	// targets against it and gives the loss's layout.
	rows := slices.Clone(places)
	rows[ax] = placement.Replicate()
	whole, err := ls.With(rows)
	if err != nil {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w", ErrInvalid, err)
	}
	lossSpec, err := autograd.CrossEntropyRule(whole, targets)
	if err != nil {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w", ErrInvalid, err)
	}
	tg := targets.Local()
	for _, t := range tg {
		if t < 0 || t >= int64(shape[vd]) {
			return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: target %d out of range for %d classes", ErrInvalid, t, shape[vd])
		}
	}
	// The first vocab index of this rank's slice (Positions, not Box: a
	// load-balanced row dim makes the block no box).
	vpos, err := ls.Positions(vd, m.Rank())
	if err != nil {
		return nil, fmt.Errorf("%w: VocabParallelCrossEntropy: %w", ErrInvalid, err)
	}
	vc := &vocabCE{
		ax: ax, axis: axis, lead: shape[:vd], lo: first(vpos), targets: tg,
		logits: places, rows: rows, loss: lossSpec.Placements(),
	}
	// Logits on a device go through a host copy of this rank's block (a
	// differentiable autograd.To each way): the same arithmetic as the
	// host's, so the loss and gradients are the host's bit for bit, at
	// the price of one copy of the local logits each way.
	dev := logits.Data().Device()
	if !blocks.OnHost(dev) {
		if logits, err = autograd.To(logits, device.Host()); err != nil {
			return nil, fmt.Errorf("tp: VocabParallelCrossEntropy: %w", err)
		}
	}
	var loss *autograd.Value
	if ls.DType() == comm.Float32 {
		loss, err = vocabCEOp[float32](ctx, vc, logits)
	} else {
		loss, err = vocabCEOp[float64](ctx, vc, logits)
	}
	if err != nil || blocks.OnHost(dev) {
		return loss, err
	}
	if loss, err = autograd.To(loss, dev); err != nil {
		return nil, fmt.Errorf("tp: VocabParallelCrossEntropy: %w", err)
	}
	return loss, nil
}

// vocabCE holds one call's layout: the vocab axis (index and name), the
// global row count, this rank's first vocab index, its local targets and
// the placements of the logits, of their rows (Replicate on the vocab
// axis) and of the loss; the rows are the leading dims lead.
type vocabCE struct {
	ax                 int
	axis               string
	lead               []int
	lo                 int
	targets            []int64
	logits, rows, loss []placement.Placement
}

func vocabCEOp[T float32 | float64](ctx context.Context, vc *vocabCE, logits *autograd.Value) (*autograd.Value, error) {
	const op = "VocabParallelCrossEntropy"
	x, ok := logits.Data().LocalData().([]T)
	if !ok {
		return nil, fmt.Errorf("%w: %s: logits hold %T", ErrInvalid, op, logits.Data().LocalData())
	}
	nl := len(vc.targets)
	lb := logits.Data().LocalShape()
	vd := len(lb) - 1
	vl := lb[vd]
	pairShape := append(slices.Clone(lb[:vd]), 2) // the local pairs block
	rows := 1
	for _, d := range lb[:vd] {
		rows *= d
	}
	if rows != nl || len(x) != nl*vl {
		return nil, fmt.Errorf("%w: %s: logits block %v for %d local targets", ErrInvalid, op, lb, nl)
	}

	// The row maxima over the whole vocab: a constant of the loss. Buffers
	// come from the tape, which reuses them on the next pass.
	tape := logits.Tape()
	local := autograd.ScratchBlock[T](tape, nl)
	for r := range nl {
		mx := math.Inf(-1)
		for _, e := range x[r*vl : (r+1)*vl] {
			mx = max(mx, float64(e))
		}
		local[r] = T(mx)
	}
	c, err := logits.Spec().Mesh().Comm(ctx, vc.axis)
	if err != nil {
		return nil, fmt.Errorf("tp: %s: communicator of mesh axis %q: %w", op, vc.axis, err)
	}
	rmax := autograd.ScratchBlock[T](tape, nl)
	if err := comm.AllReduce(ctx, c, comm.Host(local), comm.Host(rmax), comm.Max); err != nil {
		return nil, fmt.Errorf("tp: %s: all-reduce(max) of the row maxima over %q: %w", op, vc.axis, err)
	}

	// Per row (Σ_k exp(x_k − max), x[target] or 0), Partial(sum) on axis.
	pairOut := slices.Clone(vc.rows)
	pairOut[vc.ax] = placement.Partial(comm.Sum)
	inRange := func(r int) (int, bool) {
		k := int(vc.targets[r]) - vc.lo
		return k, k >= 0 && k < vl
	}
	pairs := autograd.LocalFunc[T]{
		Name:     op + ".pairs",
		In:       [][]placement.Placement{vc.logits},
		GradIn:   [][]placement.Placement{vc.logits},
		Out:      pairOut,
		OutShape: append(slices.Clone(vc.lead), 2),
		GradOut:  vc.rows,
		Forward: func(in []autograd.Block[T]) (autograd.Block[T], error) {
			x := in[0].Data
			out := autograd.ResultBlock[T](tape, 2*nl)
			for r := range nl {
				s, err := expShiftRow(nil, x[r*vl:(r+1)*vl], float64(rmax[r]))
				if err != nil {
					return autograd.Block[T]{}, err
				}
				out[2*r], out[2*r+1] = T(s), 0
				if k, ok := inRange(r); ok {
					out[2*r+1] = x[r*vl+k]
				}
			}
			return autograd.Block[T]{Shape: pairShape, Data: out}, nil
		},
		Backward: func(g autograd.Block[T], in []autograd.Block[T], _ autograd.Block[T]) ([]autograd.Block[T], error) {
			x := in[0].Data
			dx := autograd.ScratchBlock[T](tape, len(x))
			for r := range nl {
				row := dx[r*vl : (r+1)*vl]
				if _, err := expShiftRow(row, x[r*vl:(r+1)*vl], float64(rmax[r])); err != nil {
					return nil, err
				}
				gs := float64(g.Data[2*r])
				for k, e := range row {
					row[k] = T(gs * float64(e))
				}
				if k, ok := inRange(r); ok {
					dx[r*vl+k] += g.Data[2*r+1]
				}
			}
			return []autograd.Block[T]{{Shape: slices.Clone(lb), Data: dx}}, nil
		},
	}
	p, err := pairs.Apply(logits)
	if err != nil {
		return nil, fmt.Errorf("tp: %s: %w", op, err)
	}
	full, err := p.Spec().With(vc.rows)
	if err != nil {
		return nil, fmt.Errorf("tp: %s: %w", op, err)
	}
	if p, err = autograd.Redistribute(ctx, p, full); err != nil {
		return nil, fmt.Errorf("tp: %s: all-reduce of the pairs over %q: %w", op, vc.axis, err)
	}

	// Σ_rows (log sumexp + max − target) / N.
	n := 1.0
	for _, d := range vc.lead {
		n *= float64(d)
	}
	rep := make([]placement.Placement, len(vc.rows))
	for a := range rep {
		rep[a] = placement.Replicate()
	}
	lossOf := autograd.LocalFunc[T]{
		Name:     op + ".loss",
		In:       [][]placement.Placement{vc.rows},
		GradIn:   [][]placement.Placement{vc.rows},
		Out:      vc.loss,
		OutShape: []int{},
		GradOut:  rep,
		Forward: func(in []autograd.Block[T]) (autograd.Block[T], error) {
			d := in[0].Data
			total := 0.0
			for r := range nl {
				total += math.Log(float64(d[2*r])) + float64(rmax[r]) - float64(d[2*r+1])
			}
			out := autograd.ResultBlock[T](tape, 1)
			out[0] = T(total / n)
			return autograd.Block[T]{Shape: []int{}, Data: out}, nil
		},
		Backward: func(g autograd.Block[T], in []autograd.Block[T], _ autograd.Block[T]) ([]autograd.Block[T], error) {
			d := in[0].Data
			c := float64(g.Data[0]) / n
			out := autograd.ScratchBlock[T](tape, 2*nl)
			for r := range nl {
				out[2*r] = T(c / float64(d[2*r]))
				out[2*r+1] = T(-c)
			}
			return []autograd.Block[T]{{Shape: pairShape, Data: out}}, nil
		},
	}
	loss, err := lossOf.Apply(p)
	if err != nil {
		return nil, fmt.Errorf("tp: %s: %w", op, err)
	}
	return loss, nil
}

// expShiftRow sets dst[i] = exp(src[i] − shift) (dst nil: not stored) and
// returns the sum, on the vectorised kernel for float32 rows.
func expShiftRow[T float32 | float64](dst, src []T, shift float64) (float64, error) {
	if s32, ok := any(src).([]float32); ok {
		d32, _ := any(dst).([]float32)
		return kernels.ExpShift(d32, s32, shift)
	}
	s := 0.0
	for i, v := range src {
		e := math.Exp(float64(v) - shift)
		if dst != nil {
			dst[i] = T(e)
		}
		s += e
	}
	return s, nil
}

// first is p[0], or 0 for an empty vocab slice (which has no rows to
// index).
func first(p []int) int {
	if len(p) == 0 {
		return 0
	}
	return p[0]
}
