package autograd

import (
	"context"
	"fmt"
	"github.com/b7ea7098/loom/internal/half"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Matrix products: MatMul, Linear (x·wᵀ + b) and BatchedMatMul, with
// their sharding rules (a contraction over a sharded dim is Partial(sum))
// and the GEMM calls on local blocks.

// MatMul returns a·b for a [m, k] and b [k, n]. Sharding rule: MatMulRule;
// a sharded contraction gives Partial(sum) with no communication. Backward:
// dA = g·bᵀ, dB = aᵀ·g on local blocks, laid out per axis as
//
//	(S(0), R):    dA S(0), dB P(sum)   (data parallelism: replicated weight)
//	(R, S(1)):    dA P(sum), dB S(1)
//	(S(1), S(0)): dA S(1), dB S(0)     (g must be R on that axis)
//	(R, R):       dA, dB like g (R or P(sum))
//	(P(sum), R):  dA like g, dB P(sum) (g must be R to compute dB)
//	(R, P(sum)):  dA P(sum), dB like g (g must be R to compute dA)
//
// A gradient that would need communication first fails with
// ErrGradPlacement.
func MatMul(a, b *Value) (*Value, error) {
	t, err := checkInputs("MatMul", a, b)
	if err != nil {
		return nil, err
	}
	spec, err := MatMulRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	blas, err := t.blasOrDefault()
	if err != nil {
		return nil, err
	}
	x, y := a.data, b.data
	al, bl := x.LocalShape(), y.LocalShape()
	if al[1] != bl[0] {
		return nil, fmt.Errorf("autograd: MatMul: internal: local blocks %v and %v do not chain", al, bl)
	}
	m, k, n := al[0], al[1], bl[1]
	out, err := reusedOr(t, "MatMul", spec, func() (*placement.DTensor, error) {
		return gemm(t.result(), blas, spec, x, y, false, false, m, n, k)
	})
	if err != nil {
		return nil, err
	}
	sa, sb := a.Spec(), b.Spec()
	return splitAware(t.record("MatMul", out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needA, needB := t.need(a), t.need(b)
		g, err := t.alignGrad(ctx, "MatMul", g, spec)
		if err != nil {
			return nil, err
		}
		if gl := g.LocalShape(); gl[0] != m || gl[1] != n {
			return nil, fmt.Errorf("autograd: MatMul: internal: gradient block %v, want [%d %d]", gl, m, n)
		}
		pa, pb, pg := sa.Placements(), sb.Placements(), g.Spec().Placements()
		da, db := make([]placement.Placement, len(pa)), make([]placement.Placement, len(pa))
		var errA, errB error
		names := sa.Mesh().Names()
		sum := placement.Partial(comm.Sum)
		for ax := range pa {
			xa, yb, gp := pa[ax], pb[ax], pg[ax]
			needAll := func(which string) error {
				return gradPlacementf("MatMul", "the gradient of the result arrives as %v on mesh axis %q, where a is %v and b is %v: d%s needs it all-reduced to R first, and autograd inserts no communication", gp, names[ax], xa, yb, which)
			}
			switch {
			case xa.IsShard() && xa.Dim() == 0:
				da[ax], db[ax] = xa, sum
			case yb.IsShard() && yb.Dim() == 1:
				da[ax], db[ax] = sum, yb
			case xa.IsShard() && yb.IsShard():
				da[ax], db[ax] = xa, yb
				if gp.IsPartial() {
					errA, errB = cmp(errA, needAll("A")), cmp(errB, needAll("B"))
				}
			case xa.IsReplicate() && yb.IsReplicate():
				da[ax], db[ax] = gp, gp
			case xa.IsPartial():
				da[ax], db[ax] = gp, sum
				if gp.IsPartial() {
					errB = cmp(errB, needAll("B"))
				}
			default: // b Partial(sum), a Replicate
				da[ax], db[ax] = sum, gp
				if gp.IsPartial() {
					errA = cmp(errA, needAll("A"))
				}
			}
		}
		grads := make([]*placement.DTensor, 2)
		if needA {
			if errA != nil {
				return nil, errA
			}
			s, err := specWith(sa, sa.Shape(), da, ordersOf(sa))
			if err != nil {
				return nil, err
			}
			if grads[0], err = gemm(t.scratch(), blas, s, g, y, false, true, m, k, n); err != nil {
				return nil, err
			}
		}
		if needB {
			if errB != nil {
				return nil, errB
			}
			s, err := specWith(sb, sb.Shape(), db, ordersOf(sb))
			if err != nil {
				return nil, err
			}
			if grads[1], err = gemm(t.scratch(), blas, s, x, g, true, false, k, n, m); err != nil {
				return nil, err
			}
		}
		return grads, nil
	})), nil
}

