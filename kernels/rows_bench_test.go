package kernels

import (
	"math/rand/v2"
	"testing"
)

// BenchmarkRowKernels times the row kernels on the shapes of a tiny-GPT
// step (B·T = 1024 rows; D = 128, F = 512, V = 256; 64 causal blocks of
// 64×64) and reports ns per element.
func BenchmarkRowKernels(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	const rows, d, f, v, t, blocks = 1024, 128, 512, 256, 64, 64
	xd, yd, gd := randRows(rng, rows*d, 2), make([]float32, rows*d), randRows(rng, rows*d, 1)
	w, bias := randRows(rng, d, 1), randRows(rng, d, 1)
	mean, rstd := make([]float64, rows), make([]float64, rows)
	xf, yf, df := randRows(rng, rows*f, 4), make([]float32, rows*f), make([]float32, rows*f)
	xv, dv := randRows(rng, rows*v, 5), make([]float32, rows*v)
	tg := make([]int64, rows)
	for i := range tg {
		tg[i] = int64(rng.IntN(v))
	}
	lse := make([]float64, rows)
	xs, ys := randRows(rng, blocks*t*t, 3), make([]float32, blocks*t*t)
	dw, db := make([]float32, d), make([]float32, d)
	run := func(name string, n int, f func() error) {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				if err := f(); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/elem")
		})
	}
	run("LayerNorm", rows*d, func() error { return LayerNorm(yd, mean, rstd, xd, w, bias, d, 1e-5) })
	run("LayerNormBackward", rows*d, func() error { return LayerNormBackward(yd, dw, db, gd, xd, w, mean, rstd, d) })
	run("BiasGELU", rows*f, func() error { return BiasGELU(0, yf, df, xf, nil, f) })
	run("BiasGELUBackward", rows*f, func() error { return BiasGELUBackward(yf, nil, xf, df, f) })
	run("CausalSoftmax", blocks*t*t, func() error { return CausalSoftmax(0, ys, xs, t, 0.17677669) })
	run("CausalSoftmaxBackward", blocks*t*t, func() error { return CausalSoftmaxBackward(ys, xs, xs, t, 0.17677669) })
	run("CrossEntropyRows", rows*v, func() error { _, err := CrossEntropyRows(0, lse, xv, tg, v); return err })
	run("CrossEntropyRowsBackward", rows*v, func() error { return CrossEntropyRowsBackward(0, dv, xv, tg, lse, v, 1.0/1024) })
	run("ColumnSums", rows*f, func() error { return ColumnSums(df[:f], xf, f) })
}
