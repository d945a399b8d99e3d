package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// float is the element type of local blocks.
type float interface{ float32 | float64 }

func prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// filled returns a tensor laid out by spec whose local block is v
// everywhere.
func filled(spec *placement.Spec, v float64) (*placement.DTensor, error) {
	n := prod(spec.LocalShape())
	if spec.DType() == comm.Float32 {
		d := make([]float32, n)
		for i := range d {
			d[i] = float32(v)
		}
		return placement.NewLocal(spec, d)
	}
	d := make([]float64, n)
	for i := range d {
		d[i] = v
	}
	return placement.NewLocal(spec, d)
}

// clone copies a tensor's local block.
func clone(dt *placement.DTensor) (*placement.DTensor, error) {
	switch d := dt.LocalData().(type) {
	case []float32:
		return placement.NewLocal(dt.Spec(), slices.Clone(d))
	case []float64:
		return placement.NewLocal(dt.Spec(), slices.Clone(d))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", dt.LocalData())
}

// zip applies f element-wise to the local blocks of x and y (same length
// and dtype) and lays the result out by spec.
func zip(spec *placement.Spec, x, y *placement.DTensor, f32 func(a, b []float32) []float32, f64 func(a, b []float64) []float64) (*placement.DTensor, error) {
	switch xd := x.LocalData().(type) {
	case []float32:
		yd, ok := y.LocalData().([]float32)
		if !ok || len(yd) != len(xd) {
			return nil, fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
		}
		return placement.NewLocal(spec, f32(xd, yd))
	case []float64:
		yd, ok := y.LocalData().([]float64)
		if !ok || len(yd) != len(xd) {
			return nil, fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
		}
		return placement.NewLocal(spec, f64(xd, yd))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// addInto sets out = a + b (float32 on the vector kernel) and returns it.
func addInto[T float](out, a, b []T) []T {
	b, out = b[:len(a)], out[:len(a)]
	if o32, ok := any(out).([]float32); ok {
		_ = kernels.Add(o32, any(a).([]float32), any(b).([]float32)) // lengths match
		return out
	}
	for i, v := range a {
		out[i] = v + b[i]
	}
	return out
}

func mulInto[T float](out, a, b []T) []T {
	b, out = b[:len(a)], out[:len(a)]
	for i, v := range a {
		out[i] = v * b[i]
	}
	return out
}

// add is the element-wise sum, in a block as a says.
func add(a alloc, spec *placement.Spec, x, y *placement.DTensor) (*placement.DTensor, error) {
	return zip(spec, x, y,
		func(u, v []float32) []float32 { return addInto(block[float32](a, len(u)), u, v) },
		func(u, v []float64) []float64 { return addInto(block[float64](a, len(u)), u, v) })
}

// mul is the element-wise product, in a block as a says.
func mul(a alloc, spec *placement.Spec, x, y *placement.DTensor) (*placement.DTensor, error) {
	return zip(spec, x, y,
		func(u, v []float32) []float32 { return mulInto(block[float32](a, len(u)), u, v) },
		func(u, v []float64) []float64 { return mulInto(block[float64](a, len(u)), u, v) })
}

func scaleInto[T float](out, a []T, c T) []T {
	out = out[:len(a)]
	for i, v := range a {
		out[i] = v * c
	}
	return out
}

// scale multiplies the local block of x by c and lays it out by spec, in a
// block as a says.
func scale(a alloc, spec *placement.Spec, x *placement.DTensor, c float64) (*placement.DTensor, error) {
	switch d := x.LocalData().(type) {
	case []float32:
		return placement.NewLocal(spec, scaleInto(block[float32](a, len(d)), d, float32(c)))
	case []float64:
		return placement.NewLocal(spec, scaleInto(block[float64](a, len(d)), d, c))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// reduceIndex returns, for a row-major array of shape, the strides that map
// each element to its position in the array with the reduced dims removed
// (stride 0 on reduced dims).
func reduceIndex(shape []int, reduce []bool) []int {
	st := make([]int, len(shape))
	s := 1
	for d := len(shape) - 1; d >= 0; d-- {
		if reduce[d] {
			continue
		}
		st[d] = s
		s *= shape[d]
	}
	return st
}

// forEach calls f(i, j) for every element i of a row-major array of shape,
// with j its index under the strides st.
func forEach(shape, st []int, f func(i, j int)) {
	n := prod(shape)
	if n == 0 {
		return
	}
	idx := make([]int, len(shape))
	j := 0
	for i := range n {
		f(i, j)
		for d := len(shape) - 1; d >= 0; d-- {
			idx[d]++
			j += st[d]
			if idx[d] < shape[d] {
				break
			}
			j -= st[d] * shape[d]
			idx[d] = 0
		}
	}
}

func sumT[T float](x []T, shape []int, reduce []bool) []T {
	if !slices.Contains(reduce, false) { // every dim: one total, in the same order
		var s T
		for _, v := range x {
			s += v
		}
		return []T{s}
	}
	st := reduceIndex(shape, reduce)
	n := 1
	for d, s := range shape {
		if !reduce[d] {
			n *= s
		}
	}
	out := make([]T, n)
	forEach(shape, st, func(i, j int) { out[j] += x[i] })
	return out
}

func broadcastT[T float](out, g []T, shape []int, reduce []bool) []T {
	if !slices.Contains(reduce, false) && len(g) == 1 { // a scalar everywhere
		for i := range out {
			out[i] = g[0]
		}
		return out
	}
	st := reduceIndex(shape, reduce)
	forEach(shape, st, func(i, j int) { out[i] = g[j] })
	return out
}

// sumLocal sums x's local block over the reduced dims; spec is the
// result's layout.
func sumLocal(spec *placement.Spec, x *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	shape := x.LocalShape()
	switch d := x.LocalData().(type) {
	case []float32:
		return placement.NewLocal(spec, sumT(d, shape, reduce))
	case []float64:
		return placement.NewLocal(spec, sumT(d, shape, reduce))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", x.LocalData())
}

// broadcastLocal expands g's local block over the reduced dims of spec's
// local shape into t's arena (a gradient); spec is the result's layout.
func broadcastLocal(t *Tape, spec *placement.Spec, g *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	shape := spec.LocalShape()
	want := 1
	for d, s := range shape {
		if !reduce[d] {
			want *= s
		}
	}
	switch d := g.LocalData().(type) {
	case []float32:
		if len(d) != want {
			return nil, fmt.Errorf("autograd: internal: gradient block %v does not fit %v", g.LocalShape(), shape)
		}
		return placement.NewLocal(spec, broadcastT(getBuf[float32](t, prod(shape)), d, shape, reduce))
	case []float64:
		if len(d) != want {
			return nil, fmt.Errorf("autograd: internal: gradient block %v does not fit %v", g.LocalShape(), shape)
		}
		return placement.NewLocal(spec, broadcastT(getBuf[float64](t, prod(shape)), d, shape, reduce))
	}
	return nil, fmt.Errorf("autograd: local data of type %T", g.LocalData())
}

// gemm computes op(A)·op(B) for local row-major blocks, where op(A) is m×k
// and op(B) is k×n, and lays the m×n result out by spec, in a block as a
// says: scratch for a gradient (of an intermediate value, or of a leaf,
// which Backward copies), a result for an op's result.
func gemm(a alloc, b *kernels.BLAS, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, m, n, k int) (*placement.DTensor, error) {
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

// addInPlace adds y's local block into x's (same length and dtype).
func addInPlace(x, y *placement.DTensor) error {
	switch xd := x.LocalData().(type) {
	case []float32:
		if yd, ok := y.LocalData().([]float32); ok && len(yd) == len(xd) {
			addInto(xd, xd, yd)
			return nil
		}
	case []float64:
		if yd, ok := y.LocalData().([]float64); ok && len(yd) == len(xd) {
			addInto(xd, xd, yd)
			return nil
		}
	}
	return fmt.Errorf("autograd: internal: local blocks %v and %v do not match", x.LocalShape(), y.LocalShape())
}
