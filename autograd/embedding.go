package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Embedding lookup and cross-entropy: the two ops that take integer
// Indices, with their sharding rules (vocab-parallel tables and logits
// included) and local kernels.

// Embedding returns the rows of table [V, D] selected by ids (shape S): a
// result of shape S + [D]. Sharding rule: EmbeddingRule: the result is
// laid out like the ids, Partial(sum) on the axes where the table is
// vocab parallel (Shard(0): each rank looks up only the ids in its vocab
// range and writes zero rows for the others, with no communication), and
// sharded on its last dim where the table is Shard(1). Every id must lie
// in [0, V) (ErrInvalid otherwise), whichever rank's range holds it.
//
// Backward scatter-adds the gradient's rows into a zero table gradient
// (rows no id selects get exactly 0), laid out per mesh axis (table, ids):
//
//	(R, R)     like g
//	(R, S(d))  P(sum)   each rank adds its ids' rows
//	(S(0), R)  S(0)     each rank's vocab rows only; g must be R there
//	(S(1), R)  S(1)     each rank's columns
//
// On a vocab-parallel axis the gradient must arrive Replicate (as the
// backward of the caller's all-reduce leaves it); a Partial or sharded
// gradient there fails with ErrGradPlacement, since the table rows a rank
// owns need every position's gradient.
func Embedding(table *Value, ids *Indices) (*Value, error) {
	const op = "Embedding"
	t, err := checkInputs(op, table)
	if err != nil {
		return nil, err
	}
	spec, err := EmbeddingRule(table.Spec(), ids)
	if err != nil {
		return nil, err
	}
	v := table.Spec().Shape()[0]
	if err := checkIDs(op, ids.data, v, "id %d out of range for a table of %d rows"); err != nil {
		return nil, err
	}
	if d, ok := onDevice(table.data); ok {
		return embeddingDev(t, d, spec, table, ids)
	}
	if isF32(spec) {
		return embeddingOp[float32](t, spec, table, ids)
	}
	return embeddingOp[float64](t, spec, table, ids)
}

// EmbeddingRule is the sharding rule of Embedding for a table [V, D] and
// ids of shape S; the result has shape S + [D]. Per mesh axis (table,
// ids) -> result:
//
//	(R, R)     -> R
//	(R, S(d))  -> S(d)       ids sharded (batch, sequence): rows follow the ids
//	(S(0), R)  -> P(sum)     vocab parallel (Megatron's VocabParallelEmbedding)
//	(S(1), R)  -> S(len(S))  embedding dim sharded: each rank holds its columns
//
// On a vocab-parallel axis each rank looks up only the ids in its vocab
// range [lo, hi) (its block of table rows, torch.chunk rule, so uneven and
// empty ranges are exact) and writes zero rows for the others, so the
// ranks' results sum to the lookup: the result is Partial(sum) and the
// caller redistributes it (all-reduce to Replicate, or reduce-scatter to
// a sequence-sharded layout); nothing is communicated here. Ids sharded
// by an axis in the result keep their shard order; the result's last dim
// is sharded by the axes sharding table dim 1, in the table's order.
//
// Errors (ErrRule): a Partial or Routed table, and ids sharded on an axis
// that also shards the table (each rank would hold only some ids and only
// some of the table; make the ids Replicate there, or the table). Shapes
// and meshes are ErrInvalid.
func EmbeddingRule(table *placement.Spec, ids *Indices) (*placement.Spec, error) {
	const op = "Embedding"
	if table == nil || ids == nil || ids.spec == nil {
		return nil, invalidf(op, "nil table or ids")
	}
	if err := sameMeshes(op, table, ids.spec); err != nil {
		return nil, err
	}
	if len(table.Shape()) != 2 {
		return nil, invalidf(op, "the table must be [V, D]; got shape %v", table.Shape())
	}
	sIDs := ids.spec.Shape()
	last := len(sIDs)
	names := table.Mesh().Names()
	pt, pi := table.Placements(), ids.spec.Placements()
	places := make([]placement.Placement, len(pt))
	for ax, p := range pt {
		switch {
		case p.IsReplicate():
			places[ax] = pi[ax]
		case p.IsShard() && pi[ax].IsShard():
			return nil, rulef(op, "the table is %v and the ids are %v on mesh axis %q: ids sharded on the same axis as the table; make the ids R there (vocab or embedding-dim parallel: every rank looks up every id) or the table R there", p, pi[ax], names[ax])
		case p.IsShard() && p.Dim() == 0:
			places[ax] = placement.Partial(comm.Sum)
		case p.IsShard():
			places[ax] = placement.Shard(last)
		default:
			return nil, rulef(op, "the table is %v on mesh axis %q; it must be R, S(0) (vocab parallel) or S(1) (embedding dim sharded) there: redistribute it first", p, names[ax])
		}
	}
	orders := ordersOf(ids.spec)
	orders[last] = table.Order(1)
	out, err := specWith(table, append(sIDs, table.Shape()[1]), places, orders)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, nil
}