// MatMulRule is the sharding rule of MatMul for a [m, k] times b [k, n].
// Per mesh axis (a, b) -> result:
//
//	(S(0), R)      -> S(0)    rows of a
//	(R, S(1))      -> S(1)    columns of b
//	(S(1), S(0))   -> P(sum)  contraction sharded: partial products
//	(R, R)         -> R
//	(P(sum), R)    -> P(sum)  linear in a
//	(R, P(sum))    -> P(sum)  linear in b
//
// Both Partial on one axis is an error (the product of two sums is not the
// sum of the products), as is every other pair; the error lists what b
// would need given a. When several axes shard the contraction dim, a's dim
// 1 and b's dim 0 must be sharded in the same order.
func MatMulRule(a, b *placement.Spec) (*placement.Spec, error) {
	const op = "MatMul"
	if err := compatible(op, a, b); err != nil {
		return nil, err
	}
	sa, sb := a.Shape(), b.Shape()
	if len(sa) != 2 || len(sb) != 2 {
		return nil, invalidf(op, "MatMul takes 2-d tensors; got shapes %v and %v", sa, sb)
	}
	if sa[1] != sb[0] {
		return nil, invalidf(op, "inner dims differ: a is %v, b is %v", sa, sb)
	}
	names := a.Mesh().Names()
	pa, pb := a.Placements(), b.Placements()
	out := make([]placement.Placement, len(pa))
	for ax := range pa {
		x, y := pa[ax], pb[ax]
		for _, in := range []struct {
			what string
			p    placement.Placement
		}{{"a", x}, {"b", y}} {
			if in.p.IsPartial() && in.p.Op() != comm.Sum {
				return nil, rulef(op, "%s is %v on mesh axis %q: MatMul is linear in each input only over Partial(sum); redistribute it to Replicate or Shard first", in.what, in.p, names[ax])
			}
		}
		r, ok := matmulAxis(x, y)
		if ok {
			out[ax] = r
			continue
		}
		if x.IsPartial() && y.IsPartial() {
			return nil, rulef(op, "a and b are both P(sum) on mesh axis %q: the product of two sums is not the sum of the products; redistribute one of them to R (all-reduce) first", names[ax])
		}
		return nil, rulef(op, "a is %v and b is %v on mesh axis %q; with a %v, b would need %s (valid pairs per axis: %s)", x, y, names[ax], x, partners(x), matmulPairs)
	}
	if oa, ob := a.Order(1), b.Order(0); !slices.Equal(oa, ob) {
		return nil, rulef(op, "the contraction dim is sharded over mesh axes %v in a but %v in b; they must match so that each rank holds the same slice of k", oa, ob)
	}
	return specWith(a, []int{sa[0], sb[1]}, out, map[int][]string{0: a.Order(0), 1: b.Order(1)})
}

// MatMul placements per mesh axis: a is [m, k], b is [k, n].
const matmulPairs = "(S(0), R)->S(0), (R, S(1))->S(1), (S(1), S(0))->P(sum), (R, R)->R, (P(sum), R)->P(sum), (R, P(sum))->P(sum)"

// matmulAxis is the per-axis table of MatMulRule.
func matmulAxis(x, y placement.Placement) (placement.Placement, bool) {
	sum := placement.Partial(comm.Sum)
	switch {
	case x == placement.Shard(0) && y.IsReplicate():
		return x, true
	case x.IsReplicate() && y == placement.Shard(1):
		return y, true
	case x == placement.Shard(1) && y == placement.Shard(0):
		return sum, true
	case x.IsReplicate() && y.IsReplicate():
		return x, true
	case x == sum && y.IsReplicate(), x.IsReplicate() && y == sum:
		return sum, true
	}
	return placement.Placement{}, false
}

// partners lists the b placements that pair with a's placement x.
func partners(x placement.Placement) string {
	switch {
	case x.IsReplicate():
		return "R, S(1) or P(sum)"
	case x == placement.Shard(0):
		return "R"
	case x == placement.Shard(1):
		return "S(0)"
	case x.IsPartial():
		return "R"
	}
	return "nothing: redistribute a to R, S(0) or S(1)"
}

