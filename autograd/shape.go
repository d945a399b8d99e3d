package autograd

import (
	"context"
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Shape ops: Narrow, SplitLast and Concat (slices along a dim), Permute
// and Transpose, and Reshape, with their sharding rules and local copy
// loops. They move elements only within each rank's block.

// Narrow returns entries start … start+length−1 of x along dim (negative
// dims count from the end). Sharding rule: NarrowRule (dim not sharded).
// Backward pads the gradient with zeros, laid out like g.
func Narrow(x *Value, dim, start, length int) (*Value, error) {
	const op = "Narrow"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	spec, d, err := narrowRule(x.Spec(), dim, start, length)
	if err != nil {
		return nil, err
	}
	full := x.Spec().Shape()[d]
	lshape := x.data.LocalShape()
	out, err := narrowLocal(t.result(), spec, x.data, lshape, d, start, length)
	if err != nil {
		return nil, err
	}
	in := x.Spec()
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		s, err := gradSpec(in, g.Spec().Placements())
		if err != nil {
			return nil, err
		}
		gshape := g.LocalShape()
		gx, err := padLocal(t.scratch(), s, g, gshape, d, start, full)
		return []*placement.DTensor{gx}, err
	}), nil
}

// NarrowRule is the sharding rule of Narrow(x, dim, start, length): dim
// (negative counts from the end) must not be sharded ("narrow over a
// sharded dim": each rank holds a different slice of it); Replicate,
// Shard of other dims and Partial (narrowing is linear) are kept. The
// result has length entries along dim.
func NarrowRule(x *placement.Spec, dim, start, length int) (*placement.Spec, error) {
	s, _, err := narrowRule(x, dim, start, length)
	return s, err
}

