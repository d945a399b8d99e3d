package kernels

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// The elementwise and layout kernels move or combine values without
// rounding differently from a plain loop, so each is checked for exact
// equality against a straightforward reference (index arithmetic through
// unravel, one element at a time), on odd sizes: 0, 1, 3 and 17 rows,
// widths 1, 7 and 33, and both element types.

var (
	tensorRows   = []int{0, 1, 3, 17}
	tensorWidths = []int{1, 7, 33}
)

func randT[T Float](rng *rand.Rand, n int) []T {
	x := make([]T, n)
	for i := range x {
		x[i] = T(rng.Float64()*4 - 2)
	}
	return x
}

// sentinel returns n elements of a value no kernel writes here, to see
// what a kernel left untouched.
func sentinel[T Float](n int) []T {
	x := make([]T, n)
	Fill(x, -7777)
	return x
}

func TestElementwise(t *testing.T) {
	t.Run("float32", testElementwise[float32])
	t.Run("float64", testElementwise[float64])
}

func testElementwise[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, r := range tensorRows {
		for _, w := range tensorWidths {
			n := r * w
			a, b := randT[T](rng, n), randT[T](rng, n)
			c := T(rng.Float64() - 0.5)
			sum, prod, scaled := make([]T, n), make([]T, n), make([]T, n)
			for i := range a {
				sum[i], prod[i], scaled[i] = a[i]+b[i], a[i]*b[i], c*a[i]
			}
			for _, k := range []struct {
				name string
				run  func(dst []T) error
				want []T
			}{
				{"Add", func(dst []T) error { return Add(dst, a, b) }, sum},
				{"Mul", func(dst []T) error { return Mul(dst, a, b) }, prod},
				{"Scale", func(dst []T) error { return Scale(dst, a, c) }, scaled},
			} {
				got := sentinel[T](n)
				if err := k.run(got); err != nil {
					t.Fatalf("%s n=%d: %v", k.name, n, err)
				}
				if !slices.Equal(got, k.want) {
					t.Fatalf("%s n=%d: %v, want %v", k.name, n, got, k.want)
				}
			}
			// In place (dst aliasing the first input).
			in := slices.Clone(a)
			if err := Add(in, in, b); err != nil || !slices.Equal(in, sum) {
				t.Fatalf("in-place Add n=%d differs (%v)", n, err)
			}
			in = slices.Clone(a)
			if err := Scale(in, in, c); err != nil || !slices.Equal(in, scaled) {
				t.Fatalf("in-place Scale n=%d differs (%v)", n, err)
			}
		}
	}
}

func TestFillRowsAndColumnSums(t *testing.T) {
	t.Run("float32", testFillRowsAndColumnSums[float32])
	t.Run("float64", testFillRowsAndColumnSums[float64])
}

func testFillRowsAndColumnSums[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, r := range tensorRows {
		for _, w := range tensorWidths {
			row := randT[T](rng, w)
			got := sentinel[T](r * w)
			if err := FillRows(got, row); err != nil {
				t.Fatal(err)
			}
			for i, v := range got {
				if v != row[i%w] {
					t.Fatalf("FillRows %d×%d: [%d] = %v, want %v", r, w, i, v, row[i%w])
				}
			}
			x := randT[T](rng, r*w)
			sums := sentinel[T](w)
			if err := ColumnSums(sums, x, w); err != nil {
				t.Fatal(err)
			}
			for j := range w {
				acc := 0.0
				for i := range r {
					acc += float64(x[i*w+j])
				}
				if sums[j] != T(acc) {
					t.Fatalf("ColumnSums %d×%d: [%d] = %v, want %v", r, w, j, sums[j], T(acc))
				}
			}
		}
	}
}

// unravel returns the row-major multi-index of element i of shape.
func unravel(i int, shape []int) []int {
	idx := make([]int, len(shape))
	for d := len(shape) - 1; d >= 0; d-- {
		if shape[d] > 0 {
			idx[d] = i % shape[d]
			i /= shape[d]
		}
	}
	return idx
}

