package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Pointwise activations (ReLU, SiLU, Tanh, Sigmoid), Dropout, Mean, the
// MSE loss, Argmax and Accuracy. Each op's arithmetic is one call of
// package kernels per direction (Mean and MSE are compositions of Sum,
// Scale, Add and Mul, whose arithmetic already is).

// ReLU returns max(x, 0) element-wise. Sharding rule: ReLURule (any
// placement but Partial). Backward: g where x > 0, else 0, laid out like g.
func ReLU(x *Value) (*Value, error) {
	const op = "ReLU"
	return elementwise(op, x, ReLURule,
		pointwiseOp(op, device.ReLU, kernels.ReLU[float32], kernels.ReLUBackward[float32], false),
		pointwiseOp(op, device.ReLU, kernels.ReLU[float64], kernels.ReLUBackward[float64], false))
}

// SiLU returns x·σ(x) element-wise (σ the logistic sigmoid; PyTorch's
// SiLU, also called swish). Sharding rule: SiLURule. Backward:
// g·σ(x)·(1 + x·(1 − σ(x))), laid out like g.
func SiLU(x *Value) (*Value, error) {
	const op = "SiLU"
	return elementwise(op, x, SiLURule,
		pointwiseOp(op, device.SiLU, kernels.SiLU[float32], kernels.SiLUBackward[float32], false),
		pointwiseOp(op, device.SiLU, kernels.SiLU[float64], kernels.SiLUBackward[float64], false))
}

// Tanh returns tanh(x) element-wise. Sharding rule: TanhRule. Backward:
// g·(1 − y²) from the result y, laid out like g.
func Tanh(x *Value) (*Value, error) {
	const op = "Tanh"
	return elementwise(op, x, TanhRule,
		pointwiseOp(op, device.Tanh, kernels.Tanh[float32], kernels.TanhBackward[float32], true),
		pointwiseOp(op, device.Tanh, kernels.Tanh[float64], kernels.TanhBackward[float64], true))
}

// Sigmoid returns 1/(1 + e^−x) element-wise. Sharding rule: SigmoidRule.
// Backward: g·y·(1 − y) from the result y, laid out like g.
func Sigmoid(x *Value) (*Value, error) {
	const op = "Sigmoid"
	return elementwise(op, x, SigmoidRule,
		pointwiseOp(op, device.Sigmoid, kernels.Sigmoid[float32], kernels.SigmoidBackward[float32], true),
		pointwiseOp(op, device.Sigmoid, kernels.Sigmoid[float64], kernels.SigmoidBackward[float64], true))
}

// ReLURule is the sharding rule of ReLU: the result has the input's spec
// (Replicate and Shard on any dim pass through); Partial inputs are
// rejected (ReLU is nonlinear).
func ReLURule(x *placement.Spec) (*placement.Spec, error) { return pointwiseRule("ReLU", x) }

// SiLURule is the sharding rule of SiLU; it is ReLURule's.
func SiLURule(x *placement.Spec) (*placement.Spec, error) { return pointwiseRule("SiLU", x) }

// TanhRule is the sharding rule of Tanh; it is ReLURule's.
func TanhRule(x *placement.Spec) (*placement.Spec, error) { return pointwiseRule("Tanh", x) }

// SigmoidRule is the sharding rule of Sigmoid; it is ReLURule's.
func SigmoidRule(x *placement.Spec) (*placement.Spec, error) { return pointwiseRule("Sigmoid", x) }

func pointwiseRule(op string, x *placement.Spec) (*placement.Spec, error) {
	if x == nil {
		return nil, invalidf(op, "nil spec")
	}
	if err := nonPartial(op, "x", x); err != nil {
		return nil, err
	}
	return x, nil
}

// pointwiseOp is the local form of a one-input pointwise op: fwd maps the
// input block into a result block; bwd maps the gradient with the input
// (or, saveOut, the result) into the input's gradient. On a device the op
// is Kernels.Pointwise(f) and its backward.
func pointwiseOp[T float](op string, f device.Pointwise, fwd func(dst, x []T) error, bwd func(dx, saved, dy []T) error, saveOut bool) func(*Tape, *placement.Spec, *Value) (*Value, error) {
	return func(t *Tape, spec *placement.Spec, x *Value) (*Value, error) {
		if d, ok := onDevice(x.data); ok {
			return pointwiseDev(t, d, op, f, spec, x, saveOut)
		}
		xd, err := dataOf[T](x.data)
		if err != nil {
			return nil, err
		}
		y := resultBlock[T](t, len(xd))
		if err := fwd(y, xd); err != nil {
			return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
		}
		saved := xd
		if saveOut {
			saved = y
		}
		return recordUnary(t, op, x, spec, y, func(gd []T, _ []int) ([]T, error) {
			dx := getBuf[T](t, len(gd))
			if err := bwd(dx, saved, gd); err != nil {
				return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
			}
			return dx, nil
		})
	}
}

