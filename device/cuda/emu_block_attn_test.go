//go:build linux && (amd64 || arm64)

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/b7ea7098/loom/kernels"
)

// blockAttnCase is one Q block against two K/V blocks: the forward of
// each, their LSE merge, the row dots and both blocks' backward.
type blockAttnCase struct {
	name               string
	batch, tq, dh, dv  int
	tk1, tk2           int
	q0, k01, k02       int
	qpos, kpos1, kpos2 []int // nil: the runs from q0, k01, k02
	causal             bool
}

// runs returns the positions of runs [lo, hi), one after another.
func runs(r ...[2]int) []int {
	var p []int
	for _, x := range r {
		for i := x[0]; i < x[1]; i++ {
			p = append(p, i)
		}
	}
	return p
}

// Block attention (kernels/block_attn.cu) against package kernels' CPU
// block kernels, float64 and float32: blocks at offsets whose rows see
// all, some or none of a block's keys (rows that see nothing in one block
// get lse −Inf there and are completed by the merge; a row that sees no
// key in either keeps output 0 and lse −Inf and gets no gradient), the two-run
// positions of a load-balanced shard over more than one 32-key tile,
// and a non-causal block with rows of 128. The backward adds into
// gradients that already hold values, as the kernels' contract says, and
// one call leaves dk out. float64 agrees within 1e-12 relative (the device
// sums in another order); float32 within the flash kernels' tolerances
// (scores and softmax in float32 on the device, float64 on the CPU).
func testBlockAttention(t *testing.T, e *emuLib) {
	geos := []geometry{{1, 32}, {3, 96}, {50, 256}}
	for ci, c := range blockAttnCases() {
		for gi, f64 := range []bool{true, false} {
			geo := geos[(ci+gi)%len(geos)]
			t.Run(fmt.Sprintf("%s/f64=%v/grid %d×%d", c.name, f64, geo.grid, geo.block), func(t *testing.T) {
				if f64 {
					blockAttnCheck[float64](t, emuBlockAttn[float64]{e, geo, "_f64"}, c, blockAttnTol64, blockAttnTol64/10, blockAttnTol64, blockAttnTol64/10)
				} else {
					blockAttnCheck[float32](t, emuBlockAttn[float32]{e, geo, "_f32"}, c, 1e-4, 2e-5, 2e-4, 5e-5)
				}
			})
		}
	}
}

// blockAttnTol64 is the relative tolerance of the float64 kernels against
// the CPU's: both are float64 throughout, summing in different orders.
const blockAttnTol64 = 1e-12

// blockAttnCases are the shapes testBlockAttention and
// TestGPUBlockAttention run.
func blockAttnCases() []blockAttnCase {
	zig := runs([2]int{0, 20}, [2]int{60, 80})
	return []blockAttnCase{
		{name: "offsets", batch: 2, tq: 7, dh: 4, dv: 3, tk1: 7, tk2: 4, q0: 1, k01: 2, k02: 6, causal: true},
		{name: "balanced", batch: 3, tq: 40, dh: 32, dv: 16, tk1: 40, tk2: 40, qpos: zig, kpos1: zig,
			kpos2: runs([2]int{20, 40}, [2]int{40, 60}), causal: true},
		{name: "wide", batch: 1, tq: 33, dh: 128, dv: 128, tk1: 65, tk2: 3, q0: 0, k01: 0, k02: 65},
	}
}

// blockAttnRunner runs the four block-attention ops of T on host slices
// (the emulator's kernels, or a GPU's through cudaKernels), writing the
// results back into them; nil slices are the optional gradients left out.
type blockAttnRunner[T float32 | float64] interface {
	forward(out, lse, q, k, v []T, s kernels.BlockAttnShape) error
	merge(out, lse, o2, lse2 []T, dv int) error
	rowDots(delta, dout, out []T, dv int) error
	backward(dq, dk, dv, dout, q, k, v, lse, delta []T, s kernels.BlockAttnShape) error
}

