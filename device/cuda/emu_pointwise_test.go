//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// Activation selectors of loom_act_f32 and loom_act_bwd_f32 (pointwise.cu).
const (
	actReLU int32 = iota
	actSiLU
	actTanh
	actSigmoid
)

// Pointwise kernels. ReLU and its backward select values: bit-exact. SiLU,
// Tanh and Sigmoid compute in double on both sides and round once to
// float32; the host's exp and tanh (here glibc's, on a GPU CUDA's) and Go's
// may differ in the last bit of the double, which moves the float32
// rounding only at a near-tie: one float32 ulp, 2⁻²³ relative. The dropout
// mask hashes integers and compares one double: bit-exact, for blocks of
// every rank of a sharded tensor and seeds above 2⁶³. Argmax selects:
// exact indices, with ties, NaNs and rows of −∞.
func testPointwise(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(21, 22))
	const ulp = 0x1p-23
	type ref func(dst, x, y []float32) error
	for _, n := range []int{0, 1, 7, 33, 1000, 4099} {
		x, dy := randF32(r, n, 6), randF32(r, n, 1)
		specials := []float32{0, float32(math.Copysign(0, -1)), float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1)), 100, -100, 1e-30, -1e-30, 20, -20}
		copy(x, specials)
		for _, c := range []struct {
			name    string
			act     int32
			fwd     func(dst, x []float32) error
			bwd     ref  // dx, xy, dy
			fromOut bool // the backward takes the forward's result
			rtol    float64
		}{
			{"relu", actReLU, kernels.ReLU[float32], func(dx, xy, g []float32) error { return kernels.ReLUBackward(dx, xy, g) }, false, 0},
			{"silu", actSiLU, kernels.SiLU[float32], func(dx, xy, g []float32) error { return kernels.SiLUBackward(dx, xy, g) }, false, ulp},
			{"tanh", actTanh, kernels.Tanh[float32], func(dx, xy, g []float32) error { return kernels.TanhBackward(dx, xy, g) }, true, ulp},
			{"sigmoid", actSigmoid, kernels.Sigmoid[float32], func(dx, xy, g []float32) error { return kernels.SigmoidBackward(dx, xy, g) }, true, ulp},
		} {
			want, wantDx := make([]float32, n), make([]float32, n)
			if err := c.fwd(want, x); err != nil {
				t.Fatal(err)
			}
			xy := x
			if c.fromOut {
				xy = want
			}
			if err := c.bwd(wantDx, xy, dy); err != nil {
				t.Fatal(err)
			}
			for _, g := range geometries {
				what := fmt.Sprintf("%s n %d, grid %d×%d", c.name, n, g.grid, g.block)
				y := slices.Clone(x) // in place
				if err := e.run("loom_act_f32", d1(g.grid), d1(g.block), 0, y, y, int64(n), c.act); err != nil {
					t.Fatal(err)
				}
				dx := garbage(n)
				if err := e.run("loom_act_bwd_f32", d1(g.grid), d1(g.block), 0, dx, xy, dy, int64(n), c.act); err != nil {
					t.Fatal(err)
				}
				if c.rtol == 0 {
					checkExact(t, what+": forward", y, want)
					checkExact(t, what+": backward", dx, wantDx)
				} else {
					checkClose(t, what+": forward", y, want, c.rtol, 0)
					checkClose(t, what+": backward", dx, wantDx, c.rtol, 0)
				}
			}
		}
	}

	for _, c := range []struct {
		global, offset, box []int
		p                   float64
		seed, step          uint64
	}{
		{nil, nil, nil, 0.5, 1, 0},
		{[]int{1000}, []int{0}, []int{1000}, 0.1, 7, 3},
		{[]int{1000}, []int{333}, []int{334}, 0.5, 7, 3},
		{[]int{17, 33}, []int{4, 0}, []int{5, 33}, 0.9, 1<<63 + 12345, 1<<40 + 1},
		{[]int{6, 7, 65}, []int{2, 3, 32}, []int{3, 4, 33}, 0.25, 99, 2},
		{[]int{6, 7, 65}, []int{2, 3, 32}, []int{0, 4, 33}, 0.25, 99, 2},
		{[]int{2, 3, 2, 5, 3, 7}, []int{1, 1, 0, 2, 1, 3}, []int{1, 2, 2, 3, 2, 4}, 0, 5, 5},
	} {
		want := make([]float32, prod(c.box))
		if err := kernels.DropoutMask(want, c.offset, c.box, c.global, c.p, c.seed, c.step); err != nil {
			t.Fatal(err)
		}
		st, base := rowMajor(c.global), 0
		for d := range c.global {
			base += c.offset[d] * st[d]
		}
		args := []any{int32(len(c.box)), int64(base)}
		for _, v := range [][]int{c.box, st} {
			for d := range 6 {
				x := int64(1)
				if d < len(v) {
					x = int64(v[d])
				}
				args = append(args, x)
			}
		}
		args = append(args, c.p, float32(1/(1-c.p)), c.seed, c.step)
		for _, g := range geometries {
			what := fmt.Sprintf("dropout %+v, grid %d×%d", c, g.grid, g.block)
			got := garbage(len(want))
			if err := e.run("loom_dropout_mask_f32", d1(g.grid), d1(g.block), 0, append([]any{got}, args...)...); err != nil {
				t.Fatal(err)
			}
			checkExact(t, what+" vs kernels.DropoutMask", got, want)
		}
	}

	for _, rows := range []int{0, 1, 3, 17} {
		for _, n := range []int{1, 7, 33, 128, 257} {
			x := make([]float32, rows*n)
			for i := range x {
				x[i] = float32(r.IntN(5)) // many ties
			}
			if rows > 2 {
				for j := range n { // a row of −∞
					x[n+j] = float32(math.Inf(-1))
				}
				x[2*n+n-1] = float32(math.NaN()) // a NaN last, one in the middle
				x[2*n+n/2] = float32(math.NaN())
			}
			want := make([]int64, rows)
			if err := kernels.ArgmaxRows(want, x, n); err != nil {
				t.Fatal(err)
			}
			for _, g := range geometries {
				got := make([]int64, rows)
				for i := range got {
					got[i] = -7
				}
				if err := e.run("loom_argmax_rows_f32", d1(g.grid), d1(g.block), 0, got, x, int64(rows), int32(n)); err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(got, want) {
					t.Errorf("argmax rows %d, n %d, grid %d×%d: %v, want %v (kernels.ArgmaxRows)", rows, n, g.grid, g.block, got, want)
				}
			}
		}
	}
}