// Dropout zeroes each element of x with probability p and scales the
// others by 1/(1−p) (inverted dropout: the expectation is x). Whether an
// element is dropped depends only on (seed, step, its global index), see
// kernels.DropoutMask: every layout of x draws the mask one rank would
// draw for the whole tensor, so ranks holding the same elements
// (Replicate, Partial) drop the same ones and ranks holding different
// elements (Shard) draw independently, and a parallel run equals a
// serial one exactly. The caller varies step between calls (the Dropout
// module of package parallel counts its calls) and keeps seed and step
// the same on every rank. p must lie in [0, 1) (p = 0 returns x itself).
// Sharding rule: any placement passes through (x ⊙ mask commutes with
// every reduction, the mask being ≥ 0 and the same on all holders).
// Backward: g ⊙ mask, laid out like g. A Routed x without row counts is
// rejected (it has no global index).
func Dropout(x *Value, p float64, seed, step uint64) (*Value, error) {
	const op = "Dropout"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	if err := numcheck.Fraction(ErrInvalid, "probability", p); err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	spec := x.Spec()
	off, box, err := spec.Box(spec.Mesh().Rank())
	if err != nil {
		return nil, invalidf(op, "x has no global layout: %v", err)
	}
	if p == 0 {
		return x, nil
	}
	if isF32(spec) {
		return dropoutOp[float32](t, x, off, box, p, seed, step)
	}
	return dropoutOp[float64](t, x, off, box, p, seed, step)
}

func dropoutOp[T float](t *Tape, x *Value, off, box []int, p float64, seed, step uint64) (*Value, error) {
	const op = "Dropout"
	if d, ok := onDevice(x.data); ok {
		return dropoutDev(t, d, x, off, box, p, seed, step)
	}
	xd, err := dataOf[T](x.data)
	if err != nil {
		return nil, err
	}
	// The mask lives until backward: a plain allocation, not the arena.
	mask := make([]T, len(xd))
	if err := kernels.DropoutMask(mask, off, box, x.Spec().Shape(), p, seed, step); err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	y := resultBlock[T](t, len(xd))
	if err := kernels.Mul(y, xd, mask); err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	return recordUnary(t, op, x, x.Spec(), y, func(gd []T, _ []int) ([]T, error) {
		dx := getBuf[T](t, len(gd))
		if err := kernels.Mul(dx, gd, mask); err != nil {
			return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
		}
		return dx, nil
	})
}

// Mean averages a over dims (every dim when none are given), removing
// them: Sum scaled by 1/(the product of the reduced dims' global sizes).
// Sharding rule: MeanRule. Backward: the gradient broadcast over the
// reduced dims and scaled, as Sum's. A mean over an empty dim is NaN.
func Mean(a *Value, dims ...int) (*Value, error) {
	const op = "Mean"
	if _, err := checkInputs(op, a); err != nil {
		return nil, err
	}
	if _, err := MeanRule(a.Spec(), dims...); err != nil {
		return nil, err
	}
	s, err := Sum(a, dims...)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return Scale(s, 1/float64(reducedCount(a.Spec().Shape(), dims)))
}

// MeanRule is the sharding rule of Mean; it is SumRule's (a mean over a
// sharded dim is Partial(sum) of the scaled local sums).
func MeanRule(a *placement.Spec, dims ...int) (*placement.Spec, error) {
	return SumRule(a, dims...)
}

// reducedCount is the number of elements each result of a reduction over
// dims (all when none) of shape averages.
func reducedCount(shape, dims []int) int {
	n := 1
	if len(dims) == 0 {
		return prod(shape)
	}
	for _, d := range dims {
		n *= shape[d]
	}
	return n
}

// MSE returns the mean over all elements of (pred − target)², a scalar
// (PyTorch's MSELoss with reduction "mean"). pred and target must have
// the same spec (target is usually a Constant). Sharding rule: MSERule.
// Backward: 2·(pred − target)·g/N to pred and its negative to target.
func MSE(pred, target *Value) (*Value, error) {
	const op = "MSE"
	if _, err := checkInputs(op, pred, target); err != nil {
		return nil, err
	}
	if _, err := MSERule(pred.Spec(), target.Spec()); err != nil {
		return nil, err
	}
	neg, err := Scale(target, -1)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	d, err := Add(pred, neg)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	sq, err := Mul(d, d)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return Mean(sq)
}

