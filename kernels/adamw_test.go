package kernels

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestAdamWMatchesPortableLoop: the vector path gives the portable loop's
// bits, for lengths around the vector width and for the extreme values
// an update meets (zero, subnormal and huge gradients, zero moments); and
// mismatched lengths are refused before anything is written.
func TestAdamWMatchesPortableLoop(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	c := &[8]float32{1 - 1e-3*0.1, 0.9, 1 - 0.9, 0.999, 1 - 0.999, float32(math.Sqrt(1 - math.Pow(0.999, 3))), float32(-1e-3 / (1 - math.Pow(0.9, 3))), 1e-8}
	for _, n := range []int{0, 1, 7, 8, 9, 16, 23, 64, 1000} {
		p, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range n {
			p[i], g[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64()*1e-2)
			m[i], v[i] = float32(rng.NormFloat64()*1e-3), float32(rng.Float64()*1e-5)
			switch i % 11 {
			case 3:
				g[i] = 0
			case 5:
				g[i] = 1e-40 // subnormal
			case 7:
				g[i], v[i] = 3e18, 0
			case 9:
				m[i], v[i] = 0, 0
			}
		}
		wp, wg, wm, wv := slices.Clone(p), slices.Clone(g), slices.Clone(m), slices.Clone(v)
		adamwGo(wp, wg, wm, wv, c)
		if err := AdamW(p, g, m, v, c); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			if math.Float32bits(p[i]) != math.Float32bits(wp[i]) || math.Float32bits(m[i]) != math.Float32bits(wm[i]) || math.Float32bits(v[i]) != math.Float32bits(wv[i]) {
				t.Fatalf("n=%d, element %d: (p, m, v) = (%v, %v, %v), portable loop (%v, %v, %v)", n, i, p[i], m[i], v[i], wp[i], wm[i], wv[i])
			}
		}
		if !slices.Equal(g, wg) {
			t.Fatalf("n=%d: the gradient was written", n)
		}
	}
	p := []float32{1, 2}
	if err := AdamW(p, []float32{1}, []float32{0, 0}, []float32{0, 0}, c); err == nil || p[0] != 1 {
		t.Errorf("mismatched lengths: error %v, p %v", err, p)
	}
	if err := AdamW(p, p, p, p, nil); err == nil || p[0] != 1 {
		t.Errorf("nil coefficients: error %v, p %v", err, p)
	}
}

// BenchmarkAdamW compares the vector path with the portable loop on half a
// million parameters (the tiny GPT's size), in one run:
//
//	go test ./kernels -run '^$' -bench AdamW
func BenchmarkAdamW(b *testing.B) {
	const n = 1 << 19
	c := &[8]float32{0.9999, 0.9, 0.1, 0.999, 0.001, 0.05, -0.01, 1e-8}
	p, g, m, v := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
	for i := range n {
		p[i], g[i] = 1, 1e-3
	}
	for _, path := range []struct {
		name string
		f    func()
	}{
		{"vector", func() { _ = AdamW(p, g, m, v, c) }},
		{"portable", func() { adamwGo(p, g, m, v, c) }},
	} {
		b.Run(path.name, func(b *testing.B) {
			b.SetBytes(7 * 4 * n) // p, m, v read and written, g read
			for b.Loop() {
				path.f()
			}
		})
	}
}
