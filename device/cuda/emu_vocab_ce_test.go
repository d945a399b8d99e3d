//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// The vocab-parallel cross-entropy pieces against the CPU's
// (parallel/tp/vocab_ce.go over kernels.ExpShift), with the vocab split into
// one block or three uneven ones, as ranks hold it: the row maxima are
// exact (NaN rows and signed zeros as Go's max); Σ exp is a double sum on
// both sides in another order with exp in double, so one float32 rounding
// apart (2⁻²³ relative); the picked logit is exact; the gradient rounds
// exp to float32 and then the product, as the CPU does, so within two
// float32 roundings (2.4e-7 relative) plus 1e-7 absolute where the target's
// float32 add cancels. Summed over the blocks, log Σ + max is the
// log-sum-exp of kernels.CrossEntropyRows within 1e-6 relative.
func testVocabCE(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(25, 26))
	for _, rows := range []int{0, 1, 3, 17} {
		for _, v := range []int{1, 7, 300} {
			x := randF32(r, rows*v, 6)
			if rows == 3 && v > 1 {
				x[v+1] = float32(math.NaN())                        // row 1 holds a NaN
				x[2*v], x[2*v+1] = 0, float32(math.Copysign(0, -1)) // row 2: +0 then −0
				for j := 2; j < v; j++ {
					x[2*v+j] = -1
				}
			}
			targets := make([]int64, rows)
			for i := range targets {
				targets[i] = int64(r.IntN(v))
			}
			wantLse := make([]float64, rows)
			if _, err := kernels.CrossEntropyRows(1, wantLse, x, targets, v); err != nil {
				t.Fatal(err)
			}
			splits := [][]int{{v}}
			if v >= 3 {
				splits = append(splits, []int{v / 3, v - v/3 - 1, 1})
			}
			for _, split := range splits {
				// Blocks [lo, lo+vl) of every row, and the CPU's maxima.
				blocks, los := make([][]float32, len(split)), make([]int, len(split))
				rmax := make([]float32, rows)
				for i := range rmax {
					rmax[i] = float32(math.Inf(-1))
				}
				lo := 0
				for b, vl := range split {
					blocks[b], los[b] = make([]float32, rows*vl), lo
					for i := range rows {
						copy(blocks[b][i*vl:(i+1)*vl], x[i*v+lo:i*v+lo+vl])
					}
					lo += vl
				}
				sums := make([]float64, rows)
				for _, g := range []geometry{{1, 32}, {3, 64}, {9, 128}} {
					what := fmt.Sprintf("rows %d, v %d, blocks %v, grid %d×%d", rows, v, split, g.grid, g.block)
					grid, block := d1(g.grid), d1(g.block)
					for i := range rows {
						rmax[i], sums[i] = float32(math.Inf(-1)), 0
					}
					for b, vl := range split {
						got := garbage(rows)
						if err := e.run("loom_vocab_max_f32", grid, block, 0, got, blocks[b], int64(rows), int32(vl)); err != nil {
							t.Fatal(err)
						}
						want := make([]float32, rows)
						for i := range rows {
							mx := math.Inf(-1)
							for _, c := range blocks[b][i*vl : (i+1)*vl] {
								mx = max(mx, float64(c))
							}
							want[i] = float32(mx)
							rmax[i] = max(rmax[i], want[i]) // the all-reduce(max)
						}
						for i := range rows { // exact bits (signed zeros), any NaN for a NaN
							if math.Float32bits(got[i]) != math.Float32bits(want[i]) && !(got[i] != got[i] && want[i] != want[i]) {
								t.Errorf("%s, block %d: row %d's maximum %v (%#x), want %v (%#x)", what, b, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
							}
						}
					}
					for b, vl := range split {
						xb := blocks[b]
						pairs := garbage(2 * rows)
						if err := e.run("loom_vocab_sumexp_pick_f32", grid, block, 0, pairs, xb, rmax, targets, int64(rows), int32(vl), int64(los[b])); err != nil {
							t.Fatal(err)
						}
						wantS, wantP := make([]float32, rows), make([]float32, rows)
						gotS, gotP := make([]float32, rows), make([]float32, rows)
						gpairs := randF32(r, 2*rows, 1)
						wantDx := make([]float32, rows*vl)
						for i := range rows {
							row := xb[i*vl : (i+1)*vl]
							s, err := kernels.ExpShift(nil, row, float64(rmax[i]))
							if err != nil {
								t.Fatal(err)
							}
							wantS[i], gotS[i], gotP[i] = float32(s), pairs[2*i], pairs[2*i+1]
							sums[i] += float64(pairs[2*i])
							k := int(targets[i]) - los[b]
							if k >= 0 && k < vl {
								wantP[i] = row[k]
							}
							d := wantDx[i*vl : (i+1)*vl]
							if _, err := kernels.ExpShift(d, row, float64(rmax[i])); err != nil {
								t.Fatal(err)
							}
							for j := range d {
								d[j] = float32(float64(gpairs[2*i]) * float64(d[j]))
							}
							if k >= 0 && k < vl {
								d[k] += gpairs[2*i+1]
							}
						}
						checkClose(t, fmt.Sprintf("%s, block %d: Σ exp vs kernels.ExpShift", what, b), gotS, wantS, 0x1p-23, 0)
						checkExact(t, fmt.Sprintf("%s, block %d: picked logit", what, b), gotP, wantP)
						dx := append([]float32(nil), xb...) // in place: dx aliases x
						if err := e.run("loom_vocab_ce_bwd_f32", grid, block, 0, dx, dx, rmax, targets, gpairs, int64(rows), int32(vl), int64(los[b])); err != nil {
							t.Fatal(err)
						}
						checkClose(t, fmt.Sprintf("%s, block %d: gradient", what, b), dx, wantDx, 2.4e-7, 1e-7)
					}
					for i := range rows {
						got := math.Log(sums[i]) + float64(rmax[i])
						if !(math.Abs(got-wantLse[i]) <= 1e-6*math.Abs(wantLse[i])) && !(math.IsNaN(got) && math.IsNaN(wantLse[i])) {
							t.Errorf("%s: row %d: log Σ exp + max = %v, want %v (kernels.CrossEntropyRows)", what, i, got, wantLse[i])
						}
					}
				}
			}
		}
	}
}
