package kernels

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/internal/checked"
)

// Elementwise and layout kernels: the arithmetic of autograd's elementwise
// ops (Add, Mul, Scale), of Sum and its broadcast backward, of the shape
// ops (Permute, Narrow and its zero-padding backward, Concat), of the
// gradient seed and the bias prefill. Each works on row-major slices in
// T's precision, so that a device can replace it one call for one call.
// Every kernel checks its lengths and sizes first and returns ErrInvalid
// before writing anything; none allocates more than a few indices.

// Scale sets dst[i] = c·x[i]. dst may alias x; both must have the same
// length. float32 runs on the vector kernel.
func Scale[T Float](dst, x []T, c T) error {
	if len(x) != len(dst) {
		return fmt.Errorf("kernels: Scale: %w: lengths %d and %d differ", ErrInvalid, len(dst), len(x))
	}
	if d32, ok := any(dst).([]float32); ok {
		scaleF32(d32, any(x).([]float32), any(c).(float32))
		return nil
	}
	permScale(dst, x, c)
	return nil
}

// Fill sets every element of dst to v.
func Fill[T Float](dst []T, v T) {
	for i := range dst {
		dst[i] = v
	}
}

// FillRows copies row into every row of dst (rows of len(row) values): a
// bias broadcast over a batch, which a GEMM with beta = 1 then adds into.
// len(dst) must be a whole number of rows (0 when row is empty).
func FillRows[T Float](dst, row []T) error {
	rows, err := rowCount("FillRows", len(dst), len(row))
	if err != nil {
		return err
	}
	n := len(row)
	for r := range rows {
		copy(dst[r*n:(r+1)*n], row)
	}
	return nil
}

// size returns the product of dims, rejecting negative sizes and overflow.
// The errors quote a copy of dims, so that dims does not escape and the
// call allocates nothing.
func size(op string, dims ...int) (int, error) {
	for _, d := range dims {
		if d < 0 {
			return 0, fmt.Errorf("kernels: %s: %w: negative size in %v", op, ErrInvalid, slices.Clone(dims))
		}
	}
	n, ok := checked.Product(dims)
	if !ok {
		return 0, fmt.Errorf("kernels: %s: %w: sizes %v overflow int", op, ErrInvalid, slices.Clone(dims))
	}
	return n, nil
}

// reduceShape checks x (shape) and reduce (one flag per dim) and returns
// the number of elements of x and of the result with the reduced dims
// removed, and the result's strides mapped onto x's dims (0 on reduced
// dims).
func reduceShape(op string, lx int, shape []int, reduce []bool) (n, kept int, st []int, err error) {
	if len(reduce) != len(shape) {
		return 0, 0, nil, fmt.Errorf("kernels: %s: %w: %d reduce flags for a %d-d shape", op, ErrInvalid, len(reduce), len(shape))
	}
	if n, err = size(op, shape...); err != nil {
		return 0, 0, nil, err
	}
	if lx != n {
		return 0, 0, nil, fmt.Errorf("kernels: %s: %w: %d elements for shape %v", op, ErrInvalid, lx, shape)
	}
	st = make([]int, len(shape))
	kept = 1
	for d := len(shape) - 1; d >= 0; d-- {
		if !reduce[d] {
			st[d] = kept
			kept *= shape[d]
		}
	}
	return n, kept, st, nil
}

// SumDims sets out to the sum of x (a row-major array of shape) over the
// dims d with reduce[d], the result laid out row-major over the remaining
// dims (len(out) is their product; 1 when every dim is reduced). Each
// output element adds its inputs in row-major order, in T's precision.
func SumDims[T Float](out, x []T, shape []int, reduce []bool) error {
	const op = "SumDims"
	n, kept, st, err := reduceShape(op, len(x), shape, reduce)
	if err != nil {
		return err
	}
	if len(out) != kept {
		return fmt.Errorf("kernels: %s: %w: out has %d elements, want %d", op, ErrInvalid, len(out), kept)
	}
	if kept == 1 { // one total, in the same order, without the odometer
		var s T
		for _, v := range x {
			s += v
		}
		out[0] = s
		return nil
	}
	clear(out)
	if n == 0 {
		return nil
	}
	idx := make([]int, len(shape))
	j := 0
	for i := range n {
		out[j] += x[i]
		j = step(idx, shape, st, j)
	}
	return nil
}

// BroadcastDims is SumDims' adjoint: it sets out (a row-major array of
// shape) to g (laid out over the dims d without reduce[d]) repeated over
// the reduced dims.
func BroadcastDims[T Float](out, g []T, shape []int, reduce []bool) error {
	const op = "BroadcastDims"
	n, kept, st, err := reduceShape(op, len(out), shape, reduce)
	if err != nil {
		return err
	}
	if len(g) != kept {
		return fmt.Errorf("kernels: %s: %w: g has %d elements, want %d", op, ErrInvalid, len(g), kept)
	}
	if kept == 1 { // a scalar everywhere
		Fill(out, g[0])
		return nil
	}
	idx := make([]int, len(shape))
	j := 0
	for i := range n {
		out[i] = g[j]
		j = step(idx, shape, st, j)
	}
	return nil
}

