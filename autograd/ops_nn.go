package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Neural-network ops. Each computes on local blocks only (no op
// communicates), aligns the incoming gradient to its result's layout with
// alignGrad and lays every input gradient out explicitly, in the doc
// comment's per-axis tables.

// gradSpec is in's shape, dtype and shard orders with the given
// placements.
func gradSpec(in *placement.Spec, places []placement.Placement) (*placement.Spec, error) {
	return specWith(in, in.Shape(), places, ordersOf(in))
}

// reducedOver returns, per mesh axis, Partial(sum) where x is sharded (a
// gradient summed over x's local rows is partial there) and g's placement
// elsewhere: the layout of a parameter gradient accumulated over rows.
func reducedOver(x *placement.Spec, pg []placement.Placement) []placement.Placement {
	out := make([]placement.Placement, len(pg))
	for ax, p := range x.Placements() {
		if p.IsShard() {
			out[ax] = placement.Partial(comm.Sum)
		} else {
			out[ax] = pg[ax]
		}
	}
	return out
}

// Linear returns x·wᵀ + b for x [..., in], w [out, in] (PyTorch layout)
// and b [out] or nil. Sharding rule: LinearRule. Backward, per mesh axis
// (g is the result's gradient, aligned to the result's layout):
//
//	case                 dx       dw       db
//	(R, R, R)            like g   like g   like g
//	(S(d), R, R)         S(d)     P(sum)   P(sum)   data parallel
//	(R, S(0), S(0))      P(sum)   S(0)     S(0)     colwise
//	(S(last), S(1), R)   S(last)  S(1)     like g   rowwise; g must be R for dx, dw
//	(P(sum), R, R)       like g   P(sum)   like g   g must be R for dw
//
// On rowwise and P(sum)-x axes the bias is added only at coordinate 0, so
// the replicated bias's gradient is the full Σ_rows g on every rank (R)
// when g is R. A gradient that would need communication fails with
// ErrGradPlacement.
func Linear(x, w, b *Value) (*Value, error) {
	const op = "Linear"
	in := []*Value{x, w}
	if b != nil {
		in = append(in, b)
	}
	t, err := checkInputs(op, in...)
	if err != nil {
		return nil, err
	}
	var bs *placement.Spec
	if b != nil {
		bs = b.Spec()
	}
	spec, cases, err := linearRule(x.Spec(), w.Spec(), bs)
	if err != nil {
		return nil, err
	}
	if isF32(spec) {
		return linearOp[float32](t, spec, cases, x, w, b)
	}
	return linearOp[float64](t, spec, cases, x, w, b)
}

func linearOp[T float](t *Tape, spec *placement.Spec, cases []linearCase, x, w, b *Value) (*Value, error) {
	const op = "Linear"
	blas, err := t.blasOrDefault()
	if err != nil {
		return nil, err
	}
	xl, wl := x.data.LocalShape(), w.data.LocalShape()
	k := xl[len(xl)-1]
	if wl[1] != k {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v and %v do not chain", op, xl, wl)
	}
	m, n := prod(xl[:len(xl)-1]), wl[0]
	coord := spec.Mesh().Coord()
	addBias := b != nil
	for ax, c := range cases {
		if (c == linRow || c == linPartial) && coord[ax] != 0 {
			addBias = false
		}
	}
	var bd []T
	if addBias {
		if bd, err = dataOf[T](b.data); err != nil {
			return nil, err
		}
		if len(bd) != n {
			return nil, fmt.Errorf("autograd: %s: internal: bias block of %d for %d outputs", op, len(bd), n)
		}
	}
	y, err := gemmBias(t, blas, spec, x.data, w.data, bd, m, n, k)
	if err != nil {
		return nil, err
	}
	inputs := []*Value{x, w}
	if b != nil {
		inputs = append(inputs, b)
	}
	sx, sw := x.Spec(), w.Spec()
	xd, wd := x.data, w.data
	needX, needW, needB := x.requiresGrad, w.requiresGrad, b != nil && b.requiresGrad
	names := sx.Mesh().Names()
	return t.record(op, y, inputs, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		pg := g.Spec().Placements()
		sum := placement.Partial(comm.Sum)
		px, pw := sx.Placements(), sw.Placements()
		dx, dw, db := make([]placement.Placement, len(pg)), make([]placement.Placement, len(pg)), make([]placement.Placement, len(pg))
		var errX, errW error
		for ax, c := range cases {
			needR := func(which string) error {
				return gradPlacementf(op, "the gradient of the result arrives as %v on mesh axis %q, where x is %v and w is %v: d%s needs it all-reduced to R first, and autograd inserts no communication", pg[ax], names[ax], px[ax], pw[ax], which)
			}
			switch c {
			case linRep:
				dx[ax], dw[ax], db[ax] = pg[ax], pg[ax], pg[ax]
			case linData:
				dx[ax], dw[ax], db[ax] = px[ax], sum, sum
			case linCol:
				dx[ax], dw[ax], db[ax] = sum, pw[ax], pw[ax]
			case linRow:
				dx[ax], dw[ax], db[ax] = px[ax], pw[ax], pg[ax]
				if pg[ax].IsPartial() {
					errX, errW = cmp(errX, needR("x")), cmp(errW, needR("w"))
				}
			case linPartial:
				dx[ax], dw[ax], db[ax] = pg[ax], sum, pg[ax]
				if pg[ax].IsPartial() {
					errW = cmp(errW, needR("w"))
				}
			}
		}
		grads := make([]*placement.DTensor, len(inputs))
		if needX {
			if errX != nil {
				return nil, errX
			}
			s, err := gradSpec(sx, dx)
			if err != nil {
				return nil, err
			}
			if grads[0], err = gemm(t.scratch(), blas, s, g, wd, false, false, m, k, n); err != nil {
				return nil, err
			}
		}
		if needW {
			if errW != nil {
				return nil, errW
			}
			s, err := gradSpec(sw, dw)
			if err != nil {
				return nil, err
			}
			if grads[1], err = gemm(t.scratch(), blas, s, g, xd, true, false, n, k, m); err != nil {
				return nil, err
			}
		}
		if needB {
			s, err := gradSpec(b.Spec(), db)
			if err != nil {
				return nil, err
			}
			gd, err := dataOf[T](g)
			if err != nil {
				return nil, err
			}
			db, err := columnSums(t, gd, n)
			if err != nil {
				return nil, err
			}
			if grads[2], err = placement.NewLocal(s, db); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

// Permute returns x with its dims reordered: result dim i is input dim
// perm[i]. Sharding rule: PermuteRule (shards follow their dims; Partial
// is kept). Backward permutes the gradient back.
func Permute(x *Value, perm ...int) (*Value, error) {
	const op = "Permute"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, err := PermuteRule(x.Spec(), perm...)
	if err != nil {
		return nil, err
	}
	perm = slices.Clone(perm)
	inv := make([]int, len(perm))
	for i, p := range perm {
		inv[p] = i
	}
	out, err := permuteLocal(t.result(), spec, x.data, perm)
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		s, err := PermuteRule(g.Spec(), inv...)
		if err != nil {
			return nil, err
		}
		gx, err := permuteLocal(t.scratch(), s, g, inv)
		return []*placement.DTensor{gx}, err
	}), nil
}

// Transpose returns x with dims d0 and d1 swapped (negative dims count
// from the end). Sharding rule: TransposeRule. Backward swaps them back.
func Transpose(x *Value, d0, d1 int) (*Value, error) {
	if _, err := checkInputs("Transpose", x); err != nil {
		return nil, err
	}
	perm, err := transposePerm(len(x.Spec().Shape()), d0, d1)
	if err != nil {
		return nil, err
	}
	return Permute(x, perm...)
}

// permuteLocal permutes x's local block into a block as a says.
func permuteLocal(a alloc, spec *placement.Spec, x *placement.DTensor, perm []int) (*placement.DTensor, error) {
	shape := x.LocalShape()
	if isF32(spec) {
		d, err := dataOf[float32](x)
		if err != nil {
			return nil, err
		}
		return placement.NewLocal(spec, permuteT(block[float32](a, len(d)), d, shape, perm))
	}
	d, err := dataOf[float64](x)
	if err != nil {
		return nil, err
	}
	return placement.NewLocal(spec, permuteT(block[float64](a, len(d)), d, shape, perm))
}

// Reshape returns x with global shape shape (one entry may be -1). It
// moves no data: the rule (ReshapeRule) accepts only layouts where every
// rank's block keeps its row-major order, which rejects, with a message
// saying what to redistribute, sharded dims that merge with an outer dim
// or split unevenly. Backward reshapes the gradient back.
func Reshape(x *Value, shape ...int) (*Value, error) {
	const op = "Reshape"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, _, err := reshapeRule(x.Spec(), shape)
	if err != nil {
		return nil, err
	}
	out, err := placement.NewLocal(spec, x.data.LocalData())
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	old := x.Spec().Shape()
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		s, _, err := reshapeRule(g.Spec(), old)
		if err != nil {
			return nil, err
		}
		gx, err := placement.NewLocal(s, g.LocalData())
		return []*placement.DTensor{gx}, err
	}), nil
}

