package kernels

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// sgdPasses is torch.optim.SGD's single-tensor step written as PyTorch's
// sequence of whole-tensor ops, one pass each, every result rounded to T:
// the reference SGD must equal bit for bit.
func sgdPasses[T Float](p, g, buf []T, s SGDStep) {
	d := slices.Clone(g)
	if s.Maximize {
		for i := range d {
			d[i] = -d[i]
		}
	}
	if s.WeightDecay != 0 {
		wd := T(s.WeightDecay)
		for i := range d {
			d[i] += T(wd * p[i])
		}
	}
	if s.Momentum != 0 {
		mu, damp := T(s.Momentum), T(1-s.Dampening)
		if s.First {
			copy(buf, d)
		} else {
			for i := range buf {
				buf[i] = T(mu*buf[i]) + T(damp*d[i])
			}
		}
		if s.Nesterov {
			for i := range d {
				d[i] += T(mu * buf[i])
			}
		} else {
			copy(d, buf)
		}
	}
	lr := T(s.LR)
	for i := range p {
		p[i] -= T(lr * d[i])
	}
}

func TestSGD(t *testing.T) {
	t.Run("float32", testSGD[float32])
	t.Run("float64", testSGD[float64])
}

func testSGD[T Float](t *testing.T) {
	cases := []struct {
		name string
		s    SGDStep
	}{
		{"plain", SGDStep{LR: 0.1}},
		{"decay", SGDStep{LR: 0.03, WeightDecay: 0.01}},
		{"maximize", SGDStep{LR: 0.03, WeightDecay: 0.01, Maximize: true}},
		{"momentum/first", SGDStep{LR: 0.05, Momentum: 0.9, Dampening: 0.1, First: true}},
		{"momentum", SGDStep{LR: 0.05, Momentum: 0.9, Dampening: 0.1, WeightDecay: 1e-3}},
		{"nesterov/first", SGDStep{LR: 0.05, Momentum: 0.8, Nesterov: true, First: true}},
		{"nesterov", SGDStep{LR: 0.05, Momentum: 0.8, Nesterov: true, WeightDecay: 0.02, Maximize: true}},
	}
	rng := rand.New(rand.NewPCG(3, 5))
	for _, c := range cases {
		for _, n := range []int{0, 1, 7, 33} {
			p, g, buf := randT[T](rng, n), randT[T](rng, n), randT[T](rng, n)
			wp, wbuf := slices.Clone(p), slices.Clone(buf)
			sgdPasses(wp, g, wbuf, c.s)
			gotBuf := buf
			if c.s.Momentum == 0 {
				gotBuf = nil // not read without momentum
			}
			if err := SGD(p, g, gotBuf, c.s); err != nil {
				t.Fatalf("%s, n=%d: %v", c.name, n, err)
			}
			for i := range n {
				if float64(p[i]) != float64(wp[i]) || (c.s.Momentum != 0 && float64(buf[i]) != float64(wbuf[i])) {
					t.Fatalf("%s, n=%d, element %d: (p, buf) = (%v, %v), want (%v, %v)", c.name, n, i, p[i], buf[i], wp[i], wbuf[i])
				}
			}
		}
	}
	p := []T{1, 2}
	for _, bad := range []struct {
		g, buf []T
		s      SGDStep
	}{
		{[]T{1}, nil, SGDStep{LR: 1}},
		{[]T{1, 1}, []T{0}, SGDStep{LR: 1, Momentum: 0.5}},
	} {
		if err := SGD(p, bad.g, bad.buf, bad.s); !errors.Is(err, ErrInvalid) || p[0] != 1 || p[1] != 2 {
			t.Errorf("SGD(len %d, len %d, len %d): error %v, p %v; want ErrInvalid and p unchanged", len(p), len(bad.g), len(bad.buf), err, p)
		}
	}
}

func TestSumSquares(t *testing.T) {
	for _, c := range []struct {
		x    []float32
		want float64
	}{
		{nil, 0},
		{[]float32{3, -4}, 25},
		{[]float32{1e30, 1e30}, 2 * float64(float32(1e30)) * float64(float32(1e30))}, // past float32's range: summed in float64
		{[]float32{1e-30}, float64(float32(1e-30)) * float64(float32(1e-30))},        // below float32's
		{[]float32{float32(math.Inf(-1)), 1}, math.Inf(1)},
	} {
		if got := SumSquares(c.x); got != c.want {
			t.Errorf("SumSquares(%v) = %v, want %v", c.x, got, c.want)
		}
	}
	if got := SumSquares([]float64{0.5, 2}); got != 4.25 {
		t.Errorf("SumSquares(float64) = %v, want 4.25", got)
	}
}