// step advances the row-major index idx over shape by one element and
// returns j moved by the strides st accordingly.
func step(idx, shape, st []int, j int) int {
	for d := len(shape) - 1; d >= 0; d-- {
		idx[d]++
		j += st[d]
		if idx[d] < shape[d] {
			break
		}
		j -= st[d] * shape[d]
		idx[d] = 0
	}
	return j
}

// PermuteDims writes into out the row-major array x of shape with its
// dims reordered: out's dim i is x's dim perm[i]. out and x have
// prod(shape) elements and must not overlap. Trailing dims that keep
// their order are copied as contiguous runs; otherwise each output row is
// a strided gather.
func PermuteDims[T Float](out, x []T, shape, perm []int) error {
	const op = "PermuteDims"
	n, err := size(op, shape...)
	if err != nil {
		return err
	}
	if len(x) != n || len(out) != n {
		return fmt.Errorf("kernels: %s: %w: out %d and x %d elements for shape %v", op, ErrInvalid, len(out), len(x), shape)
	}
	if len(perm) != len(shape) {
		return fmt.Errorf("kernels: %s: %w: perm %v for a %d-d shape", op, ErrInvalid, perm, len(shape))
	}
	for i, p := range perm {
		if p < 0 || p >= len(perm) || indexOf(perm[:i], p) {
			return fmt.Errorf("kernels: %s: %w: perm %v is not a permutation of 0..%d", op, ErrInvalid, perm, len(perm)-1)
		}
	}
	if n == 0 {
		return nil
	}
	// Strides of the input, in output-dim order.
	in := make([]int, len(shape))
	s := 1
	for d := len(shape) - 1; d >= 0; d-- {
		in[d] = s
		s *= shape[d]
	}
	oshape := make([]int, len(perm))
	st := make([]int, len(perm))
	for i, p := range perm {
		oshape[i], st[i] = shape[p], in[p]
	}
	// Merge trailing output dims that are contiguous in the input.
	r := len(oshape)
	run := 1
	for r > 0 && st[r-1] == run {
		run *= oshape[r-1]
		r--
	}
	if run > 1 || r == 0 {
		// Copy runs of `run` contiguous elements; odometer over dims [0, r).
		idx := make([]int, r)
		j := 0
		for o := 0; o < n; o += run {
			copy(out[o:o+run], x[j:j+run])
			j = step(idx, oshape[:r], st[:r], j)
		}
		return nil
	}
	// The last output dim is strided in the input: gather each output row.
	m, stride := oshape[r-1], st[r-1]
	idx := make([]int, r-1)
	j := 0
	for o := 0; o < n; o += m {
		row := out[o : o+m]
		k := j
		for c := range row {
			row[c] = x[k]
			k += stride
		}
		j = step(idx, oshape[:r-1], st[:r-1], j)
	}
	return nil
}

// indexOf reports whether v is in s.
func indexOf(s []int, v int) bool {
	for _, e := range s {
		if e == v {
			return true
		}
	}
	return false
}

// NarrowDim copies entries start … start+length−1 along the middle dim of
// x, an [outer, n, inner] row-major array, into out, [outer, length,
// inner]. It needs 0 ≤ start and start+length ≤ n.
func NarrowDim[T Float](out, x []T, outer, n, inner, start, length int) error {
	const op = "NarrowDim"
	if err := sliceDim(op, len(out), len(x), outer, n, inner, start, length); err != nil {
		return err
	}
	for o := range outer {
		copy(out[o*length*inner:(o+1)*length*inner], x[(o*n+start)*inner:(o*n+start+length)*inner])
	}
	return nil
}

// PadDim is NarrowDim's adjoint: it writes g, an [outer, n, inner] array,
// at entries start … start+n−1 along the middle dim of out, [outer, full,
// inner], and zeros everywhere else. It needs 0 ≤ start and start+n ≤
// full.
func PadDim[T Float](out, g []T, outer, n, inner, start, full int) error {
	const op = "PadDim"
	if err := sliceDim(op, len(g), len(out), outer, full, inner, start, n); err != nil {
		return err
	}
	for o := range outer {
		row := out[o*full*inner : (o+1)*full*inner]
		clear(row[:start*inner])
		clear(row[(start+n)*inner:])
		copy(row[start*inner:(start+n)*inner], g[o*n*inner:(o+1)*n*inner])
	}
	return nil
}