// ravel is unravel's inverse.
func ravel(idx, shape []int) int {
	j := 0
	for d, s := range shape {
		j = j*s + idx[d]
	}
	return j
}

func numel(shape []int) int {
	n := 1
	for _, s := range shape {
		n *= s
	}
	return n
}

// tensorShapes are the shapes of the sum, broadcast and permute tests.
var tensorShapes = [][]int{{}, {0}, {1}, {17}, {3, 7}, {17, 1}, {0, 33}, {3, 1, 33}, {1, 7, 3}, {2, 3, 0}, {3, 2, 7, 2}}

func TestSumBroadcastDims(t *testing.T) {
	t.Run("float32", testSumBroadcastDims[float32])
	t.Run("float64", testSumBroadcastDims[float64])
}

func testSumBroadcastDims[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, shape := range tensorShapes {
		for mask := range 1 << len(shape) {
			reduce := make([]bool, len(shape))
			var kept []int
			for d := range shape {
				reduce[d] = mask&(1<<d) != 0
				if !reduce[d] {
					kept = append(kept, shape[d])
				}
			}
			name := fmt.Sprintf("shape %v reduce %v", shape, reduce)
			n := numel(shape)
			// The reference: every input element added to its output in
			// row-major order, as SumDims promises.
			x := randT[T](rng, n)
			want := make([]T, numel(kept))
			outIdx := func(i int) int {
				idx := unravel(i, shape)
				var k []int
				for d := range shape {
					if !reduce[d] {
						k = append(k, idx[d])
					}
				}
				return ravel(k, kept)
			}
			for i, v := range x {
				want[outIdx(i)] += v
			}
			got := sentinel[T](len(want))
			if err := SumDims(got, x, shape, reduce); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("SumDims %s: %v, want %v", name, got, want)
			}
			g := randT[T](rng, len(want))
			bc := sentinel[T](n)
			if err := BroadcastDims(bc, g, shape, reduce); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			for i, v := range bc {
				if v != g[outIdx(i)] {
					t.Fatalf("BroadcastDims %s: [%d] = %v, want %v", name, i, v, g[outIdx(i)])
				}
			}
		}
	}
}

// perms returns every permutation of 0..n−1.
func perms(n int) [][]int {
	if n == 0 {
		return [][]int{{}}
	}
	var out [][]int
	for _, p := range perms(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := slices.Insert(slices.Clone(p), i, n-1)
			out = append(out, q)
		}
	}
	return out
}

func TestPermuteDims(t *testing.T) {
	t.Run("float32", testPermuteDims[float32])
	t.Run("float64", testPermuteDims[float64])
}

func testPermuteDims[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for _, shape := range tensorShapes {
		x := randT[T](rng, numel(shape))
		for _, perm := range perms(len(shape)) {
			oshape := make([]int, len(perm))
			for i, p := range perm {
				oshape[i] = shape[p]
			}
			got := sentinel[T](len(x))
			if err := PermuteDims(got, x, shape, perm); err != nil {
				t.Fatalf("shape %v perm %v: %v", shape, perm, err)
			}
			for o := range got {
				oi := unravel(o, oshape)
				ii := make([]int, len(shape))
				for i, p := range perm {
					ii[p] = oi[i]
				}
				if want := x[ravel(ii, shape)]; got[o] != want {
					t.Fatalf("shape %v perm %v: [%d] = %v, want %v", shape, perm, o, got[o], want)
				}
			}
		}
	}
}

func TestNarrowPadConcat(t *testing.T) {
	t.Run("float32", testNarrowPadConcat[float32])
	t.Run("float64", testNarrowPadConcat[float64])
}