// emuBlockAttn runs the kernels of block_attn.cu on the emulator, with
// geometry geo.
type emuBlockAttn[T float32 | float64] struct {
	e   *emuLib
	geo geometry
	sfx string
}

func (r emuBlockAttn[T]) shape(s kernels.BlockAttnShape) []any {
	pos := func(p []int) []int64 {
		out := make([]int64, len(p))
		for i, x := range p {
			out[i] = int64(x)
		}
		return out
	}
	causal := int32(0)
	if s.Causal {
		causal = 1
	}
	return []any{pos(s.QPos), pos(s.KPos), int64(s.Batch), int32(s.TQ), int32(s.TK), int32(s.DH), int32(s.DV),
		int64(s.Q0), int64(s.K0), s.Scale, causal}
}

func (r emuBlockAttn[T]) run(name string, args ...any) error {
	return r.e.run(name+r.sfx, d1(r.geo.grid), d1(r.geo.block), 0, args...)
}

func (r emuBlockAttn[T]) forward(out, lse, q, k, v []T, s kernels.BlockAttnShape) error {
	return r.run("loom_block_attn_fwd", append([]any{out, lse, q, k, v}, r.shape(s)...)...)
}

func (r emuBlockAttn[T]) merge(out, lse, o2, lse2 []T, dv int) error {
	return r.run("loom_block_attn_merge", out, lse, o2, lse2, int64(len(lse)), int32(dv))
}

func (r emuBlockAttn[T]) rowDots(delta, dout, out []T, dv int) error {
	return r.run("loom_block_attn_rowdots", delta, dout, out, int64(len(delta)), int32(dv))
}

func (r emuBlockAttn[T]) backward(dq, dk, dv, dout, q, k, v, lse, delta []T, s kernels.BlockAttnShape) error {
	if err := r.run("loom_block_attn_bwd_dq", append([]any{dq, dout, q, k, v, lse, delta}, r.shape(s)...)...); err != nil {
		return err
	}
	return r.run("loom_block_attn_bwd_dkv", append([]any{dk, dv, dout, q, k, v, lse, delta}, r.shape(s)...)...)
}

