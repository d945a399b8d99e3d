package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/placement"
)

// Sharding rules of the neural-network ops (Linear, Permute, Transpose,
// Reshape, GELU, Softmax, LogSoftmax, LayerNorm, Embedding, CrossEntropy).
// Like the rules in rules.go they never imply communication.

// nonPartial rejects every Partial placement of a nonlinear op's input.
func nonPartial(op, what string, s *placement.Spec) error {
	names := s.Mesh().Names()
	for ax, p := range s.Placements() {
		if p.IsPartial() {
			return rulef(op, "%s is %v on mesh axis %q: %s is nonlinear, so it cannot take a Partial input; redistribute it to Replicate (all-reduce) or Shard (reduce-scatter) first", what, p, names[ax], op)
		}
	}
	return nil
}

// sameMeshes checks that two specs live on the same mesh layout (dtypes
// are not compared).
func sameMeshes(op string, a, b *placement.Spec) error {
	ma, mb := a.Mesh(), b.Mesh()
	if ma.World() != mb.World() || !slices.Equal(ma.Names(), mb.Names()) || !slices.Equal(ma.Shape(), mb.Shape()) || !slices.Equal(ma.WorldRanks(), mb.WorldRanks()) {
		return invalidf(op, "inputs live on different meshes (%v and %v); redistribute one onto the other's mesh", ma, mb)
	}
	return nil
}

// allReplicate requires s to be Replicate on every mesh axis.
func allReplicate(op, what string, s *placement.Spec, why string) error {
	names := s.Mesh().Names()
	for ax, p := range s.Placements() {
		if !p.IsReplicate() {
			return rulef(op, "%s is %v on mesh axis %q; it must be R on every axis (%s): redistribute it to Replicate first", what, p, names[ax], why)
		}
	}
	return nil
}

// normDim maps a possibly negative dim into [0, n).
func normDim(op string, d, n int) (int, error) {
	if d < 0 {
		d += n
	}
	if d < 0 || d >= n {
		return 0, invalidf(op, "dim %d out of range for a %d-d tensor", d, n)
	}
	return d, nil
}

// GELURule is the sharding rule of GELU: the result has the input's spec;
// Partial inputs are rejected (GELU is nonlinear).
func GELURule(x *placement.Spec) (*placement.Spec, error) {
	if x == nil {
		return nil, invalidf("GELU", "nil spec")
	}
	if err := nonPartial("GELU", "x", x); err != nil {
		return nil, err
	}
	return x, nil
}

// SoftmaxRule is the sharding rule of Softmax over dim (negative dims count
// from the end): the result has the input's spec. Partial inputs are
// rejected, and so is an input sharded on dim ("softmax over a sharded
// dim"): each rank would normalise over its own slice only.
func SoftmaxRule(x *placement.Spec, dim int) (*placement.Spec, error) {
	_, err := softmaxRule("Softmax", x, dim)
	if err != nil {
		return nil, err
	}
	return x, nil
}

// LogSoftmaxRule is the sharding rule of LogSoftmax; it is SoftmaxRule's.
func LogSoftmaxRule(x *placement.Spec, dim int) (*placement.Spec, error) {
	_, err := softmaxRule("LogSoftmax", x, dim)
	if err != nil {
		return nil, err
	}
	return x, nil
}

func softmaxRule(op string, x *placement.Spec, dim int) (int, error) {
	if x == nil {
		return 0, invalidf(op, "nil spec")
	}
	d, err := normDim(op, dim, len(x.Shape()))
	if err != nil {
		return 0, err
	}
	if err := nonPartial(op, "x", x); err != nil {
		return 0, err
	}
	if o := x.Order(d); len(o) > 0 {
		return 0, rulef(op, "softmax over a sharded dim: x is sharded on dim %d by mesh axes %v; redistribute dim %d to Replicate on those axes (all-gather), or shard another dim instead", d, o, d)
	}
	return d, nil
}