func embeddingOp[T float](t *Tape, spec *placement.Spec, table *Value, ids *Indices) (*Value, error) {
	const op = "Embedding"
	td, err := dataOf[T](table.data)
	if err != nil {
		return nil, err
	}
	ts := table.Spec()
	// This rank's block of the table: rows [lo, lo+vl), dl columns.
	off, _, err := ts.Box(ts.Mesh().Rank())
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	lb := table.data.LocalShape()
	lo, vl, dl := off[0], lb[0], lb[1]
	if len(td) != vl*dl || len(ids.data)*dl != prod(spec.LocalShape()) {
		return nil, fmt.Errorf("autograd: %s: internal: table block %v and %d local ids for a result block %v", op, lb, len(ids.data), spec.LocalShape())
	}
	od := resultBlock[T](t, len(ids.data)*dl)
	if err := kernels.EmbeddingForward(od, td, ids.data, lo, dl); err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	out, err := placement.NewLocal(spec, od)
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{table}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, s, err := embeddingGradSpec(ctx, t, spec, ts, ids, g)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		if len(gd) != len(ids.data)*dl {
			return nil, fmt.Errorf("autograd: %s: internal: gradient block %v for %d local ids of %d columns", op, g.LocalShape(), len(ids.data), dl)
		}
		dt, err := embedBwd(t, gd, ids.data, lo, vl, dl)
		if err != nil {
			return nil, err
		}
		gt, err := placement.NewLocal(s, dt)
		return []*placement.DTensor{gt}, err
	}), nil
}

// embeddingGradSpec aligns Embedding's incoming gradient g to the
// result's spec and returns it with the table gradient's spec.
func embeddingGradSpec(ctx context.Context, t *Tape, spec, ts *placement.Spec, ids *Indices, g *placement.DTensor) (*placement.DTensor, *placement.Spec, error) {
	const op = "Embedding"
	g, err := t.alignGrad(ctx, op, g, spec)
	if err != nil {
		return nil, nil, err
	}
	names := ts.Mesh().Names()
	pg := g.Spec().Placements()
	places := reducedOver(ids.spec, pg)
	for ax, p := range ts.Placements() {
		if !p.IsShard() {
			continue
		}
		if p.Dim() == 0 && !pg[ax].IsReplicate() {
			return nil, nil, gradPlacementf(op, "the gradient of the result arrives as %v on mesh axis %q, where the table is vocab parallel (%v); it must be R there (an all-reduce first, e.g. the backward of redistributing the result to R), and autograd inserts no communication", pg[ax], names[ax], p)
		}
		places[ax] = p
	}
	s, err := gradSpec(ts, places)
	if err != nil {
		return nil, nil, err
	}
	return g, s, nil
}

// embedBwd is kernels.EmbeddingBackward into a [vl, d] table-block
// gradient in t's arena; float32 accumulates in a float64 arena buffer.
func embedBwd[T float](t *Tape, g []T, ids []int64, lo, vl, d int) ([]T, error) {
	var acc []float64
	if _, ok := as32(g); ok {
		acc = getBuf[float64](t, vl*d)
		defer putBuf(t, acc)
	}
	out := getBuf[T](t, vl*d)
	if err := kernels.EmbeddingBackward(out, acc, g, ids, lo, d); err != nil {
		return nil, fmt.Errorf("autograd: Embedding: internal: %w", err)
	}
	return out, nil
}