// blockAttnCheck runs one case in T on x against the CPU kernels: outputs
// within rtol·|want| + atol, gradients within grtol and gatol.
func blockAttnCheck[T float32 | float64](t *testing.T, x blockAttnRunner[T], c blockAttnCase, rtol, atol, grtol, gatol float64) {
	r := rand.New(rand.NewPCG(uint64(c.tq), uint64(c.dh)))
	rnd := func(n int) []T {
		x := make([]T, n)
		for i := range x {
			x[i] = T(2*r.Float64() - 1)
		}
		return x
	}
	b := c.batch
	q, dout := rnd(b*c.tq*c.dh), rnd(b*c.tq*c.dv)
	k1, v1, k2, v2 := rnd(b*c.tk1*c.dh), rnd(b*c.tk1*c.dv), rnd(b*c.tk2*c.dh), rnd(b*c.tk2*c.dv)
	scale := 1 / math.Sqrt(float64(c.dh))
	s1 := kernels.BlockAttnShape{Batch: b, TQ: c.tq, TK: c.tk1, DH: c.dh, DV: c.dv, Q0: c.q0, K0: c.k01, QPos: c.qpos, KPos: c.kpos1, Scale: scale, Causal: c.causal}
	s2 := s1
	s2.TK, s2.K0, s2.KPos = c.tk2, c.k02, c.kpos2
	nan := func(n int) []T {
		x := make([]T, n)
		for i := range x {
			x[i] = T(math.NaN())
		}
		return x
	}

	// Forward of each block, then the merge.
	rows := b * c.tq
	wo1, wl1, wo2, wl2 := make([]T, rows*c.dv), make([]T, rows), make([]T, rows*c.dv), make([]T, rows)
	if err := kernels.BlockAttentionForward(nil, 1, wo1, wl1, q, k1, v1, s1); err != nil {
		t.Fatal(err)
	}
	if err := kernels.BlockAttentionForward(nil, 1, wo2, wl2, q, k2, v2, s2); err != nil {
		t.Fatal(err)
	}
	o1, l1, o2, l2 := nan(rows*c.dv), nan(rows), nan(rows*c.dv), nan(rows)
	if err := x.forward(o1, l1, q, k1, v1, s1); err != nil {
		t.Fatal(err)
	}
	if err := x.forward(o2, l2, q, k2, v2, s2); err != nil {
		t.Fatal(err)
	}
	closeT(t, "out of block 1", o1, wo1, rtol, atol)
	closeT(t, "lse of block 1", l1, wl1, rtol, atol)
	closeT(t, "out of block 2", o2, wo2, rtol, atol)
	closeT(t, "lse of block 2", l2, wl2, rtol, atol)
	if err := kernels.MergeAttention(wo1, wl1, wo2, wl2, c.dv); err != nil {
		t.Fatal(err)
	}
	if err := x.merge(o1, l1, o2, l2, c.dv); err != nil {
		t.Fatal(err)
	}
	closeT(t, "merged out", o1, wo1, rtol, atol)
	closeT(t, "merged lse", l1, wl1, rtol, atol)

	// Backward from the CPU's merged out and lse, into gradients that
	// start from the same values on both sides.
	wd, d := make([]T, rows), nan(rows)
	if err := kernels.AttentionRowDots(wd, dout, wo1, c.dv); err != nil {
		t.Fatal(err)
	}
	if err := x.rowDots(d, dout, wo1, c.dv); err != nil {
		t.Fatal(err)
	}
	closeT(t, "row dots", d, wd, rtol, atol)
	dq, dk1, dv1, dk2, dv2 := rnd(rows*c.dh), rnd(b*c.tk1*c.dh), rnd(b*c.tk1*c.dv), rnd(b*c.tk2*c.dh), rnd(b*c.tk2*c.dv)
	cp := func(x []T) []T { return append([]T(nil), x...) }
	wdq, wdk1, wdv1, wdk2, wdv2 := cp(dq), cp(dk1), cp(dv1), cp(dk2), cp(dv2)
	if err := kernels.BlockAttentionBackward(nil, 1, wdq, wdk1, wdv1, dout, q, k1, v1, wl1, wd, s1); err != nil {
		t.Fatal(err)
	}
	if err := kernels.BlockAttentionBackward(nil, 1, wdq, nil, wdv2, dout, q, k2, v2, wl1, wd, s2); err != nil {
		t.Fatal(err)
	}
	if err := x.backward(dq, dk1, dv1, dout, q, k1, v1, wl1, wd, s1); err != nil {
		t.Fatal(err)
	}
	if err := x.backward(dq, nil, dv2, dout, q, k2, v2, wl1, wd, s2); err != nil {
		t.Fatal(err)
	}
	closeT(t, "dq", dq, wdq, grtol, gatol)
	closeT(t, "dk of block 1", dk1, wdk1, grtol, gatol)
	closeT(t, "dv of block 1", dv1, wdv1, grtol, gatol)
	closeT(t, "dk of block 2 (not asked for)", dk2, wdk2, 0, 0)
	closeT(t, "dv of block 2", dv2, wdv2, grtol, gatol)
}

// closeT reports the first element where |got − want| > rtol·|want| +
// atol; infinities must match exactly, NaNs are errors.
func closeT[T float32 | float64](t *testing.T, what string, got, want []T, rtol, atol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d values, want %d", what, len(got), len(want))
		return
	}
	for i := range got {
		g, w := float64(got[i]), float64(want[i])
		if math.IsInf(w, 0) || math.IsInf(g, 0) || math.IsNaN(g) || math.IsNaN(w) {
			if g != w {
				t.Errorf("%s: [%d] = %v, want %v", what, i, g, w)
				return
			}
			continue
		}
		if math.Abs(g-w) > rtol*math.Abs(w)+atol {
			t.Errorf("%s: [%d] = %v, want %v (|diff| %.3g > %.3g·|want| + %.3g)", what, i, g, w, math.Abs(g-w), rtol, atol)
			return
		}
	}
}