// LayerNormRule is the sharding rule of LayerNorm over the last dim: x has
// no Partial placement and is not sharded on its last dim ("layer norm
// over a sharded dim"); w and b are [D] (D the last dim of x) and Replicate
// on every axis. The result has x's spec.
func LayerNormRule(x, w, b *placement.Spec) (*placement.Spec, error) {
	const op = "LayerNorm"
	if x == nil || w == nil || b == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := compatible(op, x, w); err != nil {
		return nil, err
	}
	if err := compatible(op, x, b); err != nil {
		return nil, err
	}
	sx := x.Shape()
	if len(sx) == 0 {
		return nil, invalidf(op, "x is a scalar; LayerNorm needs at least one dim")
	}
	d := sx[len(sx)-1]
	if !slices.Equal(w.Shape(), []int{d}) || !slices.Equal(b.Shape(), []int{d}) {
		return nil, invalidf(op, "w %v and b %v must both have shape [%d] (the last dim of x %v)", w.Shape(), b.Shape(), d, sx)
	}
	if err := nonPartial(op, "x", x); err != nil {
		return nil, err
	}
	if o := x.Order(len(sx) - 1); len(o) > 0 {
		return nil, rulef(op, "layer norm over a sharded dim: x is sharded on its last dim %d by mesh axes %v; redistribute that dim to Replicate (all-gather), or shard a leading dim instead", len(sx)-1, o)
	}
	if err := allReplicate(op, "w", w, "the normalised dim is whole on every rank"); err != nil {
		return nil, err
	}
	if err := allReplicate(op, "b", b, "the normalised dim is whole on every rank"); err != nil {
		return nil, err
	}
	return x, nil
}

// linearCase is the per-axis case LinearRule chose.
type linearCase uint8

const (
	linRep     linearCase = iota // x R, w R: y R
	linData                      // x S(d<last), w R: y S(d)
	linCol                       // x R, w S(0): y S(last)
	linRow                       // x S(last), w S(1): y P(sum)
	linPartial                   // x P(sum), w R: y P(sum)
)

// linearCases lists the valid per-axis combinations, for error messages.
const linearCases = "(x, w, b) -> y: (R, R, R) -> R; (S(d), R, R) -> S(d) for a leading dim d (data parallel); (R, S(0), S(0)) -> S(last) (colwise); (S(last), S(1), R) -> P(sum) (rowwise; the bias is added on coordinate 0 only); (P(sum), R, R) -> P(sum)"

// LinearRule is the sharding rule of Linear for x [..., in], w [out, in]
// and b [out] or nil. Per mesh axis (x, w, b) -> y:
//
//	(R, R, R)          -> R
//	(S(d), R, R)       -> S(d)     d a leading dim of x: data parallelism
//	(R, S(0), S(0))    -> S(last)  colwise (Megatron column parallel)
//	(S(last), S(1), R) -> P(sum)   rowwise (Megatron row parallel)
//	(P(sum), R, R)     -> P(sum)   linear in x
//
// On P(sum) axes of the result (rowwise or a partial x) the replicated
// bias is added only on the ranks at coordinate 0 of those axes, so that
// the sum counts it once. w and b must not be Partial. The contraction
// dim must be sharded by the same axes in the same order in x (last dim)
// and w (dim 1), and the bias in the same order as w's dim 0. Everything
// else is an error naming the axis and the valid combinations.
func LinearRule(x, w, b *placement.Spec) (*placement.Spec, error) {
	out, _, err := linearRule(x, w, b)
	return out, err
}