// gemm computes op(A)·op(B) for local row-major blocks, where op(A) is m×k
// and op(B) is k×n, and lays the m×n result out by spec, in a block as a
// says: scratch for a gradient (of an intermediate value, or of a leaf,
// which Backward copies), a result for an op's result.
func gemm(a alloc, b *kernels.BLAS, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, m, n, k int) (*placement.DTensor, error) {
	if d, ok := onDevice(x); ok {
		return devGemm(a, d, spec, x, y, transA, transB, m, n, k)
	}
	lda, ldb := k, n
	if transA {
		lda = m
	}
	if transB {
		ldb = k
	}
	lda, ldb = max(1, lda), max(1, ldb)
	// A fresh result is already zero, so C = A·B + C needs no pass of the
	// BLAS clearing C (which beta = 0 costs); arena memory needs beta = 0.
	var beta float32
	if a.fresh() {
		beta = 1
	}
	switch xd := x.LocalData().(type) {
	case []float32:
		yd, _ := y.LocalData().([]float32)
		c := block[float32](a, m*n)
		if k == 0 {
			clear(c)
		} else {
			xd, yd := autocastOperands(a.t, xd, yd)
			if err := b.Sgemm(transA, transB, m, n, k, 1, xd, lda, yd, ldb, beta, c, max(1, n)); err != nil {
				return nil, fmt.Errorf("autograd: internal: %w", err)
			}
		}
		return placement.NewLocal(spec, c)
	case []float64:
		yd, _ := y.LocalData().([]float64)
		c := block[float64](a, m*n)
		if k == 0 {
			clear(c)
		} else {
			if err := b.Dgemm(transA, transB, m, n, k, 1, xd, lda, yd, ldb, float64(beta), c, max(1, n)); err != nil {
				return nil, fmt.Errorf("autograd: internal: %w", err)
			}
		}
		return placement.NewLocal(spec, c)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// autocastOperands returns a float32 GEMM's operands as t computes with
// them: copies rounded to bfloat16 under WithAutocast (the host's form of
// device.GemmBF16, so that host and emulated device agree bit for bit),
// else x and y themselves.
func autocastOperands(t *Tape, x, y []float32) ([]float32, []float32) {
	if !t.Autocast() {
		return x, y
	}
	rx, ry := make([]float32, len(x)), make([]float32, len(y))
	half.RoundBFloat16s(rx, x)
	half.RoundBFloat16s(ry, y)
	return rx, ry
}

// reusedOr returns the result a selective checkpoint kept of op when its
// region is being recomputed (see WithKeepOps), and compute's otherwise.
func reusedOr(t *Tape, op string, spec *placement.Spec, compute func() (*placement.DTensor, error)) (*placement.DTensor, error) {
	if len(t.frames) > 0 {
		k, err := t.reuse(op, spec)
		if err != nil {
			return nil, err
		}
		if k != nil {
			return k.out, nil
		}
	}
	return compute()
}

// cmp keeps the first error.
func cmp(old, err error) error {
	if old != nil {
		return old
	}
	return err
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
	dev, onDev := onDevice(x.data)
	var bd []T
	if addBias && !onDev {
		if bd, err = dataOf[T](b.data); err != nil {
			return nil, err
		}
		if len(bd) != n {
			return nil, fmt.Errorf("autograd: %s: internal: bias block of %d for %d outputs", op, len(bd), n)
		}
	}
	y, err := reusedOr(t, op, spec, func() (*placement.DTensor, error) {
		if onDev && addBias {
			return devGemmBias(t, dev, spec, x.data, w.data, bufOf(b.data), m, n, k)
		}
		return gemmBias(t, blas, spec, x.data, w.data, bd, m, n, k)
	})
	if err != nil {
		return nil, err
	}
	inputs := []*Value{x, w}
	if b != nil {
		inputs = append(inputs, b)
	}
	sx, sw := x.Spec(), w.Spec()
	xd, wd := x.data, w.data
	names := sx.Mesh().Names()
	return splitAware(t.record(op, y, inputs, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needX, needW, needB := t.need(x), t.need(w), t.need(b)
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
			if gb := bufOf(g); gb != nil {
				if grads[2], err = devColumnSums(t, s, gb, n); err != nil {
					return nil, err
				}
				return grads, nil
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
	})), nil
}

// gemmBias computes x·wᵀ for the local blocks x [m, k] and w [n, k], plus
// bias (n values; nil for none) in every row, and lays the m×n result (a
// result block of t) out by spec: Linear's forward. The result is
// prefilled with the bias rows and the GEMM adds into it (beta = 1), so
// there is no separate pass adding the bias and no pass of the BLAS
// clearing C for beta = 0.
func gemmBias[T float](t *Tape, b *kernels.BLAS, spec *placement.Spec, x, w *placement.DTensor, bias []T, m, n, k int) (*placement.DTensor, error) {
	if bias == nil {
		return gemm(t.result(), b, spec, x, w, false, true, m, n, k)
	}
	xd, err := dataOf[T](x)
	if err != nil {
		return nil, err
	}
	wd, err := dataOf[T](w)
	if err != nil {
		return nil, err
	}
	c := resultBlock[T](t, m*n)
	if err := kernels.FillRows(c, bias); err != nil {
		return nil, fmt.Errorf("autograd: Linear: internal: %w", err)
	}
	if k > 0 && m > 0 && n > 0 {
		switch cd := any(c).(type) {
		case []float32:
			x32, w32 := autocastOperands(t, any(xd).([]float32), any(wd).([]float32))
			err = b.Sgemm(false, true, m, n, k, 1, x32, k, w32, k, 1, cd, n)
		case []float64:
			err = b.Dgemm(false, true, m, n, k, 1, any(xd).([]float64), k, any(wd).([]float64), k, 1, cd, n)
		}
		if err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
	}
	return placement.NewLocal(spec, c)
}

// columnSums sums the rows of an [rows, n] block (a bias gradient,
// kernels.ColumnSums), in t's arena for float32.
func columnSums[T float](t *Tape, g []T, n int) ([]T, error) {
	var out []T
	if _, ok := as32(g); ok {
		out = getBuf[T](t, n)
	} else {
		out = make([]T, n)
	}
	if err := kernels.ColumnSums(out, g, n); err != nil {
		return nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return out, nil
}

// BatchedMatMul returns a·b for a [..., m, k] and b [..., k, n] with equal
// batch dims, one matrix product per batch index. Sharding rule:
// BatchedMatMulRule. Backward, per mesh axis (a, b) -> (da, db):
//
//	(S(d), S(d)) batch:    S(d), S(d)
//	(S(m), R):             S(m), P(sum)
//	(R, S(n)):             P(sum), S(n)
//	(S(k), S(k)):          S(k), S(k)    g must be R there
//	(R, R):                like g, like g
//	(P(sum), R):           like g, P(sum) g must be R for db
//	(R, P(sum)):           P(sum), like g g must be R for da
func BatchedMatMul(a, b *Value) (*Value, error) {
	const op = "BatchedMatMul"
	t, err := checkInputs(op, a, b)
	if err != nil {
		return nil, err
	}
	spec, cases, err := bmmRule(a.Spec(), b.Spec())
	if err != nil {
		return nil, err
	}
	blas, err := t.blasOrDefault()
	if err != nil {
		return nil, err
	}
	al, bl := a.data.LocalShape(), b.data.LocalShape()
	r := len(al)
	batch, m, k, n := prod(al[:r-2]), al[r-2], al[r-1], bl[r-1]
	if bl[r-2] != k || prod(bl[:r-2]) != batch {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v and %v do not chain", op, al, bl)
	}
	out, err := reusedOr(t, op, spec, func() (*placement.DTensor, error) {
		return bmmLocal(t.result(), blas, spec, a.data, b.data, false, false, batch, m, n, k)
	})
	if err != nil {
		return nil, err
	}
	sa, sb := a.Spec(), b.Spec()
	x, y := a.data, b.data
	names := sa.Mesh().Names()
	return splitAware(t.record(op, out, []*Value{a, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needA, needB := t.need(a), t.need(b)
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		pa, pb, pg := sa.Placements(), sb.Placements(), g.Spec().Placements()
		da, db := make([]placement.Placement, len(pa)), make([]placement.Placement, len(pa))
		sum := placement.Partial(comm.Sum)
		var errA, errB error
		for ax, c := range cases {
			needR := func(which string) error {
				return gradPlacementf(op, "the gradient of the result arrives as %v on mesh axis %q, where a is %v and b is %v: d%s needs it all-reduced to R first, and autograd inserts no communication", pg[ax], names[ax], pa[ax], pb[ax], which)
			}
			switch c {
			case bmmBatch:
				da[ax], db[ax] = pa[ax], pb[ax]
			case bmmRows:
				da[ax], db[ax] = pa[ax], sum
			case bmmCols:
				da[ax], db[ax] = sum, pb[ax]
			case bmmInner:
				da[ax], db[ax] = pa[ax], pb[ax]
				if pg[ax].IsPartial() {
					errA, errB = cmp(errA, needR("a")), cmp(errB, needR("b"))
				}
			case bmmRep:
				da[ax], db[ax] = pg[ax], pg[ax]
			case bmmPartA:
				da[ax], db[ax] = pg[ax], sum
				if pg[ax].IsPartial() {
					errB = cmp(errB, needR("b"))
				}
			case bmmPartB:
				da[ax], db[ax] = sum, pg[ax]
				if pg[ax].IsPartial() {
					errA = cmp(errA, needR("a"))
				}
			}
		}
		grads := make([]*placement.DTensor, 2)
		if needA {
			if errA != nil {
				return nil, errA
			}
			s, err := gradSpec(sa, da)
			if err != nil {
				return nil, err
			}
			if grads[0], err = bmmLocal(t.scratch(), blas, s, g, y, false, true, batch, m, k, n); err != nil {
				return nil, err
			}
		}
		if needB {
			if errB != nil {
				return nil, errB
			}
			s, err := gradSpec(sb, db)
			if err != nil {
				return nil, err
			}
			if grads[1], err = bmmLocal(t.scratch(), blas, s, x, g, true, false, batch, k, n, m); err != nil {
				return nil, err
			}
		}
		return grads, nil
	})), nil
}

// BatchedMatMulRule is the sharding rule of BatchedMatMul for a
// [..., m, k] and b [..., k, n] with equal batch dims (no broadcasting).
// With r the rank of the tensors, per mesh axis (a, b) -> result:
//
//	(S(d), S(d))     -> S(d)    d < r−2, a batch dim (heads, batch)
//	(S(r−2), R)      -> S(r−2)  rows of a
//	(R, S(r−1))      -> S(r−1)  columns of b
//	(S(r−1), S(r−2)) -> P(sum)  contraction sharded
//	(R, R)           -> R
//	(P(sum), R)      -> P(sum)
//	(R, P(sum))      -> P(sum)
//
// Every other pair is an error naming the axis and the valid pairs. Each
// dim shared by both (batch dims, the contraction) must be sharded by the
// same axes in the same order.
func BatchedMatMulRule(a, b *placement.Spec) (*placement.Spec, error) {
	s, _, err := bmmRule(a, b)
	return s, err
}

// bmmCase is the per-axis case BatchedMatMulRule chose.
type bmmCase uint8

const (
	bmmBatch bmmCase = iota // both S(d) on a batch dim
	bmmRows                 // a S(m), b R
	bmmCols                 // a R, b S(n)
	bmmInner                // a S(k), b S(k): P(sum)
	bmmRep                  // R, R
	bmmPartA                // P(sum), R
	bmmPartB                // R, P(sum)
)

const bmmPairs = "(S(d), S(d)) -> S(d) for a batch dim d; (S(m), R) -> S(m); (R, S(n)) -> S(n); (S(k) of a, S(k) of b) -> P(sum); (R, R) -> R; (P(sum), R) -> P(sum); (R, P(sum)) -> P(sum)"

func bmmRule(a, b *placement.Spec) (*placement.Spec, []bmmCase, error) {
	const op = "BatchedMatMul"
	if err := compatible(op, a, b); err != nil {
		return nil, nil, err
	}
	sa, sb := a.Shape(), b.Shape()
	r := len(sa)
	if r < 2 || len(sb) != r || !slices.Equal(sa[:r-2], sb[:r-2]) || sa[r-1] != sb[r-2] {
		return nil, nil, invalidf(op, "want a [..., m, k] and b [..., k, n] with equal batch dims; got %v and %v", sa, sb)
	}
	names := a.Mesh().Names()
	pa, pb := a.Placements(), b.Placements()
	out := make([]placement.Placement, len(pa))
	cases := make([]bmmCase, len(pa))
	sum := placement.Partial(comm.Sum)
	for ax := range pa {
		x, y := pa[ax], pb[ax]
		for _, in := range []struct {
			what string
			p    placement.Placement
		}{{"a", x}, {"b", y}} {
			if in.p.IsPartial() && in.p.Op() != comm.Sum {
				return nil, nil, rulef(op, "%s is %v on mesh axis %q: BatchedMatMul is linear in each input only over Partial(sum); redistribute it first", in.what, in.p, names[ax])
			}
		}
		switch {
		case x.IsShard() && x.Dim() < r-2 && x == y:
			cases[ax], out[ax] = bmmBatch, x
		case x == placement.Shard(r-2) && y.IsReplicate():
			cases[ax], out[ax] = bmmRows, x
		case x.IsReplicate() && y == placement.Shard(r-1):
			cases[ax], out[ax] = bmmCols, y
		case x == placement.Shard(r-1) && y == placement.Shard(r-2):
			cases[ax], out[ax] = bmmInner, sum
		case x.IsReplicate() && y.IsReplicate():
			cases[ax], out[ax] = bmmRep, x
		case x == sum && y.IsReplicate():
			cases[ax], out[ax] = bmmPartA, sum
		case x.IsReplicate() && y == sum:
			cases[ax], out[ax] = bmmPartB, sum
		case x.IsPartial() && y.IsPartial():
			return nil, nil, rulef(op, "a and b are both P(sum) on mesh axis %q: the product of two sums is not the sum of the products; redistribute one of them to R first", names[ax])
		default:
			return nil, nil, rulef(op, "a is %v and b is %v on mesh axis %q; valid pairs per axis: %s", x, y, names[ax], bmmPairs)
		}
	}
	for d := range r - 2 {
		if !slices.Equal(a.Order(d), b.Order(d)) {
			return nil, nil, rulef(op, "batch dim %d is sharded over mesh axes %v in a but %v in b; they must match", d, a.Order(d), b.Order(d))
		}
	}
	if oa, ob := a.Order(r-1), b.Order(r-2); !slices.Equal(oa, ob) {
		return nil, nil, rulef(op, "the contraction dim is sharded over mesh axes %v in a but %v in b; they must match", oa, ob)
	}
	shape := slices.Clone(sa)
	shape[r-1] = sb[r-1]
	orders := ordersOf(a)
	orders[r-1] = b.Order(r - 1)
	s, err := specWith(a, shape, out, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return s, cases, nil
}

// bmmLocal computes op(A_i)·op(B_i) for every batch index i of row-major
// local blocks, op(A_i) m×k and op(B_i) k×n, and lays the result out by
// spec, in a block as a says (see gemm).
func bmmLocal(a alloc, bl *kernels.BLAS, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, batch, m, n, k int) (*placement.DTensor, error) {
	if d, ok := onDevice(x); ok {
		return devBmm(a, d, spec, x, y, transA, transB, batch, m, n, k)
	}
	lda, ldb := max(1, k), max(1, n)
	if transA {
		lda = max(1, m)
	}
	if transB {
		ldb = max(1, k)
	}
	sa, sb, sc := m*k, k*n, m*n
	var beta float32 // see gemm: a fresh result is already zero
	if a.fresh() {
		beta = 1
	}
	switch xd := x.LocalData().(type) {
	case []float32:
		yd, _ := y.LocalData().([]float32)
		c := block[float32](a, batch*sc)
		if k == 0 {
			clear(c)
		} else if m > 0 && n > 0 {
			xd, yd := autocastOperands(a.t, xd, yd)
			for i := range batch {
				if err := bl.Sgemm(transA, transB, m, n, k, 1, xd[i*sa:(i+1)*sa], lda, yd[i*sb:(i+1)*sb], ldb, beta, c[i*sc:(i+1)*sc], max(1, n)); err != nil {
					return nil, fmt.Errorf("autograd: internal: %w", err)
				}
			}
		}
		return placement.NewLocal(spec, c)
	case []float64:
		yd, _ := y.LocalData().([]float64)
		c := block[float64](a, batch*sc)
		if k == 0 {
			clear(c)
		} else if m > 0 && n > 0 {
			for i := range batch {
				if err := bl.Dgemm(transA, transB, m, n, k, 1, xd[i*sa:(i+1)*sa], lda, yd[i*sb:(i+1)*sb], ldb, float64(beta), c[i*sc:(i+1)*sc], max(1, n)); err != nil {
					return nil, fmt.Errorf("autograd: internal: %w", err)
				}
			}
		}
		return placement.NewLocal(spec, c)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}
