package cuda

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// TestFoldPermutation: the folded shape and permutation that PermuteDims
// launches rearrange the elements as the original ones do (the CPU's
// kernels.PermuteDims on both), for random shapes of up to 8 dims with
// many size-1 dims and in-order runs; the fold never has more dims.
func TestFoldPermutation(t *testing.T) {
	r := rand.New(rand.NewPCG(41, 42))
	for range 2000 {
		nd := r.IntN(9)
		shape := make([]int, nd)
		for i := range shape {
			shape[i] = 1 + r.IntN(3)
		}
		perm := r.Perm(nd)
		if r.IntN(2) == 0 { // keep some runs in order
			slices.Sort(perm[:nd/2])
		}
		n := 1
		for _, d := range shape {
			n *= d
		}
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(i)
		}
		want, got := make([]float32, n), make([]float32, n)
		if err := kernels.PermuteDims(want, x, shape, perm); err != nil {
			t.Fatal(err)
		}
		s, p := foldPermutation(shape, perm)
		what := fmt.Sprintf("shape %v perm %v folded to %v %v", shape, perm, s, p)
		if len(s) > len(shape) || len(p) != len(s) {
			t.Fatalf("%s: more dims, or a perm of another length", what)
		}
		if err := kernels.PermuteDims(got, x, s, p); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("%s: %v, want %v", what, got, want)
		}
	}
}

// TestFoldBlock: the folded block that DropoutMask launches names the
// same global indices, in the same order, as the block itself, for random
// blocks of up to 8 dims with many size-1 and whole dims; the fold never
// has more dims.
func TestFoldBlock(t *testing.T) {
	r := rand.New(rand.NewPCG(43, 44))
	// indices lists the global index of each element of a block, row-major,
	// given its first element's and its dims' sizes and strides.
	indices := func(base int, size, stride []int) []int {
		out := []int{base}
		for d := range size {
			var next []int
			for _, e := range out {
				for j := range size[d] {
					next = append(next, e+j*stride[d])
				}
			}
			out = next
		}
		return out
	}
	for range 2000 {
		nd := r.IntN(9)
		global, offset, box := make([]int, nd), make([]int, nd), make([]int, nd)
		for d := range global {
			global[d] = 1 + r.IntN(4)
			switch r.IntN(3) {
			case 0:
				box[d] = global[d] // whole
			case 1:
				box[d] = 1
			default:
				box[d] = 1 + r.IntN(global[d])
			}
			offset[d] = r.IntN(global[d] - box[d] + 1)
		}
		st := make([]int, nd)
		s, base := 1, 0
		for d := nd - 1; d >= 0; d-- {
			st[d] = s
			base += offset[d] * s
			s *= global[d]
		}
		want := indices(base, box, st)
		fb, b, g := foldBlock(offset, box, global)
		what := fmt.Sprintf("block %v at %v of %v folded to %d, %v, %v", box, offset, global, fb, b, g)
		if len(b) > nd || len(g) != len(b) {
			t.Fatalf("%s: more dims, or strides of another length", what)
		}
		if got := indices(fb, b, g); !slices.Equal(got, want) {
			t.Fatalf("%s: indices %v, want %v", what, got, want)
		}
	}
}