func narrowRule(x *placement.Spec, dim, start, length int) (*placement.Spec, int, error) {
	const op = "Narrow"
	if x == nil {
		return nil, 0, invalidf(op, "nil spec")
	}
	sh := x.Shape()
	d, err := normDim(op, dim, len(sh))
	if err != nil {
		return nil, 0, err
	}
	if start < 0 || length <= 0 || start+length > sh[d] {
		return nil, 0, invalidf(op, "range [%d, %d) does not fit dim %d of size %d", start, start+length, d, sh[d])
	}
	if o := x.Order(d); len(o) > 0 {
		return nil, 0, rulef(op, "narrow over a sharded dim: x is sharded on dim %d by mesh axes %v; redistribute that dim to Replicate first (or, for a fused q|k|v projection, interleave the weight's rows per rank so that the split is local)", d, o)
	}
	if err := sumOnly(op, "x", x, "narrowing is linear only over Partial(sum)"); err != nil {
		return nil, 0, err
	}
	sh[d] = length
	out, err := specWith(x, sh, x.Placements(), ordersOf(x))
	if err != nil {
		return nil, 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, d, nil
}

// SplitLast splits the last dim of x into k equal parts (Narrow of each),
// e.g. a fused q|k|v projection into q, k and v. The last dim must be
// divisible by k and not sharded.
func SplitLast(x *Value, k int) ([]*Value, error) {
	if x == nil || x.data == nil {
		return nil, invalidf("SplitLast", "input 0 is nil")
	}
	sh := x.Spec().Shape()
	if len(sh) == 0 || k <= 0 || sh[len(sh)-1]%k != 0 {
		return nil, invalidf("SplitLast", "cannot split shape %v into %d equal parts along the last dim", sh, k)
	}
	n := sh[len(sh)-1] / k
	out := make([]*Value, k)
	for i := range out {
		v, err := Narrow(x, -1, i*n, n)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// Concat joins xs along dim (negative counts from the end). Sharding rule:
// ConcatRule. Backward narrows the gradient back into pieces, laid out
// like g.
func Concat(dim int, xs ...*Value) (*Value, error) {
	const op = "Concat"
	t, err := checkInputs(op, xs...)
	if err != nil {
		return nil, err
	}
	specs := make([]*placement.Spec, len(xs))
	for i, x := range xs {
		specs[i] = x.Spec()
	}
	spec, d, err := concatRule(dim, specs)
	if err != nil {
		return nil, err
	}
	sizes := make([]int, len(xs))
	lshapes := make([][]int, len(xs))
	blocks := make([]any, len(xs))
	for i, x := range xs {
		sizes[i] = specs[i].Shape()[d]
		lshapes[i] = x.data.LocalShape()
		blocks[i] = x.data.LocalData()
	}
	out, err := concatLocal(t.result(), spec, blocks, lshapes, d)
	if err != nil {
		return nil, err
	}
	return t.record(op, out, xs, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gshape := g.LocalShape()
		grads := make([]*placement.DTensor, len(xs))
		off := 0
		for i, x := range xs {
			if x.requiresGrad {
				s, err := gradSpec(specs[i], g.Spec().Placements())
				if err != nil {
					return nil, err
				}
				o := off
				if grads[i], err = narrowLocal(t.scratch(), s, g, gshape, d, o, sizes[i]); err != nil {
					return nil, err
				}
			}
			off += sizes[i]
		}
		return grads, nil
	}), nil
}

// ConcatRule is the sharding rule of Concat along dim: the inputs have
// equal shapes except along dim, the same placements (Replicate, Shard or
// Partial(sum), as for Add) and shard orders, and dim is not sharded. The
// result has their placements.
func ConcatRule(dim int, xs ...*placement.Spec) (*placement.Spec, error) {
	s, _, err := concatRule(dim, xs)
	return s, err
}

func concatRule(dim int, xs []*placement.Spec) (*placement.Spec, int, error) {
	const op = "Concat"
	if len(xs) == 0 {
		return nil, 0, invalidf(op, "no inputs")
	}
	for i, x := range xs {
		if x == nil {
			return nil, 0, invalidf(op, "input %d has a nil spec", i)
		}
	}
	first := xs[0]
	sh := first.Shape()
	d, err := normDim(op, dim, len(sh))
	if err != nil {
		return nil, 0, err
	}
	if err := sumOnly(op, "input 0", first, "concatenation is linear only over Partial(sum)"); err != nil {
		return nil, 0, err
	}
	if o := first.Order(d); len(o) > 0 {
		return nil, 0, rulef(op, "concat along a sharded dim: input 0 is sharded on dim %d by mesh axes %v; redistribute that dim to Replicate first", d, o)
	}
	total := 0
	names := first.Mesh().Names()
	for i, x := range xs {
		if err := compatible(op, first, x); err != nil {
			return nil, 0, err
		}
		s := x.Shape()
		if len(s) != len(sh) {
			return nil, 0, invalidf(op, "input %d has shape %v, input 0 %v", i, s, sh)
		}
		for k := range s {
			if k != d && s[k] != sh[k] {
				return nil, 0, invalidf(op, "input %d has shape %v, input 0 %v: they may differ only along dim %d", i, s, sh, d)
			}
		}
		total += s[d]
		p0, pi := first.Placements(), x.Placements()
		for ax := range p0 {
			if p0[ax] != pi[ax] {
				return nil, 0, rulef(op, "input 0 is %v but input %d is %v on mesh axis %q; all inputs need the same placement: redistribute input %d to %v", p0[ax], i, pi[ax], names[ax], i, p0[ax])
			}
		}
		for k := range s {
			if !slices.Equal(first.Order(k), x.Order(k)) {
				return nil, 0, rulef(op, "input %d shards dim %d over mesh axes %v but input 0 over %v; redistribute it to input 0's spec", i, k, x.Order(k), first.Order(k))
			}
		}
	}
	sh[d] = total
	out, err := specWith(first, sh, first.Placements(), ordersOf(first))
	if err != nil {
		return nil, 0, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, d, nil
}

// narrowLocal, padLocal and concatLocal put their result in a block as a
// says (scratch for a gradient, a result for an op's result), through
// kernels.NarrowDim, PadDim and ConcatDim, and lay it out by spec.
func narrowLocal(a alloc, spec *placement.Spec, x *placement.DTensor, shape []int, d, start, length int) (*placement.DTensor, error) {
	if dev, ok := onDevice(x); ok {
		outer, n, inner := splitDim(shape, d)
		return devShape("Narrow", a, dev, spec, func(k device.Kernels, out device.Buffer) error {
			return k.NarrowDim(out, bufOf(x), outer, n, inner, start, length)
		})
	}
	switch v := x.LocalData().(type) {
	case []float32:
		return narrowT(a, spec, v, shape, d, start, length)
	case []float64:
		return narrowT(a, spec, v, shape, d, start, length)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

func padLocal(a alloc, spec *placement.Spec, g *placement.DTensor, shape []int, d, start, full int) (*placement.DTensor, error) {
	if dev, ok := onDevice(g); ok {
		outer, n, inner := splitDim(shape, d)
		return devShape("Narrow", a, dev, spec, func(k device.Kernels, out device.Buffer) error {
			return k.PadDim(out, bufOf(g), outer, n, inner, start, full)
		})
	}
	switch v := g.LocalData().(type) {
	case []float32:
		return padT(a, spec, v, shape, d, start, full)
	case []float64:
		return padT(a, spec, v, shape, d, start, full)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", g.LocalData())
}

func concatLocal(a alloc, spec *placement.Spec, blocks []any, shapes [][]int, d int) (*placement.DTensor, error) {
	if b0, ok := blocks[0].(device.Buffer); ok {
		outer, _, inner := splitDim(shapes[0], d)
		xs, sizes := make([]device.Buffer, len(blocks)), make([]int, len(blocks))
		for i, b := range blocks {
			if xs[i], ok = b.(device.Buffer); !ok {
				return nil, fmt.Errorf("autograd: Concat: internal: input %d holds %T, input 0 %T", i, b, blocks[0])
			}
			sizes[i] = shapes[i][d]
		}
		return devShape("Concat", a, b0.Owner(), spec, func(k device.Kernels, out device.Buffer) error {
			return k.ConcatDim(out, xs, sizes, outer, inner)
		})
	}
	switch blocks[0].(type) {
	case []float32:
		return concatT[float32](a, spec, blocks, shapes, d)
	case []float64:
		return concatT[float64](a, spec, blocks, shapes, d)
	}
	return nil, fmt.Errorf("autograd: local data of type %T", blocks[0])
}

func narrowT[T float](a alloc, spec *placement.Spec, x []T, shape []int, d, start, length int) (*placement.DTensor, error) {
	outer, n, inner := splitDim(shape, d)
	out := block[T](a, outer*length*inner)
	if err := kernels.NarrowDim(out, x, outer, n, inner, start, length); err != nil {
		return nil, fmt.Errorf("autograd: Narrow: internal: %w", err)
	}
	return placement.NewLocal(spec, out)
}

func padT[T float](a alloc, spec *placement.Spec, g []T, shape []int, d, start, full int) (*placement.DTensor, error) {
	outer, n, inner := splitDim(shape, d)
	out := block[T](a, outer*full*inner)
	if err := kernels.PadDim(out, g, outer, n, inner, start, full); err != nil {
		return nil, fmt.Errorf("autograd: Narrow: internal: %w", err)
	}
	return placement.NewLocal(spec, out)
}

func concatT[T float](a alloc, spec *placement.Spec, blocks []any, shapes [][]int, d int) (*placement.DTensor, error) {
	outer, _, inner := splitDim(shapes[0], d)
	xs := make([][]T, len(blocks))
	sizes := make([]int, len(blocks))
	total := 0
	for i, b := range blocks {
		x, ok := b.([]T)
		if !ok {
			return nil, fmt.Errorf("autograd: Concat: internal: input %d holds %T, input 0 %T", i, b, blocks[0])
		}
		xs[i], sizes[i] = x, shapes[i][d]
		total += sizes[i]
	}
	out := block[T](a, outer*total*inner)
	if err := kernels.ConcatDim(out, xs, sizes, outer, inner); err != nil {
		return nil, fmt.Errorf("autograd: Concat: internal: %w", err)
	}
	return placement.NewLocal(spec, out)
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
			places[ax] = p.WithDim(inv[p.Dim()])
		}
	}
	out, err := specWith(x, shape, places, orders)
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, nil
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

// permuteLocal permutes x's local block into a block as a says.
func permuteLocal(a alloc, spec *placement.Spec, x *placement.DTensor, perm []int) (*placement.DTensor, error) {
	shape := x.LocalShape()
	if dev, ok := onDevice(x); ok {
		return devShape("Permute", a, dev, spec, func(k device.Kernels, out device.Buffer) error {
			return k.PermuteDims(out, bufOf(x), shape, perm)
		})
	}
	if isF32(spec) {
		d, err := dataOf[float32](x)
		if err != nil {
			return nil, err
		}
		return permuteT(spec, block[float32](a, len(d)), d, shape, perm)
	}
	d, err := dataOf[float64](x)
	if err != nil {
		return nil, err
	}
	return permuteT(spec, block[float64](a, len(d)), d, shape, perm)
}

// permuteT writes into out (len(x) elements) the block of shape permuted
// so that result dim i is input dim perm[i] (kernels.PermuteDims).
func permuteT[T float](spec *placement.Spec, out, x []T, shape, perm []int) (*placement.DTensor, error) {
	out = out[:len(x)]
	if err := kernels.PermuteDims(out, x, shape, perm); err != nil {
		return nil, fmt.Errorf("autograd: Permute: internal: %w", err)
	}
	return placement.NewLocal(spec, out)
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
	out, err := rewrap(spec, x.data)
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
		gx, err := rewrap(s, g)
		return []*placement.DTensor{gx}, err
	}), nil
}

// rewrap lays x's local block (not a copy) out by spec: Reshape's view,
// on the host or a device.
func rewrap(spec *placement.Spec, x *placement.DTensor) (*placement.DTensor, error) {
	if b := bufOf(x); b != nil {
		return placement.NewLocalOn(spec, b)
	}
	return placement.NewLocal(spec, x.LocalData())
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
			// A balanced dim's permutation is of its own length: it
			// survives a reshape only unmerged and unsplit.
			if p.IsBalanced() && sx[p.Dim()] != shape[newDim[p.Dim()]] {
				return nil, nil, rulef(op, "dim %d of %v is load-balanced (%v) and would become dim %d of size %d of %v: a balanced dim must keep its size; redistribute it to Shard or Replicate first", p.Dim(), sx, p, newDim[p.Dim()], shape[newDim[p.Dim()]], shape)
			}
			places[ax] = p.WithDim(newDim[p.Dim()])
			orders[newDim[p.Dim()]] = x.Order(p.Dim())
		}
	}
	out, err := specWith(x, shape, places, orders)
	if err != nil {
		return nil, nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	return out, shape, nil
}
