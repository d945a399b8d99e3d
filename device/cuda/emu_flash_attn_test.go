//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// Flash attention against kernels.CausalAttentionForward and Backward, at
// T {1, 5, 64, 65, 130} (part of a 32-key tile, two whole tiles, two and
// one key, five tiles) × head dims {8, 32, 64} × batch·heads {1, 3} (and
// 128 at T ≤ 65 with one head), blocks of 1, 3 and 4 warps, and grids
// smaller and larger than the work. The device computes scores, exps and
// sums in float32 where the CPU's softmax is float64, and accumulates in
// another order (online, tile by tile): with
// q, k, v in [−1, 1) and scale 1/√dh, outputs within 2e-5 absolute plus
// 1e-4 relative; the saved log-sum-exp within 2e-5 of the float64 one;
// gradients, sums of up to T float32 products of both signs, within 5e-5
// absolute plus 2e-4 relative (they reach about 10 at T = 130).
func testFlashAttention(t *testing.T, e *emuLib) {
	r := rand.New(rand.NewPCG(29, 30))
	geos := []geometry{{1, 32}, {5, 128}, {200, 96}}
	cases := 0
	for _, tt := range []int{1, 5, 64, 65, 130} {
		for _, dh := range []int{8, 32, 64, 128} {
			for _, batch := range []int{1, 3} {
				if dh == 128 && (tt > 65 || batch > 1) {
					continue // the emulator is slow; one T and batch show the widest rows
				}
				cases++
				scale := float32(1 / math.Sqrt(float64(dh)))
				n := batch * tt * dh
				q, k, v, g := randF32(r, n, 1), randF32(r, n, 1), randF32(r, n, 1), randF32(r, n, 1)
				want, probs := make([]float32, n), make([]float32, batch*tt*tt)
				if err := kernels.CausalAttentionForward(1, want, probs, q, k, v, batch, tt, dh, dh, scale); err != nil {
					t.Fatal(err)
				}
				wdq, wdk, wdv := make([]float32, n), make([]float32, n), make([]float32, n)
				if err := kernels.CausalAttentionBackward(1, wdq, wdk, wdv, g, probs, q, k, v, batch, tt, dh, dh, scale); err != nil {
					t.Fatal(err)
				}
				wantLse := make([]float32, batch*tt)
				for b := range batch {
					for i := range tt {
						s := make([]float64, i+1)
						mx := math.Inf(-1)
						for j := range i + 1 {
							d := float32(0)
							for c := range dh {
								d += q[(b*tt+i)*dh+c] * k[(b*tt+j)*dh+c]
							}
							s[j] = float64(scale * d)
							mx = max(mx, s[j])
						}
						sum := 0.0
						for _, x := range s {
							sum += math.Exp(x - mx)
						}
						wantLse[b*tt+i] = float32(mx + math.Log(sum))
					}
				}
				// Two of the three geometries per case, in turn, to keep
				// the emulator's time down.
				for _, geo := range []geometry{geos[cases%3], geos[(cases+1)%3]} {
					what := fmt.Sprintf("T %d, dh %d, batch %d, grid %d×%d", tt, dh, batch, geo.grid, geo.block)
					grid, block := d1(geo.grid), d1(geo.block)
					out, lse := garbage(n), garbage(batch*tt)
					if err := e.run("loom_flash_attn_fwd_f32", grid, block, 0, out, lse, q, k, v, int64(batch), int32(tt), int32(dh), int32(dh), scale); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": out vs kernels.CausalAttentionForward", out, want, 1e-4, 2e-5)
					checkClose(t, what+": lse", lse, wantLse, 0, 2e-5)
					dq, dd := garbage(n), garbage(batch*tt)
					if err := e.run("loom_flash_attn_bwd_dq_f32", grid, block, 0, dq, dd, g, out, lse, q, k, v, int64(batch), int32(tt), int32(dh), int32(dh), scale); err != nil {
						t.Fatal(err)
					}
					dk, dv := garbage(n), garbage(n)
					if err := e.run("loom_flash_attn_bwd_dkv_f32", grid, block, 0, dk, dv, g, lse, dd, q, k, v, int64(batch), int32(tt), int32(dh), int32(dh), scale); err != nil {
						t.Fatal(err)
					}
					checkClose(t, what+": dq vs kernels.CausalAttentionBackward", dq, wdq, 2e-4, 5e-5)
					checkClose(t, what+": dk vs kernels.CausalAttentionBackward", dk, wdk, 2e-4, 5e-5)
					checkClose(t, what+": dv vs kernels.CausalAttentionBackward", dv, wdv, 2e-4, 5e-5)
				}
			}
		}
	}
}