func testNarrowPadConcat[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	for _, outer := range tensorRows {
		for _, inner := range tensorWidths {
			for _, n := range []int{1, 3, 7} {
				x := randT[T](rng, outer*n*inner)
				at := func(o, k, i int) T { return x[(o*n+k)*inner+i] }
				for start := range n {
					for length := 0; start+length <= n; length++ {
						name := fmt.Sprintf("[%d,%d,%d] window [%d,%d)", outer, n, inner, start, start+length)
						nar := sentinel[T](outer * length * inner)
						if err := NarrowDim(nar, x, outer, n, inner, start, length); err != nil {
							t.Fatalf("%s: %v", name, err)
						}
						for e, v := range nar {
							idx := unravel(e, []int{outer, length, inner})
							if want := at(idx[0], start+idx[1], idx[2]); v != want {
								t.Fatalf("NarrowDim %s: [%d] = %v, want %v", name, e, v, want)
							}
						}
						pad := sentinel[T](outer * n * inner)
						if err := PadDim(pad, nar, outer, length, inner, start, n); err != nil {
							t.Fatalf("%s: %v", name, err)
						}
						for e, v := range pad {
							idx := unravel(e, []int{outer, n, inner})
							want := T(0)
							if idx[1] >= start && idx[1] < start+length {
								want = at(idx[0], idx[1], idx[2])
							}
							if v != want {
								t.Fatalf("PadDim %s: [%d] = %v, want %v", name, e, v, want)
							}
						}
					}
				}
				// Concat of three pieces (one empty) along the middle dim.
				sizes := []int{n, 0, 2}
				xs := [][]T{x, nil, randT[T](rng, outer*2*inner)}
				total := n + 2
				got := sentinel[T](outer * total * inner)
				if err := ConcatDim(got, xs, sizes, outer, inner); err != nil {
					t.Fatal(err)
				}
				for e, v := range got {
					idx := unravel(e, []int{outer, total, inner})
					var want T
					if idx[1] < n {
						want = at(idx[0], idx[1], idx[2])
					} else {
						want = xs[2][(idx[0]*2+idx[1]-n)*inner+idx[2]]
					}
					if v != want {
						t.Fatalf("ConcatDim [%d,%v,%d]: [%d] = %v, want %v", outer, sizes, inner, e, v, want)
					}
				}
			}
		}
	}
}

func TestEmbedding(t *testing.T) {
	t.Run("float32", testEmbedding[float32])
	t.Run("float64", testEmbedding[float64])
}

func testEmbedding[T Float](t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	for _, nids := range tensorRows {
		for _, d := range tensorWidths {
			// A vocab of 11 rows; this block holds rows [lo, lo+vl).
			for _, blk := range [][2]int{{0, 11}, {4, 5}, {10, 1}, {3, 0}} {
				lo, vl := blk[0], blk[1]
				ids := make([]int64, nids)
				for i := range ids {
					ids[i] = rng.Int64N(11)
				}
				if nids > 2 {
					ids[1] = ids[0] // a repeated id: its rows add up
				}
				table := randT[T](rng, vl*d)
				name := fmt.Sprintf("%d ids, d %d, rows [%d, %d)", nids, d, lo, lo+vl)
				out := sentinel[T](nids * d)
				if err := EmbeddingForward(out, table, ids, lo, d); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				for i, id := range ids {
					for k := range d {
						want := T(0)
						if r := int(id) - lo; r >= 0 && r < vl {
							want = table[r*d+k]
						}
						if out[i*d+k] != want {
							t.Fatalf("EmbeddingForward %s: id %d [%d] = %v, want %v", name, id, k, out[i*d+k], want)
						}
					}
				}
				g := randT[T](rng, nids*d)
				want := make([]T, vl*d)
				for r := range vl {
					for k := range d {
						acc := 0.0
						for i, id := range ids {
							if int(id) == lo+r {
								acc += float64(g[i*d+k])
							}
						}
						want[r*d+k] = T(acc)
					}
				}
				got := sentinel[T](vl * d)
				acc := make([]float64, vl*d)
				Fill(acc, 99) // scratch: overwritten, whatever it held
				if err := EmbeddingBackward(got, acc, g, ids, lo, d); err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				if !slices.Equal(got, want) {
					t.Fatalf("EmbeddingBackward %s: %v, want %v", name, got, want)
				}
				if _, ok := any(got).([]float64); ok {
					got = sentinel[T](vl * d)
					if err := EmbeddingBackward(got, nil, g, ids, lo, d); err != nil || !slices.Equal(got, want) {
						t.Fatalf("EmbeddingBackward %s without scratch: %v (%v), want %v", name, got, err, want)
					}
				}
			}
		}
	}
}