// checkIDs rejects indices outside [0, n); format reports the first one
// and n (two %d verbs).
func checkIDs(op string, ids []int64, n int, format string) error {
	for _, id := range ids {
		if id < 0 || id >= int64(n) {
			return invalidf(op, format, id, n)
		}
	}
	return nil
}

// CrossEntropy returns the mean over all N rows of logsumexp(logits_r) −
// logits_r[targets_r] (natural log) for logits [N, V] and targets [N], or
// for logits [..., V] and targets [...] (N the product of the leading
// dims: [B, T, V] logits whose T is sharded, as context parallelism lays
// them out, need no reshape).
// Sharding rule: CrossEntropyRule: the result is a scalar that is
// Partial(sum) on the axes sharding the rows (each rank contributes its
// rows' sum divided by the global N) and Replicate elsewhere. Every target
// must lie in [0, V). Backward: g·(softmax − onehot)/N, sharded like the
// logits' rows; the gradient must arrive Replicate on the row-sharded axes
// (as the default seed does) and is laid out like g elsewhere.
func CrossEntropy(logits *Value, targets *Indices) (*Value, error) {
	const op = "CrossEntropy"
	t, err := checkInputs(op, logits)
	if err != nil {
		return nil, err
	}
	spec, err := CrossEntropyRule(logits.Spec(), targets)
	if err != nil {
		return nil, err
	}
	_, v := ceRows(logits.Spec())
	if err := checkIDs(op, targets.data, v, "target %d out of range for %d classes"); err != nil {
		return nil, err
	}
	if d, ok := onDevice(logits.data); ok {
		return crossEntropyDev(t, d, spec, logits, targets)
	}
	if isF32(spec) {
		return crossEntropyOp[float32](t, spec, logits, targets)
	}
	return crossEntropyOp[float64](t, spec, logits, targets)
}

// CrossEntropyRule is the sharding rule of CrossEntropy for logits [N, V]
// and targets [N] (or logits [..., V] and targets [...]): logits have no
// Partial placement and are not sharded on V ("cross entropy over a
// sharded vocab dim"); the targets must be laid out exactly like the
// logits' leading dims (the same placements on every axis, the same
// shard order of every dim). The result is a scalar (shape []) that is
// Partial(sum) on the axes that shard the rows (each rank contributes its
// rows' sum divided by N) and Replicate elsewhere.
func CrossEntropyRule(logits *placement.Spec, targets *Indices) (*placement.Spec, error) {
	const op = "CrossEntropy"
	if logits == nil || targets == nil || targets.spec == nil {
		return nil, invalidf(op, "nil logits or targets")
	}
	if err := sameMeshes(op, logits, targets.spec); err != nil {
		return nil, err
	}
	sl, st := logits.Shape(), targets.spec.Shape()
	r := len(sl)
	if r < 2 || !slices.Equal(st, sl[:r-1]) {
		return nil, invalidf(op, "want logits [N, V] and targets [N] (or [..., V] and [...]); got %v and %v", sl, st)
	}
	if err := nonPartial(op, "logits", logits); err != nil {
		return nil, err
	}
	if o := logits.Order(r - 1); len(o) > 0 {
		return nil, rulef(op, "cross entropy over a sharded vocab dim: the logits are sharded on dim %d by mesh axes %v; redistribute it to Replicate first (or use tp.VocabParallelCrossEntropy)", r-1, o)
	}
	names := logits.Mesh().Names()
	pl, pt := logits.Placements(), targets.spec.Placements()
	out := make([]placement.Placement, len(pl))
	for ax := range pl {
		if pl[ax] != pt[ax] {
			return nil, rulef(op, "the logits are %v but the targets are %v on mesh axis %q; the targets must be sharded exactly like the logits' rows (use %v for the targets)", pl[ax], pt[ax], names[ax], pl[ax])
		}
		out[ax] = pl[ax]
		if pl[ax].IsShard() {
			out[ax] = placement.Partial(comm.Sum)
		}
	}
	for d := range r - 1 {
		if !slices.Equal(logits.Order(d), targets.spec.Order(d)) {
			return nil, rulef(op, "dim %d is sharded over mesh axes %v in the logits but %v in the targets; they must match", d, logits.Order(d), targets.spec.Order(d))
		}
	}
	s, err := specWith(logits, []int{}, out, nil)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return s, nil
}

