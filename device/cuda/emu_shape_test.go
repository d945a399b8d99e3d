//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// boxArgs returns loom_copy_box_f32's arguments after the two pointers: nd,
// six sizes, six destination strides, six source strides.
func boxArgs(size, ds, ss []int) []any {
	args := []any{int32(len(size))}
	for _, v := range [][]int{size, ds, ss} {
		for d := range 6 {
			x := int64(1)
			if d < len(v) {
				x = int64(v[d])
			}
			args = append(args, x)
		}
	}
	return args
}

// rowMajor returns the row-major strides of shape.
func rowMajor(shape []int) []int {
	st := make([]int, len(shape))
	s := 1
	for d := len(shape) - 1; d >= 0; d-- {
		st[d] = s
		s *= shape[d]
	}
	return st
}

// shapeArgs returns nd and six sizes (unused: 1) for the shape kernels.
func shapeArgs(shape []int) []any {
	args := []any{int32(len(shape))}
	for d := range 6 {
		x := int64(1)
		if d < len(shape) {
			x = int64(shape[d])
		}
		args = append(args, x)
	}
	return args
}

// prod is the number of elements of shape.
func prod(shape []int) int {
	n := 1
	for _, v := range shape {
		n *= v
	}
	return n
}

// The layout kernels copy, so they are bit-exact against package kernels'
// NarrowDim, PadDim, ConcatDim, PermuteDims, BroadcastDims and FillRows and
// against an n-d box copy written here (placement's copyBox is
// unexported); elements outside a box keep their NaN. SumDims on the
// device accumulates in double in another order: it is checked against
// kernels.SumDims in float64 within 1e-6 of the sum of the magnitudes (one
// float32 rounding of a double sum).
func testShape(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(19, 20))
	launch := func(what, kernel string, g geometry, args ...any) {
		t.Helper()
		if err := e.run(kernel, d1(g.grid), d1(g.block), 0, args...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	// An n-d box of a source array copied into a destination array at
	// other offsets, 0 to 6 dims, with empty boxes.
	for _, c := range []struct{ sshape, soff, dshape, doff, size []int }{
		{nil, nil, nil, nil, nil},
		{[]int{7}, []int{2}, []int{5}, []int{1}, []int{4}},
		{[]int{3, 5}, []int{1, 0}, []int{4, 7}, []int{2, 3}, []int{2, 4}},
		{[]int{3, 5}, []int{0, 0}, []int{4, 7}, []int{2, 3}, []int{0, 4}},
		{[]int{4, 3, 33}, []int{1, 1, 0}, []int{5, 2, 40}, []int{0, 0, 7}, []int{3, 2, 33}},
		{[]int{2, 3, 2, 5, 3, 7}, []int{1, 0, 1, 2, 0, 3}, []int{3, 3, 2, 4, 5, 9}, []int{0, 1, 0, 1, 2, 1}, []int{1, 2, 1, 3, 3, 4}},
	} {
		src := randF32(r, prod(c.sshape), 1)
		want := garbage(prod(c.dshape))
		ss, ds := rowMajor(c.sshape), rowMajor(c.dshape)
		for i := range prod(c.size) {
			si, di, k := 0, 0, i
			for d := len(c.size) - 1; d >= 0; d-- {
				x := k % c.size[d]
				k /= c.size[d]
				si += (c.soff[d] + x) * ss[d]
				di += (c.doff[d] + x) * ds[d]
			}
			want[di] = src[si]
		}
		so, do := 0, 0
		for d := range c.size {
			so += c.soff[d] * ss[d]
			do += c.doff[d] * ds[d]
		}
		for _, g := range geometries {
			what := fmt.Sprintf("copy_box %+v, grid %d×%d", c, g.grid, g.block)
			got := garbage(len(want))
			launch(what, "loom_copy_box_f32", g, append([]any{got[do:], src[so:]}, boxArgs(c.size, ds, ss)...)...)
			checkExact(t, what, got, want)
		}
	}

	// NarrowDim, PadDim (fill, then the box) and ConcatDim as boxes of an
	// [outer, n, inner] view.
	for _, s := range []struct{ outer, n, inner, start, length int }{
		{1, 1, 1, 0, 1}, {3, 7, 5, 2, 4}, {2, 33, 1, 32, 1}, {4, 5, 17, 0, 0}, {1, 9, 128, 3, 6},
	} {
		x := randF32(r, s.outer*s.n*s.inner, 1)
		want := make([]float32, s.outer*s.length*s.inner)
		if err := kernels.NarrowDim(want, x, s.outer, s.n, s.inner, s.start, s.length); err != nil {
			t.Fatal(err)
		}
		wantPad := make([]float32, len(x))
		if err := kernels.PadDim(wantPad, want, s.outer, s.length, s.inner, s.start, s.n); err != nil {
			t.Fatal(err)
		}
		size := []int{s.outer, s.length, s.inner}
		big, small := rowMajor([]int{s.outer, s.n, s.inner}), rowMajor(size)
		for _, g := range geometries {
			what := fmt.Sprintf("%+v, grid %d×%d", s, g.grid, g.block)
			got := garbage(len(want))
			launch(what, "loom_copy_box_f32", g, append([]any{got, x[s.start*s.inner:]}, boxArgs(size, small, big)...)...)
			checkExact(t, what+": narrow vs kernels.NarrowDim", got, want)
			pad := garbage(len(x))
			launch(what, "loom_fill_f32", g, pad, float32(0), int64(len(pad)))
			launch(what, "loom_copy_box_f32", g, append([]any{pad[s.start*s.inner:], want}, boxArgs(size, big, small)...)...)
			checkExact(t, what+": pad vs kernels.PadDim", pad, wantPad)
		}
	}
	for _, s := range []struct {
		outer, inner int
		sizes        []int
	}{{1, 1, []int{1}}, {3, 5, []int{2, 0, 7, 1}}, {2, 33, []int{4, 4}}} {
		xs := make([][]float32, len(s.sizes))
		total := 0
		for i, n := range s.sizes {
			xs[i] = randF32(r, s.outer*n*s.inner, 1)
			total += n
		}
		want := make([]float32, s.outer*total*s.inner)
		if err := kernels.ConcatDim(want, xs, s.sizes, s.outer, s.inner); err != nil {
			t.Fatal(err)
		}
		for _, g := range geometries {
			what := fmt.Sprintf("concat %+v, grid %d×%d", s, g.grid, g.block)
			got, off := garbage(len(want)), 0
			for i, n := range s.sizes {
				size := []int{s.outer, n, s.inner}
				if len(xs[i]) > 0 {
					launch(what, "loom_copy_box_f32", g, append([]any{got[off*s.inner:], xs[i]},
						boxArgs(size, rowMajor([]int{s.outer, total, s.inner}), rowMajor(size))...)...)
				}
				off += n
			}
			checkExact(t, what+": vs kernels.ConcatDim", got, want)
		}
	}

	// PermuteDims, BroadcastDims (a box whose source strides are 0 on the
	// broadcast dims) and SumDims over 1 to 6 dims.
	for _, c := range []struct {
		shape, perm []int
		reduce      []bool
	}{
		{[]int{7}, []int{0}, []bool{true}},
		{[]int{3, 5}, []int{1, 0}, []bool{false, true}},
		{[]int{4, 3, 33}, []int{2, 0, 1}, []bool{true, false, true}},
		{[]int{2, 65, 3}, []int{0, 2, 1}, []bool{false, true, false}},
		{[]int{2, 0, 3}, []int{1, 2, 0}, []bool{true, false, false}},
		{[]int{2, 3, 2, 5, 3, 4}, []int{5, 3, 1, 0, 4, 2}, []bool{true, false, true, true, false, false}},
		{[]int{2, 3, 2, 5, 3, 4}, []int{0, 1, 2, 3, 5, 4}, []bool{true, true, true, true, true, true}},
	} {
		n := prod(c.shape)
		x := randF32(r, n, 2)
		want := make([]float32, n)
		if err := kernels.PermuteDims(want, x, c.shape, c.perm); err != nil {
			t.Fatal(err)
		}
		kshape, gst, mask := []int{}, []int{}, int32(0)
		st := rowMajor(c.shape)
		for d, red := range c.reduce {
			if red {
				mask |= 1 << d
			} else {
				kshape = append(kshape, c.shape[d])
			}
		}
		kst := rowMajor(kshape)
		for _, red := range c.reduce {
			if red {
				gst = append(gst, 0)
			} else {
				gst, kst = append(gst, kst[0]), kst[1:]
			}
		}
		kept := prod(kshape)
		gsum := randF32(r, kept, 1)
		wantB := make([]float32, n)
		if err := kernels.BroadcastDims(wantB, gsum, c.shape, c.reduce); err != nil {
			t.Fatal(err)
		}
		x64, sum64 := make([]float64, n), make([]float64, kept)
		abs64, mag64 := make([]float64, n), make([]float64, kept)
		for i, v := range x {
			x64[i], abs64[i] = float64(v), math.Abs(float64(v))
		}
		if err := kernels.SumDims(sum64, x64, c.shape, c.reduce); err != nil {
			t.Fatal(err)
		}
		if err := kernels.SumDims(mag64, abs64, c.shape, c.reduce); err != nil {
			t.Fatal(err)
		}
		wantS, mag := make([]float32, kept), make([]float32, kept)
		for i := range sum64 {
			wantS[i], mag[i] = float32(sum64[i]), float32(mag64[i])
		}
		perm := []any{}
		for d := range 6 {
			p := int32(d)
			if d < len(c.perm) {
				p = int32(c.perm[d])
			}
			perm = append(perm, p)
		}
		for _, g := range geometries {
			what := fmt.Sprintf("shape %v, grid %d×%d", c.shape, g.grid, g.block)
			got := garbage(n)
			launch(what, "loom_permute_nd_f32", g, append(append([]any{got, x}, shapeArgs(c.shape)...), perm...)...)
			checkExact(t, what+": permute "+fmt.Sprint(c.perm)+" vs kernels.PermuteDims", got, want)
			got = garbage(n)
			launch(what, "loom_copy_box_f32", g, append([]any{got, gsum}, boxArgs(c.shape, st, gst)...)...)
			checkExact(t, what+": broadcast "+fmt.Sprint(c.reduce)+" vs kernels.BroadcastDims", got, wantB)
			got = garbage(kept)
			launch(what, "loom_sum_dims_f32", g, append(append([]any{got, x}, shapeArgs(c.shape)...), mask)...)
			checkSum(t, what+": sum "+fmt.Sprint(c.reduce)+" vs kernels.SumDims", got, wantS, mag)
		}
	}

	// FillRows.
	for _, s := range []struct{ rows, n int }{{0, 3}, {1, 1}, {3, 7}, {4, 8}, {17, 33}, {2, 128}, {5, 257}} {
		row := randF32(r, s.n, 1)
		want := make([]float32, s.rows*s.n)
		if err := kernels.FillRows(want, row); err != nil {
			t.Fatal(err)
		}
		for _, g := range geometries {
			what := fmt.Sprintf("fill_rows %+v, grid %d×%d", s, g.grid, g.block)
			got := garbage(len(want))
			launch(what, "loom_fill_rows_f32", g, got, row, int64(s.rows), int64(s.n))
			checkExact(t, what+" vs kernels.FillRows", got, want)
		}
	}
}