// MSERule is the sharding rule of MSE: pred and target have the same
// spec, without Partial placements (the square is nonlinear); the result
// is a scalar that is Partial(sum) on the axes sharding any dim (each
// rank contributes its elements' squared errors divided by the global
// count) and Replicate elsewhere, like CrossEntropy's.
func MSERule(pred, target *placement.Spec) (*placement.Spec, error) {
	const op = "MSE"
	if pred == nil || target == nil {
		return nil, invalidf(op, "nil spec")
	}
	if !pred.Equal(target) {
		return nil, rulef(op, "pred is %v but target is %v; lay out the target exactly like the prediction", pred, target)
	}
	if err := nonPartial(op, "pred", pred); err != nil {
		return nil, err
	}
	return SumRule(pred)
}

// Argmax returns, for every position of x's leading dims, the index of
// the largest value along the last dim (the first on ties; NaN wins):
// int64 Indices of shape x's without the last dim, laid out like x's
// leading dims. It is not differentiable and records nothing. x must have
// at least one dim and a non-empty last dim, no Partial placement, and
// must not be sharded on the last dim (each rank would see a slice of
// every row). Errors wrap ErrInvalid (ErrRule for layouts).
func Argmax(x *Value) (*Indices, error) {
	const op = "Argmax"
	if _, err := checkInputs(op, x); err != nil {
		return nil, err
	}
	spec := x.Spec()
	shape := spec.Shape()
	if len(shape) == 0 || shape[len(shape)-1] == 0 {
		return nil, invalidf(op, "x of shape %v has no last dim to search", shape)
	}
	last := len(shape) - 1
	if err := nonPartial(op, "x", spec); err != nil {
		return nil, err
	}
	if o := spec.Order(last); len(o) > 0 {
		return nil, rulef(op, "argmax over a sharded dim: x is sharded on its last dim by mesh axes %v; redistribute it to Replicate there first", o)
	}
	var opts []placement.SpecOption
	for d := range last {
		if o := spec.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	ixSpec, err := indexSpec(op, spec.Mesh(), shape[:last], spec.Placements(), opts)
	if err != nil {
		return nil, err
	}
	n := shape[last]
	if d, ok := onDevice(x.data); ok {
		out, err := argmaxDev(d, x.data, n)
		if err != nil {
			return nil, err
		}
		return &Indices{spec: ixSpec, data: out}, nil
	}
	var out []int64
	switch d := x.data.LocalData().(type) {
	case []float32:
		out = make([]int64, len(d)/n)
		err = kernels.ArgmaxRows(out, d, n)
	case []float64:
		out = make([]int64, len(d)/n)
		err = kernels.ArgmaxRows(out, d, n)
	default:
		return nil, fmt.Errorf("autograd: %s: local data of type %T", op, d)
	}
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: internal: %w", op, err)
	}
	return &Indices{spec: ixSpec, data: out}, nil
}

// Accuracy returns the fraction of positions where pred equals target,
// over all global positions: a collective over the mesh axes that shard
// them (every rank of the mesh calls it and gets the same value). pred and
// target must have the same shape, with at least one element, and the same
// layout (placements and shard orders). Errors wrap ErrInvalid.
func Accuracy(ctx context.Context, pred, target *Indices) (float64, error) {
	const op = "Accuracy"
	if !pred.valid() || !target.valid() {
		return 0, invalidf(op, "nil or zero Indices")
	}
	ps, ts := pred.spec, target.spec
	if err := sameMeshes(op, ps, ts); err != nil {
		return 0, err
	}
	if !slices.Equal(ps.Shape(), ts.Shape()) || !slices.Equal(ps.Placements(), ts.Placements()) {
		return 0, invalidf(op, "pred %v and target %v differ in shape or layout", pred, target)
	}
	for d := range ps.Shape() {
		if !slices.Equal(ps.Order(d), ts.Order(d)) {
			return 0, invalidf(op, "dim %d is sharded over mesh axes %v in pred but %v in target", d, ps.Order(d), ts.Order(d))
		}
	}
	n := prod(ps.Shape())
	if n == 0 {
		return 0, invalidf(op, "no positions (shape %v)", ps.Shape())
	}
	hits := 0
	for i, v := range pred.data {
		if v == target.data[i] {
			hits++
		}
	}
	// Each rank's share of the fraction is Partial(sum) on the axes that
	// split the positions; Full sums it there.
	places := ps.Placements()
	for ax, p := range places {
		if p.IsShard() {
			places[ax] = placement.Partial(comm.Sum)
		}
	}
	spec, err := placement.NewSpec(ps.Mesh(), []int{}, comm.Float64, places)
	if err != nil {
		return 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	dt, err := placement.NewLocal(spec, []float64{float64(hits) / float64(n)})
	if err != nil {
		return 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	full, err := dt.Full(ctx)
	if err != nil {
		return 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return full.([]float64)[0], nil
}