// ceRows is the row count N (the product of the leading dims) and the
// class count V (the last dim) of CrossEntropy's logits.
func ceRows(logits *placement.Spec) (n, v int) {
	sh := logits.Shape()
	return prod(sh[:len(sh)-1]), sh[len(sh)-1]
}

func crossEntropyOp[T float](t *Tape, spec *placement.Spec, logits *Value, targets *Indices) (*Value, error) {
	const op = "CrossEntropy"
	ls := logits.Spec()
	n, v := ceRows(ls)
	xd, err := dataOf[T](logits.data)
	if err != nil {
		return nil, err
	}
	if len(xd) != len(targets.data)*v {
		return nil, fmt.Errorf("autograd: %s: internal: logits block %v for %d local targets", op, logits.data.LocalShape(), len(targets.data))
	}
	loss, saved, err := ceForward(t, t.records(logits), xd, targets.data, v, n)
	if err != nil {
		return nil, err
	}
	out, err := placement.NewLocal(spec, []T{loss})
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{logits}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, s, err := crossEntropyGradSpec(ctx, t, spec, ls, g)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		if len(gd) != 1 {
			return nil, fmt.Errorf("autograd: %s: internal: scalar gradient block of %d", op, len(gd))
		}
		dx, err := ceBackward(t, xd, targets.data, saved, v, n, float64(gd[0]))
		if err != nil {
			return nil, err
		}
		gx, err := placement.NewLocal(s, dx)
		return []*placement.DTensor{gx}, err
	}), nil
}

// crossEntropyGradSpec aligns CrossEntropy's incoming gradient g to the
// loss's spec and returns it with the logits gradient's spec.
func crossEntropyGradSpec(ctx context.Context, t *Tape, spec, ls *placement.Spec, g *placement.DTensor) (*placement.DTensor, *placement.Spec, error) {
	const op = "CrossEntropy"
	g, err := t.alignGrad(ctx, op, g, spec)
	if err != nil {
		return nil, nil, err
	}
	names := ls.Mesh().Names()
	pg := g.Spec().Placements()
	places := make([]placement.Placement, len(pg))
	for ax, p := range ls.Placements() {
		if p.IsShard() {
			if !pg[ax].IsReplicate() {
				return nil, nil, gradPlacementf(op, "the gradient of the loss arrives as %v on mesh axis %q, where the rows are %v; it must be R there (an all-reduce first), and autograd inserts no communication", pg[ax], names[ax], p)
			}
			places[ax] = p
		} else {
			places[ax] = pg[ax]
		}
	}
	s, err := gradSpec(ls, places)
	if err != nil {
		return nil, nil, err
	}
	return g, s, nil
}

// ceSaved is what CrossEntropy's backward needs: each local row's
// logsumexp (float32), or the softmax of every row (float64).
type ceSaved struct {
	lse []float64
	sm  []float64
}

// ceForward returns Σ_rows (logsumexp(x_r) − x_r[t_r]) / n over the local
// rows of an [rows, v] block.
func ceForward[T float](t *Tape, rec bool, x []T, tg []int64, v, n int) (T, ceSaved, error) {
	if x32, ok := as32(x); ok {
		var s ceSaved
		if rec {
			s.lse = getBuf[float64](t, len(tg))
		}
		total, err := kernels.CrossEntropyRows(t.Workers(), s.lse, x32, tg, v)
		if err != nil {
			return 0, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return T(total / float64(n)), s, nil
	}
	sm := make([]float64, len(x))
	total, err := kernels.CrossEntropy64(sm, x, tg, v)
	if err != nil {
		return 0, ceSaved{}, fmt.Errorf("autograd: internal: %w", err)
	}
	return T(total / float64(n)), ceSaved{sm: sm}, nil
}

// ceBackward is g·(softmax − onehot(t))/n, in t's arena for float32.
func ceBackward[T float](t *Tape, x []T, tg []int64, s ceSaved, v, n int, g float64) ([]T, error) {
	if x32, ok := as32(x); ok {
		dx := getBuf[float32](t, len(x32))
		if err := kernels.CrossEntropyRowsBackward(t.Workers(), dx, x32, tg, s.lse, v, g/float64(n)); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	dx := make([]T, len(s.sm))
	if err := kernels.CrossEntropy64Backward(dx, s.sm, tg, v, g/float64(n)); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return dx, nil
}
