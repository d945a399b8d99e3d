package kernels

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkBlockAttention compares, per unit of work, the block-attention
// kernels context parallelism runs (forward, row dots, backward of one
// causal block of the whole sequence) with the fused causal attention one
// rank runs (CausalAttentionForward and CausalAttentionBackward), float32,
// 8 heads of 32 channels, on one goroutine. Both do the same causal work;
// ns/pair is the time per (query, key) pair under the mask, forward and
// backward together, so the two are compared per FLOP.
func BenchmarkBlockAttention(b *testing.B) {
	const heads, dh = 8, 32
	for _, t := range []int{64, 256, 1024} {
		r := rand.New(rand.NewPCG(1, uint64(t)))
		rnd := func(n int) []float32 {
			x := make([]float32, n)
			for i := range x {
				x[i] = float32(r.NormFloat64())
			}
			return x
		}
		q, k, v, g := rnd(heads*t*dh), rnd(heads*t*dh), rnd(heads*t*dh), rnd(heads*t*dh)
		pairs := float64(heads * t * (t + 1) / 2)
		scale := float32(0.17677669529663687)
		b.Run(fmt.Sprintf("fused/T=%d", t), func(b *testing.B) {
			out, probs := make([]float32, heads*t*dh), make([]float32, heads*t*t)
			dq, dk, dv := make([]float32, heads*t*dh), make([]float32, heads*t*dh), make([]float32, heads*t*dh)
			for b.Loop() {
				if err := CausalAttentionForward(1, out, probs, q, k, v, heads, t, dh, dh, scale); err != nil {
					b.Fatal(err)
				}
				if err := CausalAttentionBackward(1, dq, dk, dv, g, probs, q, k, v, heads, t, dh, dh, scale); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/pairs, "ns/pair")
		})
		b.Run(fmt.Sprintf("block/T=%d", t), func(b *testing.B) {
			sh := BlockAttnShape{Batch: heads, TQ: t, TK: t, DH: dh, DV: dh, Scale: float64(scale), Causal: true}
			out, lse, delta := make([]float32, heads*t*dh), make([]float32, heads*t), make([]float32, heads*t)
			dq, dk, dv := make([]float32, heads*t*dh), make([]float32, heads*t*dh), make([]float32, heads*t*dh)
			for b.Loop() {
				if err := BlockAttentionForward(nil, 1, out, lse, q, k, v, sh); err != nil {
					b.Fatal(err)
				}
				if err := AttentionRowDots(delta, g, out, dh); err != nil {
					b.Fatal(err)
				}
				if err := BlockAttentionBackward(nil, 1, dq, dk, dv, g, q, k, v, lse, delta, sh); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/pairs, "ns/pair")
		})
	}
}
