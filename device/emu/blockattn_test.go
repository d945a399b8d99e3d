package emu_test

import (
	"math/rand/v2"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

// blockAttnCases are TestKernelsMatchCPU's rows for
// device.BlockAttentionKernels: two K/V blocks attended and merged, the
// row dots and both blocks' backward, in float32 and float64, one of the
// blocks with explicit positions (a load-balanced shard's two runs).
func blockAttnCases() []kernelCase {
	const b, tq, tk, dh, dv = 2, 5, 4, 3, 6
	s1 := kernels.BlockAttnShape{Batch: b, TQ: tq, TK: tk, DH: dh, DV: dv, Q0: 4, K0: 0, Scale: 0.4, Causal: true}
	s2 := s1
	s2.QPos, s2.KPos = []int{4, 5, 6, 12, 13}, []int{6, 7, 10, 11}
	mk := func(k device.Kernels) device.BlockAttentionKernels { return k.(device.BlockAttentionKernels) }
	var cases []kernelCase
	for _, f64 := range []bool{false, true} {
		name := "BlockAttention/float32"
		rnd := func(r *rand.Rand, n int) any { return randF32(r, n) }
		if f64 {
			name = "BlockAttention/float64"
			rnd = func(r *rand.Rand, n int) any {
				x := make([]float64, n)
				for i := range x {
					x[i] = r.Float64()*4 - 2
				}
				return x
			}
		}
		cases = append(cases, kernelCase{
			name: name,
			setup: func(r *rand.Rand, _ kernels.Workers) arrays {
				a := arrays{}
				for n, l := range map[string]int{"q": b * tq * dh, "k1": b * tk * dh, "v1": b * tk * dv, "k2": b * tk * dh, "v2": b * tk * dv,
					"out": b * tq * dv, "lse": b * tq, "o2": b * tq * dv, "l2": b * tq, "dout": b * tq * dv, "delta": b * tq,
					"dq": b * tq * dh, "dk1": b * tk * dh, "dv1": b * tk * dv, "dk2": b * tk * dh, "dv2": b * tk * dv} {
					a[n] = rnd(r, l)
				}
				return a
			},
			cpu: func(bl *kernels.BLAS, w kernels.Workers, a arrays) error {
				if f64 {
					return blockCPU(bl, w, a, s1, s2, f64s)
				}
				return blockCPU(bl, w, a, s1, s2, f32s)
			},
			dev: func(k device.Kernels, m map[string]device.Buffer) error {
				x := mk(k)
				if err := x.BlockAttention(m["out"], m["lse"], m["q"], m["k1"], m["v1"], s1); err != nil {
					return err
				}
				if err := x.BlockAttention(m["o2"], m["l2"], m["q"], m["k2"], m["v2"], s2); err != nil {
					return err
				}
				if err := x.MergeAttention(m["out"], m["lse"], m["o2"], m["l2"], dv); err != nil {
					return err
				}
				if err := x.AttentionRowDots(m["delta"], m["dout"], m["out"], dv); err != nil {
					return err
				}
				if err := x.BlockAttentionBackward(m["dq"], m["dk1"], m["dv1"], m["dout"], m["q"], m["k1"], m["v1"], m["lse"], m["delta"], s1); err != nil {
					return err
				}
				return x.BlockAttentionBackward(m["dq"], m["dk2"], nil, m["dout"], m["q"], m["k2"], m["v2"], m["lse"], m["delta"], s2)
			},
		})
	}
	return cases
}

// blockCPU is blockAttnCases' CPU side for element type T.
func blockCPU[T float32 | float64](bl *kernels.BLAS, w kernels.Workers, a arrays, s1, s2 kernels.BlockAttnShape, g func(any) []T) error {
	if err := kernels.BlockAttentionForward(bl, w, g(a["out"]), g(a["lse"]), g(a["q"]), g(a["k1"]), g(a["v1"]), s1); err != nil {
		return err
	}
	if err := kernels.BlockAttentionForward(bl, w, g(a["o2"]), g(a["l2"]), g(a["q"]), g(a["k2"]), g(a["v2"]), s2); err != nil {
		return err
	}
	if err := kernels.MergeAttention(g(a["out"]), g(a["lse"]), g(a["o2"]), g(a["l2"]), s1.DV); err != nil {
		return err
	}
	if err := kernels.AttentionRowDots(g(a["delta"]), g(a["dout"]), g(a["out"]), s1.DV); err != nil {
		return err
	}
	if err := kernels.BlockAttentionBackward(bl, w, g(a["dq"]), g(a["dk1"]), g(a["dv1"]), g(a["dout"]), g(a["q"]), g(a["k1"]), g(a["v1"]), g(a["lse"]), g(a["delta"]), s1); err != nil {
		return err
	}
	return kernels.BlockAttentionBackward(bl, w, g(a["dq"]), g(a["dk2"]), nil, g(a["dout"]), g(a["q"]), g(a["k2"]), g(a["v2"]), g(a["lse"]), g(a["delta"]), s2)
}