// TestTensorKernelsInvalid: bad sizes are ErrInvalid and leave the output
// untouched.
func TestTensorKernelsInvalid(t *testing.T) {
	out := sentinel[float32](6)
	x := make([]float32, 6)
	for _, c := range []struct {
		name string
		err  error
	}{
		{"Add lengths", Add(out, x, x[:5])},
		{"Mul lengths", Mul(out[:5], x, x)},
		{"Scale lengths", Scale(out, x[:5], 2)},
		{"FillRows ragged", FillRows(out, x[:4])},
		{"FillRows empty row", FillRows(out, nil)},
		{"ColumnSums out", ColumnSums(out[:2], x, 3)},
		{"SumDims flags", SumDims(out[:1], x, []int{2, 3}, []bool{true})},
		{"SumDims x", SumDims(out[:2], x[:5], []int{2, 3}, []bool{false, true})},
		{"SumDims out", SumDims(out[:3], x, []int{2, 3}, []bool{false, true})},
		{"SumDims negative", SumDims(out[:1], x[:0], []int{-1, 0}, []bool{true, true})},
		{"BroadcastDims g", BroadcastDims(out, x[:3], []int{2, 3}, []bool{false, true})},
		{"PermuteDims perm", PermuteDims(out, x, []int{2, 3}, []int{1, 1})},
		{"PermuteDims range", PermuteDims(out, x, []int{2, 3}, []int{0, 2})},
		{"PermuteDims rank", PermuteDims(out, x, []int{2, 3}, []int{0})},
		{"PermuteDims length", PermuteDims(out[:5], x, []int{2, 3}, []int{1, 0})},
		{"PermuteDims overflow", PermuteDims(out, x, []int{1 << 40, 1 << 40}, []int{1, 0})},
		{"NarrowDim window", NarrowDim(out[:2], x, 2, 3, 1, 2, 2)},
		{"NarrowDim negative start", NarrowDim(out[:2], x, 2, 3, 1, -1, 1)},
		{"NarrowDim out", NarrowDim(out[:3], x, 2, 3, 1, 0, 1)},
		{"PadDim window", PadDim(out, x[:4], 2, 2, 1, 2, 3)},
		{"PadDim g", PadDim(out, x[:3], 2, 2, 1, 0, 3)},
		{"ConcatDim sizes", ConcatDim(out, [][]float32{x[:3], x[:3]}, []int{3}, 1, 1)},
		{"ConcatDim piece", ConcatDim(out, [][]float32{x[:3], x[:2]}, []int{3, 3}, 1, 1)},
		{"ConcatDim out", ConcatDim(out[:5], [][]float32{x[:3], x[:3]}, []int{3, 3}, 1, 1)},
		{"EmbeddingForward table", EmbeddingForward(out, x[:5], []int64{0, 1, 2}, 0, 2)},
		{"EmbeddingForward out", EmbeddingForward(out[:5], x, []int64{0, 1, 2}, 0, 2)},
		{"EmbeddingBackward g", EmbeddingBackward(out, make([]float64, 6), x[:5], []int64{0, 1, 2}, 0, 2)},
		{"EmbeddingBackward acc", EmbeddingBackward(out, nil, x, []int64{0, 1, 2}, 0, 2)},
	} {
		if !errors.Is(c.err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.name, c.err)
		}
		if !slices.Equal(out, sentinel[float32](6)) {
			t.Fatalf("%s: wrote %v before failing", c.name, out)
		}
	}
}