// sliceDim checks a window [start, start+length) of the middle dim of an
// [outer, n, inner] array of lbig elements, and a window array of lsmall.
func sliceDim(op string, lsmall, lbig, outer, n, inner, start, length int) error {
	big, err := size(op, outer, n, inner)
	if err != nil {
		return err
	}
	small, err := size(op, outer, length, inner)
	if err != nil {
		return err
	}
	if start < 0 || start > n-length {
		return fmt.Errorf("kernels: %s: %w: window [%d, %d) does not fit a dim of %d", op, ErrInvalid, start, start+length, n)
	}
	if lbig != big || lsmall != small {
		return fmt.Errorf("kernels: %s: %w: %d and %d elements for [%d, %d, %d] and its window of %d", op, ErrInvalid, lbig, lsmall, outer, n, inner, length)
	}
	return nil
}

// ConcatDim joins the arrays xs along their middle dim into out: xs[i] is
// [outer, sizes[i], inner] (row-major) and out is [outer, Σ sizes,
// inner]. out must not overlap any xs[i].
func ConcatDim[T Float](out []T, xs [][]T, sizes []int, outer, inner int) error {
	const op = "ConcatDim"
	if len(xs) != len(sizes) {
		return fmt.Errorf("kernels: %s: %w: %d arrays and %d sizes", op, ErrInvalid, len(xs), len(sizes))
	}
	total := 0
	for i, s := range sizes {
		l, err := size(op, outer, s, inner)
		if err != nil {
			return err
		}
		if len(xs[i]) != l {
			return fmt.Errorf("kernels: %s: %w: array %d has %d elements for [%d, %d, %d]", op, ErrInvalid, i, len(xs[i]), outer, s, inner)
		}
		var ok bool
		if total, ok = checked.Add(total, s); !ok {
			return fmt.Errorf("kernels: %s: %w: sizes %v overflow int", op, ErrInvalid, sizes)
		}
	}
	l, err := size(op, outer, total, inner)
	if err != nil {
		return err
	}
	if len(out) != l {
		return fmt.Errorf("kernels: %s: %w: out has %d elements, want %d", op, ErrInvalid, len(out), l)
	}
	off := 0
	for i, x := range xs {
		n := sizes[i]
		for o := range outer {
			copy(out[(o*total+off)*inner:(o*total+off+n)*inner], x[o*n*inner:(o+1)*n*inner])
		}
		off += n
	}
	return nil
}

// EmbeddingForward gathers table rows: table holds rows lo … lo+V−1 of a
// vocabulary (V = len(table)/d, rows of d values), and out[i] (row i, d
// values) is the row of ids[i] when it lies in that range and zeros
// otherwise, a vocab-parallel rank's share of the lookup. len(out) must
// be len(ids)·d.
func EmbeddingForward[T Float](out, table []T, ids []int64, lo, d int) error {
	const op = "EmbeddingForward"
	vl, err := rowCount(op, len(table), d)
	if err != nil {
		return err
	}
	if n, ok := checked.Mul(len(ids), d); !ok || len(out) != n {
		return fmt.Errorf("kernels: %s: %w: out has %d elements for %d ids of %d", op, ErrInvalid, len(out), len(ids), d)
	}
	for i, id := range ids {
		if r := id - int64(lo); r >= 0 && r < int64(vl) {
			copy(out[i*d:(i+1)*d], table[int(r)*d:(int(r)+1)*d])
		} else {
			clear(out[i*d : (i+1)*d])
		}
	}
	return nil
}

// EmbeddingBackward is EmbeddingForward's adjoint for the table: it sets
// dtable (rows lo … lo+V−1, V = len(dtable)/d) to the sum of the rows of
// g (len(ids)·d values) whose ids lie in that range, zero for rows no id
// selects. The sums run in float64, in the order of ids, and are rounded
// once to T: acc is their scratch, len(dtable) float64s, overwritten; it
// may be nil when T is float64, which accumulates in dtable directly.
func EmbeddingBackward[T Float](dtable []T, acc []float64, g []T, ids []int64, lo, d int) error {
	const op = "EmbeddingBackward"
	vl, err := rowCount(op, len(dtable), d)
	if err != nil {
		return err
	}
	if n, ok := checked.Mul(len(ids), d); !ok || len(g) != n {
		return fmt.Errorf("kernels: %s: %w: g has %d elements for %d ids of %d", op, ErrInvalid, len(g), len(ids), d)
	}
	if a, ok := any(dtable).([]float64); ok && acc == nil {
		embedAdd(a, g, ids, lo, vl, d)
		return nil
	}
	if len(acc) != len(dtable) {
		return fmt.Errorf("kernels: %s: %w: acc has %d elements, want %d", op, ErrInvalid, len(acc), len(dtable))
	}
	embedAdd(acc, g, ids, lo, vl, d)
	for i, v := range acc {
		dtable[i] = T(v)
	}
	return nil
}

// embedAdd clears acc and adds the rows of g into it by id.
func embedAdd[T Float](acc []float64, g []T, ids []int64, lo, vl, d int) {
	clear(acc)
	for i, id := range ids {
		r := id - int64(lo)
		if r < 0 || r >= int64(vl) {
			continue
		}
		row := acc[int(r)*d : (int(r)+1)*d]
		for k, v := range g[i*d : (i+1)*d] {
			row[k] += float64(v)
		}
	}
}