// GELU returns the exact GELU, 0.5·x·(1 + erf(x/√2)), element-wise.
// Sharding rule: GELURule (no Partial input). Backward: g·GELU'(x), laid
// out like g.
func GELU(x *Value) (*Value, error) {
	const op = "GELU"
	return elementwise(op, x, GELURule, geluOp[float32], geluOp[float64])
}

// elementwise checks a one-input op's input and rule and runs its float32
// or float64 form.
func elementwise(op string, x *Value, rule func(*placement.Spec) (*placement.Spec, error),
	f32, f64 func(*Tape, *placement.Spec, *Value) (*Value, error)) (*Value, error) {
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, err := rule(x.Spec())
	if err != nil {
		return nil, err
	}
	if isF32(spec) {
		return f32(t, spec, x)
	}
	return f64(t, spec, x)
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

func geluOp[T float](t *Tape, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "GELU"
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	ls := x.data.LocalShape()
	n := 1
	if len(ls) > 0 {
		n = ls[len(ls)-1]
	}
	yd, saved, err := geluForward(t, t.records(x), xd, n)
	if err != nil {
		return nil, err
	}
	return recordUnary(t, op, x, spec, yd, func(gd []T, gshape []int) ([]T, error) {
		return geluBackward(t, xd, saved, gd, n)
	})
}

// Softmax returns the softmax of x over dim (negative dims count from the
// end), subtracting the maximum before exp. Sharding rule: SoftmaxRule (no
// Partial input, dim not sharded). Backward: y⊙(g − Σ_dim g⊙y), laid out
// like g.
func Softmax(x *Value, dim int) (*Value, error) {
	return softmax("Softmax", x, dim, false)
}

// LogSoftmax returns x − logsumexp(x) over dim. Sharding rule:
// LogSoftmaxRule (as Softmax's). Backward: g − softmax(x)·Σ_dim g, laid
// out like g.
func LogSoftmax(x *Value, dim int) (*Value, error) {
	return softmax("LogSoftmax", x, dim, true)
}

func softmax(op string, x *Value, dim int, logOut bool) (*Value, error) {
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	d, err := softmaxRule(op, x.Spec(), dim)
	if err != nil {
		return nil, err
	}
	if isF32(x.Spec()) {
		return softmaxOp[float32](t, op, x, d, logOut)
	}
	return softmaxOp[float64](t, op, x, d, logOut)
}

func softmaxOp[T float](t *Tape, op string, x *Value, d int, logOut bool) (*Value, error) {
	spec := x.Spec()
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	shape := x.data.LocalShape()
	yd, err := softmaxForward(t, xd, shape, d, logOut)
	if err != nil {
		return nil, err
	}
	return recordUnary(t, op, x, spec, yd, func(gd []T, gshape []int) ([]T, error) {
		return softmaxBackward(t, yd, gd, shape, d, logOut)
	})
}

// LayerNorm normalises x over its last dim with the biased variance:
// (x − μ)/sqrt(σ² + eps)·w + b. Sharding rule: LayerNormRule (x not
// Partial nor sharded on the last dim; w and b Replicate). Backward: dx
// laid out like g; dw and db are Partial(sum) on the axes that shard x's
// rows and like g elsewhere.
func LayerNorm(x, w, b *Value, eps float64) (*Value, error) {
	const op = "LayerNorm"
	t, err := checkInputs(op, x, w, b)
	if err != nil {
		return nil, err
	}
	spec, err := LayerNormRule(x.Spec(), w.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	if !(eps >= 0) {
		return nil, invalidf(op, "eps %v must be non-negative", eps)
	}
	if isF32(spec) {
		return layerNormOp[float32](t, spec, x, w, b, eps)
	}
	return layerNormOp[float64](t, spec, x, w, b, eps)
}

func layerNormOp[T float](t *Tape, spec *placement.Spec, x, w, b *Value, eps float64) (*Value, error) {
	const op = "LayerNorm"
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	wd, err := dataOf[T](w.data)
	if err != nil {
		return nil, err
	}
	bd, err := dataOf[T](b.data)
	if err != nil {
		return nil, err
	}
	shape := spec.Shape()
	n := shape[len(shape)-1]
	yd, saved, err := lnForward(t, t.records(x, w, b), xd, wd, bd, n, eps)
	if err != nil {
		return nil, err
	}
	out, err := placement.NewLocal(spec, yd)
	if err != nil {
		return nil, err
	}
	needX, needW, needB := x.requiresGrad, w.requiresGrad, b.requiresGrad
	ws, bs := w.Spec(), b.Spec()
	return t.record(op, out, []*Value{x, w, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		dx, dw, db, err := lnBackward(t, gd, xd, wd, saved, n, needX, needW, needB)
		if err != nil {
			return nil, err
		}
		grads := make([]*placement.DTensor, 3)
		if needX {
			if grads[0], err = placement.NewLocal(g.Spec(), dx); err != nil {
				return nil, err
			}
		}
		red := reducedOver(spec, g.Spec().Placements())
		if needW {
			s, err := gradSpec(ws, red)
			if err != nil {
				return nil, err
			}
			if grads[1], err = placement.NewLocal(s, dw); err != nil {
				return nil, err
			}
		}
		if needB {
			s, err := gradSpec(bs, red)
			if err != nil {
				return nil, err
			}
			if grads[2], err = placement.NewLocal(s, db); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

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
	if isF32(spec) {
		return embeddingOp[float32](t, spec, table, ids)
	}
	return embeddingOp[float64](t, spec, table, ids)
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
	out, err := placement.NewLocal(spec, embedFwd(t, td, ids.data, lo, vl, dl))
	if err != nil {
		return nil, err
	}
	names := ts.Mesh().Names()
	return t.record(op, out, []*Value{table}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		pg := g.Spec().Placements()
		places := reducedOver(ids.spec, pg)
		for ax, p := range ts.Placements() {
			if !p.IsShard() {
				continue
			}
			if p.Dim() == 0 && !pg[ax].IsReplicate() {
				return nil, gradPlacementf(op, "the gradient of the result arrives as %v on mesh axis %q, where the table is vocab parallel (%v); it must be R there (an all-reduce first, e.g. the backward of redistributing the result to R), and autograd inserts no communication", pg[ax], names[ax], p)
			}
			places[ax] = p
		}
		s, err := gradSpec(ts, places)
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
		gt, err := placement.NewLocal(s, embedBwd(t, gd, ids.data, lo, vl, dl))
		return []*placement.DTensor{gt}, err
	}), nil
}

// CrossEntropy returns the mean over all N rows of logsumexp(logits_r) −
// logits_r[targets_r] (natural log) for logits [N, V] and targets [N].
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
	v := logits.Spec().Shape()[1]
	if err := checkIDs(op, targets.data, v, "target %d out of range for %d classes"); err != nil {
		return nil, err
	}
	if isF32(spec) {
		return crossEntropyOp[float32](t, spec, logits, targets)
	}
	return crossEntropyOp[float64](t, spec, logits, targets)
}

func crossEntropyOp[T float](t *Tape, spec *placement.Spec, logits *Value, targets *Indices) (*Value, error) {
	const op = "CrossEntropy"
	ls := logits.Spec()
	n, v := ls.Shape()[0], ls.Shape()[1]
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
	names := ls.Mesh().Names()
	return t.record(op, out, []*Value{logits}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		pg := g.Spec().Placements()
		places := make([]placement.Placement, len(pg))
		for ax, p := range ls.Placements() {
			if p.IsShard() {
				if !pg[ax].IsReplicate() {
					return nil, gradPlacementf(op, "the gradient of the loss arrives as %v on mesh axis %q, where the rows are %v; it must be R there (an all-reduce first), and autograd inserts no communication", pg[ax], names[ax], p)
				}
				places[ax] = p
			} else {
				places[ax] = pg[ax]
			}
		}
		s, err := gradSpec(ls, places)
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

// recordUnary makes the result of a one-input op from its local block yd
// laid out by spec, and records a backward that aligns the incoming
// gradient to spec and maps its local block through back (gshape is the
// gradient's local shape) into the input's gradient, laid out like g.
func recordUnary[T float](t *Tape, op string, x *Value, spec *placement.Spec, yd []T, back func(gd []T, gshape []int) ([]T, error)) (*Value, error) {
	out, err := placement.NewLocal(spec, yd)
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gd, err := dataOf[T](g)
		if err != nil {
			return nil, err
		}
		dx, err := back(gd, g.LocalShape())
		if err != nil {
			return nil, err
		}
		gx, err := placement.NewLocal(g.Spec(), dx)
		return []*placement.DTensor{gx}, err
	}), nil
}