func linearRule(x, w, b *placement.Spec) (*placement.Spec, []linearCase, error) {
	const op = "Linear"
	if x == nil || w == nil {
		return nil, nil, invalidf(op, "nil spec")
	}
	if err := compatible(op, x, w); err != nil {
		return nil, nil, err
	}
	sx, sw := x.Shape(), w.Shape()
	if len(sx) < 1 || len(sw) != 2 {
		return nil, nil, invalidf(op, "x must be [..., in] and w [out, in]; got shapes %v and %v", sx, sw)
	}
	last := len(sx) - 1
	if sx[last] != sw[1] {
		return nil, nil, invalidf(op, "x %v has %d input features but w %v (PyTorch layout [out, in]) has %d", sx, sx[last], sw, sw[1])
	}
	var pb []placement.Placement
	if b != nil {
		if err := compatible(op, x, b); err != nil {
			return nil, nil, err
		}
		if !slices.Equal(b.Shape(), []int{sw[0]}) {
			return nil, nil, invalidf(op, "b has shape %v; want [%d] (the out dim of w %v)", b.Shape(), sw[0], sw)
		}
		pb = b.Placements()
	}
	names := x.Mesh().Names()
	px, pw := x.Placements(), w.Placements()
	outP := make([]placement.Placement, len(px))
	cases := make([]linearCase, len(px))
	sum := placement.Partial(comm.Sum)
	for ax := range px {
		xp, wp := px[ax], pw[ax]
		if wp.IsPartial() {
			return nil, nil, rulef(op, "w is %v on mesh axis %q: redistribute the weight to R or Shard first (%s)", wp, names[ax], linearCases)
		}
		if pb != nil && pb[ax].IsPartial() {
			return nil, nil, rulef(op, "b is %v on mesh axis %q: redistribute the bias to R or S(0) first (%s)", pb[ax], names[ax], linearCases)
		}
		if xp.IsPartial() && xp.Op() != comm.Sum {
			return nil, nil, rulef(op, "x is %v on mesh axis %q: Linear is linear in x only over Partial(sum); redistribute it to R or Shard first", xp, names[ax])
		}
		wantB := placement.Replicate()
		switch {
		case xp.IsReplicate() && wp.IsReplicate():
			cases[ax], outP[ax] = linRep, xp
		case xp.IsShard() && xp.Dim() < last && wp.IsReplicate():
			cases[ax], outP[ax] = linData, xp
		case xp.IsReplicate() && wp == placement.Shard(0):
			cases[ax], outP[ax] = linCol, placement.Shard(last)
			wantB = placement.Shard(0)
		case xp == placement.Shard(last) && wp == placement.Shard(1):
			cases[ax], outP[ax] = linRow, sum
		case xp.IsPartial() && wp.IsReplicate():
			cases[ax], outP[ax] = linPartial, sum
		case wp == placement.Shard(1):
			return nil, nil, rulef(op, "w is S(1) (rowwise) on mesh axis %q, so x must be S(%d) (its last dim) there, but it is %v; valid per axis: %s", names[ax], last, xp, linearCases)
		case xp == placement.Shard(last):
			return nil, nil, rulef(op, "x is sharded on its last dim (S(%d)) on mesh axis %q, so w must be S(1) (rowwise) there, but it is %v; valid per axis: %s", last, names[ax], wp, linearCases)
		case wp == placement.Shard(0):
			return nil, nil, rulef(op, "w is S(0) (colwise) on mesh axis %q, so x must be R there, but it is %v (one axis cannot shard two dims of y); valid per axis: %s", names[ax], xp, linearCases)
		default:
			return nil, nil, rulef(op, "x is %v and w is %v on mesh axis %q; valid per axis: %s", xp, wp, names[ax], linearCases)
		}
		if pb != nil && pb[ax] != wantB {
			why := "the bias must be R where w is not colwise-sharded (on P(sum) axes it is added on coordinate 0 only)"
			if wantB.IsShard() {
				why = "w is S(0) (colwise) there, so the bias is sharded with w's out dim"
			}
			return nil, nil, rulef(op, "b is %v on mesh axis %q but must be %v: %s", pb[ax], names[ax], wantB, why)
		}
	}
	if ox, ow := x.Order(last), w.Order(1); !slices.Equal(ox, ow) {
		return nil, nil, rulef(op, "the contraction dim is sharded over mesh axes %v in x (last dim) but %v in w (dim 1); they must match so that each rank holds the same slice of in", ox, ow)
	}
	if b != nil {
		if ob, ow := b.Order(0), w.Order(0); !slices.Equal(ob, ow) {
			return nil, nil, rulef(op, "the out dim is sharded over mesh axes %v in b but %v in w (dim 0); they must match", ob, ow)
		}
	}
	shape := slices.Clone(sx)
	shape[last] = sw[0]
	orders := ordersOf(x)
	orders[last] = w.Order(0)
	out, err := specWith(x, shape, outP, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, cases, nil
}

// PermuteRule is the sharding rule of Permute: result dim i is input dim
// perm[i]; Shard(perm[i]) becomes Shard(i) with its shard order, and
// Replicate and Partial are kept (a permutation is linear).
func PermuteRule(x *placement.Spec, perm ...int) (*placement.Spec, error) {
	const op = "Permute"
	if x == nil {
		return nil, invalidf(op, "nil spec")
	}
	sx := x.Shape()
	if len(perm) != len(sx) {
		return nil, invalidf(op, "perm %v has %d entries for a %d-d tensor", perm, len(perm), len(sx))
	}
	inv := make([]int, len(perm))
	for i := range inv {
		inv[i] = -1
	}
	for i, p := range perm {
		if p < 0 || p >= len(sx) || inv[p] >= 0 {
			return nil, invalidf(op, "perm %v is not a permutation of 0..%d", perm, len(sx)-1)
		}
		inv[p] = i
	}
	shape := make([]int, len(sx))
	orders := map[int][]string{}
	for i, p := range perm {
		shape[i] = sx[p]
		orders[i] = x.Order(p)
	}
	places := x.Placements()
	for ax, p := range places {
		if p.IsShard() {
			places[ax] = placement.Shard(inv[p.Dim()])
		}
	}
	out, err := specWith(x, shape, places, orders)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, nil
}

// TransposeRule is the sharding rule of Transpose(x, d0, d1): PermuteRule
// with d0 and d1 swapped.
func TransposeRule(x *placement.Spec, d0, d1 int) (*placement.Spec, error) {
	if x == nil {
		return nil, invalidf("Transpose", "nil spec")
	}
	perm, err := transposePerm(len(x.Shape()), d0, d1)
	if err != nil {
		return nil, err
	}
	return PermuteRule(x, perm...)
}

func transposePerm(n, d0, d1 int) ([]int, error) {
	a, err := normDim("Transpose", d0, n)
	if err != nil {
		return nil, err
	}
	b, err := normDim("Transpose", d1, n)
	if err != nil {
		return nil, err
	}
	perm := make([]int, n)
	for i := range perm {
		perm[i] = i
	}
	perm[a], perm[b] = b, a
	return perm, nil
}

// ReshapeRule is the sharding rule of Reshape to shape (one entry may be
// -1, inferred). The old and new dims are grouped into the smallest runs
// with equal products (a merge or a split). A sharded dim must lead its
// group (only size-1 dims before it); it maps to the leading non-unit dim
// of the new group, which must either have the same size or, for a real
// split or merge, both sizes must be divisible by the number of shards
// (so that every rank's block is the same contiguous run of the group).
// At most one dim per group may be sharded. Replicate and Partial are
// kept. The local block is reinterpreted without moving data.
func ReshapeRule(x *placement.Spec, shape ...int) (*placement.Spec, error) {
	out, _, err := reshapeRule(x, shape)
	return out, err
}

func reshapeRule(x *placement.Spec, shape []int) (*placement.Spec, []int, error) {
	const op = "Reshape"
	if x == nil {
		return nil, nil, invalidf(op, "nil spec")
	}
	sx := x.Shape()
	n := prod(sx)
	shape = slices.Clone(shape)
	infer := -1
	known := 1
	for i, s := range shape {
		switch {
		case s == -1 && infer < 0:
			infer = i
		case s <= 0:
			return nil, nil, invalidf(op, "shape %v: dims must be positive (one may be -1)", shape)
		default:
			known *= s
		}
	}
	if infer >= 0 {
		if n%known != 0 {
			return nil, nil, invalidf(op, "cannot infer dim %d of %v for %d elements", infer, shape, n)
		}
		shape[infer] = n / known
	}
	if prod(shape) != n {
		return nil, nil, invalidf(op, "cannot reshape %v (%d elements) to %v (%d elements)", sx, n, shape, prod(shape))
	}
	// Group the dims.
	newDim := make([]int, len(sx)) // new dim of each sharded old dim
	mshape := x.Mesh().Shape()
	axisIdx := map[string]int{}
	for i, nm := range x.Mesh().Names() {
		axisIdx[nm] = i
	}
	i, j := 0, 0
	for i < len(sx) || j < len(shape) {
		gi, gj := i, j
		po, pn := 1, 1
		if i < len(sx) {
			po = sx[i]
			i++
		}
		if j < len(shape) {
			pn = shape[j]
			j++
		}
		for po != pn {
			if po < pn {
				po *= sx[i]
				i++
			} else {
				pn *= shape[j]
				j++
			}
		}
		// Old dims gi..i-1 form one group with new dims gj..j-1.
		sharded := -1
		for d := gi; d < i; d++ {
			newDim[d] = -1
			if len(x.Order(d)) == 0 {
				continue
			}
			if sharded >= 0 {
				return nil, nil, rulef(op, "dims %d and %d of %v are both sharded and merge into one group of %v; redistribute one of them to Replicate first", sharded, d, sx, shape)
			}
			sharded = d
		}
		if sharded < 0 {
			continue
		}
		for d := gi; d < sharded; d++ {
			if sx[d] != 1 {
				return nil, nil, rulef(op, "dim %d of %v is sharded but merges with the outer dim %d (size %d) into %v: each rank's rows would not be contiguous; redistribute dim %d to Replicate first, or shard the outer dim", sharded, sx, d, sx[d], shape[gj:j], sharded)
			}
		}
		if j == gj {
			return nil, nil, rulef(op, "dim %d of %v (size 1) is sharded but has no counterpart in %v; redistribute it to Replicate first", sharded, sx, shape)
		}
		nd := gj
		for nd < j-1 && shape[nd] == 1 {
			nd++
		}
		k := 1
		for _, a := range x.Order(sharded) {
			k *= mshape[axisIdx[a]]
		}
		if sx[sharded] != shape[nd] && (sx[sharded]%k != 0 || shape[nd]%k != 0) {
			return nil, nil, rulef(op, "dim %d of %v (size %d) is sharded %d ways by mesh axes %v and becomes dim %d (size %d) of %v: the split is compatible only when both sizes are divisible by %d; redistribute dim %d to Replicate first, or pad", sharded, sx, sx[sharded], k, x.Order(sharded), nd, shape[nd], shape, k, sharded)
		}
		newDim[sharded] = nd
	}
	places := x.Placements()
	orders := map[int][]string{}
	for ax, p := range places {
		if p.IsShard() {
			places[ax] = placement.Shard(newDim[p.Dim()])
			orders[newDim[p.Dim()]] = x.Order(p.Dim())
		}
	}
	out, err := specWith(x, shape, places, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, shape, nil
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

// CrossEntropyRule is the sharding rule of CrossEntropy for logits [N, V]
// and targets [N]: logits have no Partial placement and are not sharded
// on V ("cross entropy over a sharded vocab dim"); the targets must be
// laid out exactly like the logits' rows (Shard(0) on the same axes in the
// same order, Replicate elsewhere). The result is a scalar (shape [])
// that is Partial(sum) on the axes that shard the rows (each rank
// contributes its rows' sum divided by N) and Replicate elsewhere.
func CrossEntropyRule(logits *placement.Spec, targets *Indices) (*placement.Spec, error) {
	const op = "CrossEntropy"
	if logits == nil || targets == nil || targets.spec == nil {
		return nil, invalidf(op, "nil logits or targets")
	}
	if err := sameMeshes(op, logits, targets.spec); err != nil {
		return nil, err
	}
	sl, st := logits.Shape(), targets.spec.Shape()
	if len(sl) != 2 || len(st) != 1 || st[0] != sl[0] {
		return nil, invalidf(op, "want logits [N, V] and targets [N]; got %v and %v (reshape [B, T, V] logits to [B·T, V] first)", sl, st)
	}
	if err := nonPartial(op, "logits", logits); err != nil {
		return nil, err
	}
	if o := logits.Order(1); len(o) > 0 {
		return nil, rulef(op, "cross entropy over a sharded vocab dim: the logits are sharded on dim 1 by mesh axes %v; redistribute dim 1 to Replicate first (vocab-parallel loss is not supported yet)", o)
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
	if !slices.Equal(logits.Order(0), targets.spec.Order(0)) {
		return nil, rulef(op, "the rows are sharded over mesh axes %v in the logits but %v in the targets; they must match", logits.Order(0), targets.spec.Order(0))
	}
	s, err := specWith(logits, []int{}, out, nil)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return s, nil
}
