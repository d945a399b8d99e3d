package kernels

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
)

// The row kernels are checked against straightforward float64 references.
// Each reference also returns a magnitude per element (the size of the
// terms that make it up), and an element passes when
// |got − ref| <= tol·mag + 1e-37 (the last term admits float32 underflow):
// tol is a few float32 ulps (2^-24 each) for one rounding of an accurate
// value, more where a result cancels terms.

const ulp32 = 0x1p-24

// rowShapes are the (rows, n) pairs every row kernel is tried on: odd
// sizes around the vector width, zero-length rows and empty blocks, and
// blocks large enough to split over goroutines.
var rowShapes = [][2]int{
	{0, 0}, {0, 5}, {3, 0}, {1, 1}, {2, 3}, {3, 4}, {1, 5}, {4, 7}, {2, 8}, {3, 9},
	{5, 17}, {7, 33}, {2, 64}, {9, 129}, {3, 256}, {600, 256},
}

func randRows(rng *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32((rng.Float64()*2 - 1) * scale)
	}
	return x
}

// check compares got with ref under tol·mag + 1e-37 and reports the first
// few failures.
func check(t *testing.T, name string, got []float32, ref, mag []float64, tol float64) {
	t.Helper()
	if len(got) != len(ref) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(ref))
	}
	bad := 0
	for i, g := range got {
		r := ref[i]
		if math.IsNaN(r) && math.IsNaN(float64(g)) {
			continue
		}
		if d := math.Abs(float64(g) - r); !(d <= tol*mag[i]+1e-37) {
			t.Errorf("%s: [%d] = %g, want %g (|Δ| %.3g > %.3g)", name, i, g, r, d, tol*mag[i]+1e-37)
			if bad++; bad > 5 {
				t.FailNow()
			}
		}
	}
}

func absAll(x []float64) []float64 {
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = math.Abs(v)
	}
	return out
}

func refSoftmax(x []float32, n int, logOut bool) (y, mag []float64) {
	y = make([]float64, len(x))
	for r := 0; r+n <= len(x) && n > 0; r += n {
		m := math.Inf(-1)
		for _, v := range x[r : r+n] {
			m = max(m, float64(v))
		}
		s := 0.0
		for _, v := range x[r : r+n] {
			s += math.Exp(float64(v) - m)
		}
		for j, v := range x[r : r+n] {
			if logOut {
				y[r+j] = float64(v) - m - math.Log(s)
			} else {
				y[r+j] = math.Exp(float64(v)-m) / s
			}
		}
	}
	return y, absAll(y)
}

func TestSoftmaxRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 1))
	for _, sh := range rowShapes {
		rows, n := sh[0], sh[1]
		for _, logOut := range []bool{false, true} {
			name := fmt.Sprintf("rows%d_n%d_log%v", rows, n, logOut)
			x := randRows(rng, rows*n, 20)
			ref, mag := refSoftmax(x, n, logOut)
			f := SoftmaxRows
			if logOut {
				f = LogSoftmaxRows
			}
			y := make([]float32, len(x))
			if err := f(0, y, x, n); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			check(t, name, y, ref, mag, 2*ulp32)
			// In place gives the same values.
			z := slices.Clone(x)
			if err := f(0, z, z, n); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(z, y) {
				t.Errorf("%s: in place differs from out of place", name)
			}

			// Backward: dx = y(dy − Σdy·y), or dy − exp(y)Σdy.
			dy := randRows(rng, rows*n, 1)
			dx := make([]float32, len(x))
			b := SoftmaxRowsBackward
			if logOut {
				b = func(dx, y, dy []float32, n int) error { return LogSoftmaxRowsBackward(0, dx, y, dy, n) }
			}
			if err := b(dx, y, dy, n); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			rb, mb := make([]float64, len(x)), make([]float64, len(x))
			for r := 0; r+n <= len(x) && n > 0; r += n {
				s, sa := 0.0, 0.0
				for j := range n {
					if logOut {
						s += float64(dy[r+j])
						sa += math.Abs(float64(dy[r+j]))
					} else {
						s += float64(dy[r+j]) * float64(y[r+j])
						sa += math.Abs(float64(dy[r+j]) * float64(y[r+j]))
					}
				}
				for j := range n {
					g, v := float64(dy[r+j]), float64(y[r+j])
					if logOut {
						rb[r+j] = g - math.Exp(v)*s
						mb[r+j] = math.Abs(g) + math.Exp(v)*sa
					} else {
						rb[r+j] = v * (g - s)
						mb[r+j] = math.Abs(v) * (math.Abs(g) + sa)
					}
				}
			}
			check(t, name+"_backward", dx, rb, mb, 4*ulp32)
		}
	}
}

func TestCausalSoftmax(t *testing.T) {
	rng := rand.New(rand.NewPCG(2, 1))
	for _, tc := range []struct{ blocks, t int }{{0, 0}, {0, 3}, {2, 0}, {1, 1}, {3, 2}, {2, 5}, {4, 8}, {3, 13}, {2, 64}, {70, 64}} {
		for _, scale := range []float32{1, 0.17677669} {
			name := fmt.Sprintf("blocks%d_t%d_scale%g", tc.blocks, tc.t, scale)
			tt := tc.t
			x := randRows(rng, tc.blocks*tt*tt, 10)
			ref, mag := make([]float64, len(x)), make([]float64, len(x))
			for r := 0; r < tc.blocks*tt; r++ {
				i := r % tt
				row := x[r*tt : r*tt+i+1]
				m := math.Inf(-1)
				for _, v := range row {
					m = max(m, float64(v*scale))
				}
				s := 0.0
				for _, v := range row {
					s += math.Exp(float64(v*scale) - m)
				}
				for j, v := range row {
					ref[r*tt+j] = math.Exp(float64(v*scale)-m) / s
					mag[r*tt+j] = ref[r*tt+j]
				}
			}
			y := make([]float32, len(x))
			for i := range y {
				y[i] = float32(math.NaN()) // masked entries must be overwritten with 0
			}
			if err := CausalSoftmax(0, y, x, tt, scale); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			check(t, name, y, ref, mag, 2*ulp32)
			z := slices.Clone(x)
			if err := CausalSoftmax(0, z, z, tt, scale); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(z, y) {
				t.Errorf("%s: in place differs from out of place", name)
			}

			dy := randRows(rng, len(x), 1)
			dx := make([]float32, len(x))
			if err := CausalSoftmaxBackward(dx, y, dy, tt, scale); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			rb, mb := make([]float64, len(x)), make([]float64, len(x))
			for r := 0; r < tc.blocks*tt; r++ {
				i := r % tt
				s, sa := 0.0, 0.0
				for j := 0; j <= i; j++ {
					s += float64(dy[r*tt+j]) * float64(y[r*tt+j])
					sa += math.Abs(float64(dy[r*tt+j]) * float64(y[r*tt+j]))
				}
				for j := 0; j <= i; j++ {
					g, v := float64(dy[r*tt+j]), float64(y[r*tt+j])
					rb[r*tt+j] = float64(scale) * v * (g - s)
					mb[r*tt+j] = float64(scale) * math.Abs(v) * (math.Abs(g) + sa)
				}
			}
			check(t, name+"_backward", dx, rb, mb, 4*ulp32)
		}
	}
}

func TestLayerNorm(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 1))
	const eps = 1e-5
	for _, sh := range rowShapes {
		rows, n := sh[0], sh[1]
		for _, affine := range []bool{true, false} {
			name := fmt.Sprintf("rows%d_n%d_affine%v", rows, n, affine)
			x := randRows(rng, rows*n, 3)
			for i := range x {
				x[i] += 100 // a mean far from 0 must not cancel the variance
			}
			var w, b []float32
			if affine {
				w, b = randRows(rng, n, 2), randRows(rng, n, 1)
			}
			wv := func(j int) float64 {
				if w == nil {
					return 1
				}
				return float64(w[j])
			}
			bv := func(j int) float64 {
				if b == nil {
					return 0
				}
				return float64(b[j])
			}
			ref, mag := make([]float64, len(x)), make([]float64, len(x))
			xh := make([]float64, len(x))
			rsd := make([]float64, rows)
			for r := range rows {
				if n == 0 {
					break
				}
				mu := 0.0
				for _, v := range x[r*n : (r+1)*n] {
					mu += float64(v)
				}
				mu /= float64(n)
				v2 := 0.0
				for _, v := range x[r*n : (r+1)*n] {
					v2 += (float64(v) - mu) * (float64(v) - mu)
				}
				rsd[r] = 1 / math.Sqrt(v2/float64(n)+eps)
				for j, v := range x[r*n : (r+1)*n] {
					xh[r*n+j] = (float64(v) - mu) * rsd[r]
					ref[r*n+j] = xh[r*n+j]*wv(j) + bv(j)
					mag[r*n+j] = math.Abs(xh[r*n+j]*wv(j)) + math.Abs(bv(j)) + math.Abs(wv(j))*1e-3
				}
			}
			y := make([]float32, len(x))
			mean, rstd := make([]float64, rows), make([]float64, rows)
			if err := LayerNorm(y, mean, rstd, x, w, b, n, eps); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			// Inputs near 100 with unit spread: x̂ carries ~2^-24·100 of
			// input rounding relative to its unit scale, beyond that
			// float32 rounding only.
			check(t, name, y, ref, mag, 4*ulp32)

			dy := randRows(rng, len(x), 1)
			dx := make([]float32, len(x))
			var dw, db []float32
			if affine {
				dw, db = make([]float32, n), make([]float32, n)
			}
			if err := LayerNormBackward(dx, dw, db, dy, x, w, mean, rstd, n); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			rdx, mdx := make([]float64, len(x)), make([]float64, len(x))
			rdw, rdb, mdw, mdb := make([]float64, n), make([]float64, n), make([]float64, n), make([]float64, n)
			for r := range rows {
				m1, m2, a1, a2 := 0.0, 0.0, 0.0, 0.0
				for j := range n {
					h := float64(dy[r*n+j]) * wv(j)
					m1 += h
					m2 += h * xh[r*n+j]
					a1 += math.Abs(h)
					a2 += math.Abs(h * xh[r*n+j])
					rdw[j] += float64(dy[r*n+j]) * xh[r*n+j]
					mdw[j] += math.Abs(float64(dy[r*n+j]) * xh[r*n+j])
					rdb[j] += float64(dy[r*n+j])
					mdb[j] += math.Abs(float64(dy[r*n+j]))
				}
				m1, m2, a1, a2 = m1/float64(n), m2/float64(n), a1/float64(n), a2/float64(n)
				for j := range n {
					h := float64(dy[r*n+j]) * wv(j)
					rdx[r*n+j] = rsd[r] * (h - m1 - xh[r*n+j]*m2)
					mdx[r*n+j] = rsd[r] * (math.Abs(h) + a1 + math.Abs(xh[r*n+j])*a2)
				}
			}
			check(t, name+"_dx", dx, rdx, mdx, 4*ulp32)
			if affine {
				check(t, name+"_dw", dw, rdw, mdw, 2*ulp32)
				check(t, name+"_db", db, rdb, mdb, 2*ulp32)
			}
		}
	}
}

func TestBiasGELU(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 1))
	for _, sh := range rowShapes {
		rows, n := sh[0], sh[1]
		for _, withBias := range []bool{false, true} {
			name := fmt.Sprintf("rows%d_n%d_bias%v", rows, n, withBias)
			x := randRows(rng, rows*n, 12)
			var bias []float32
			if withBias {
				bias = randRows(rng, n, 1)
			}
			ref, mag := make([]float64, len(x)), make([]float64, len(x))
			rd, md := make([]float64, len(x)), make([]float64, len(x))
			for i, v := range x {
				u := v
				if bias != nil {
					u += bias[i%n]
				}
				f := float64(u)
				phi := 0.5 * math.Erfc(-f/math.Sqrt2)
				pdf := math.Exp(-f*f/2) / math.Sqrt(2*math.Pi)
				ref[i], mag[i] = f*phi, math.Abs(f*phi)
				rd[i], md[i] = phi+f*pdf, phi+math.Abs(f*pdf)
			}
			y, d := make([]float32, len(x)), make([]float32, len(x))
			if err := BiasGELU(0, y, d, x, bias, n); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			check(t, name, y, ref, mag, 2*ulp32)
			check(t, name+"_deriv", d, rd, md, 2*ulp32)

			dy := randRows(rng, len(x), 1)
			dx := make([]float32, len(x))
			var db []float32
			if withBias {
				db = make([]float32, n)
			}
			if err := BiasGELUBackward(dx, db, dy, d, n); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			rdx, mdx := make([]float64, len(x)), make([]float64, len(x))
			rdb, mdb := make([]float64, n), make([]float64, n)
			for i := range x {
				rdx[i] = float64(dy[i]) * rd[i]
				mdx[i] = math.Abs(float64(dy[i])) * md[i]
				if n > 0 {
					rdb[i%n] += rdx[i]
					mdb[i%n] += mdx[i]
				}
			}
			check(t, name+"_dx", dx, rdx, mdx, 4*ulp32)
			if withBias {
				check(t, name+"_dbias", db, rdb, mdb, 8*ulp32)
			}
		}
	}
}

func TestCrossEntropyRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 1))
	for _, sh := range rowShapes {
		rows, v := sh[0], sh[1]
		if v == 0 && rows > 0 {
			continue // no class to target
		}
		for _, scale := range []float64{1.0 / 1024, -0.5, 0} {
			name := fmt.Sprintf("rows%d_v%d_scale%g", rows, v, scale)
			x := randRows(rng, rows*v, 15)
			tg := make([]int64, rows)
			for r := range tg {
				tg[r] = int64(rng.IntN(v))
			}
			want, wantMag := 0.0, 0.0
			lref := make([]float64, rows)
			for r := range rows {
				row := x[r*v : (r+1)*v]
				m := math.Inf(-1)
				for _, e := range row {
					m = max(m, float64(e))
				}
				s := 0.0
				for _, e := range row {
					s += math.Exp(float64(e) - m)
				}
				lref[r] = m + math.Log(s)
				want += lref[r] - float64(row[tg[r]])
				wantMag += math.Abs(lref[r]) + math.Abs(float64(row[tg[r]]))
			}
			lse := make([]float64, rows)
			got, err := CrossEntropyRows(0, lse, x, tg, v)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			if d := math.Abs(got - want); d > 1e-12*wantMag+1e-300 {
				t.Errorf("%s: loss %.17g, want %.17g", name, got, want)
			}
			dx := make([]float32, len(x))
			if err := CrossEntropyRowsBackward(0, dx, x, tg, lse, v, scale); err != nil {
				t.Fatalf("%s: backward: %v", name, err)
			}
			rb, mb := make([]float64, len(x)), make([]float64, len(x))
			for r := range rows {
				for j := range v {
					p := math.Exp(float64(x[r*v+j]) - lref[r])
					if int64(j) == tg[r] {
						p--
					}
					rb[r*v+j], mb[r*v+j] = scale*p, math.Abs(scale*p)
				}
			}
			check(t, name+"_backward", dx, rb, mb, 2*ulp32)
			// In place (dx aliasing the logits) gives the same values.
			z := slices.Clone(x)
			if err := CrossEntropyRowsBackward(0, z, z, tg, lse, v, scale); err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(z, dx) {
				t.Errorf("%s: in place differs from out of place", name)
			}
		}
	}
}

func TestColumnSums(t *testing.T) {
	rng := rand.New(rand.NewPCG(6, 1))
	for _, sh := range rowShapes {
		rows, n := sh[0], sh[1]
		x := randRows(rng, rows*n, 1)
		ref, mag := make([]float64, n), make([]float64, n)
		for i, v := range x {
			ref[i%n] += float64(v)
			mag[i%n] += math.Abs(float64(v))
		}
		out := make([]float32, n)
		if err := ColumnSums(out, x, n); err != nil {
			t.Fatal(err)
		}
		check(t, fmt.Sprintf("rows%d_n%d", rows, n), out, ref, mag, 2*ulp32)
	}
}

// TestRowKernelErrors checks that bad lengths are errors, not panics, and
// leave the outputs alone.
func TestRowKernelErrors(t *testing.T) {
	x := []float32{1, 2, 3, 4, 5, 6}
	out := make([]float32, 6)
	f64 := make([]float64, 2)
	cases := []struct {
		name string
		err  error
	}{
		{"softmax not whole rows", SoftmaxRows(0, out, x, 4)},
		{"softmax negative n", SoftmaxRows(0, out, x, -1)},
		{"softmax width 0", SoftmaxRows(0, out, x, 0)},
		{"softmax short dst", SoftmaxRows(0, out[:3], x, 3)},
		{"softmax backward short dy", SoftmaxRowsBackward(out, x, x[:3], 3)},
		{"log-softmax backward short dx", LogSoftmaxRowsBackward(0, out[:1], x, x, 3)},
		{"causal not square blocks", CausalSoftmax(0, out, x, 2, 1)},
		{"causal negative t", CausalSoftmax(0, out, x, -2, 1)},
		{"causal backward short", CausalSoftmaxBackward(out[:4], x[:4], x, 2, 1)},
		{"layernorm short w", LayerNorm(out, nil, nil, x, x[:2], nil, 3, 1e-5)},
		{"layernorm mean without rstd", LayerNorm(out, f64, nil, x, nil, nil, 3, 1e-5)},
		{"layernorm negative eps", LayerNorm(out, nil, nil, x, nil, nil, 3, -1)},
		{"layernorm backward no stats", LayerNormBackward(out, nil, nil, x, x, nil, nil, nil, 3)},
		{"layernorm backward short dw", LayerNormBackward(out, out[:2], nil, x, x, nil, f64, f64, 3)},
		{"gelu short deriv", BiasGELU(0, out, out[:2], x, nil, 3)},
		{"gelu short bias", BiasGELU(0, out, nil, x, x[:2], 3)},
		{"gelu backward short dx", BiasGELUBackward(out[:2], nil, x, x, 3)},
		{"column sums short out", ColumnSums(out[:2], x, 3)},
		{"ce target out of range", func() error { _, err := CrossEntropyRows(0, nil, x, []int64{0, 3}, 3); return err }()},
		{"ce negative target", func() error { _, err := CrossEntropyRows(0, nil, x, []int64{-1, 0}, 3); return err }()},
		{"ce target count", func() error { _, err := CrossEntropyRows(0, nil, x, []int64{0}, 3); return err }()},
		{"ce backward short lse", CrossEntropyRowsBackward(0, out, x, []int64{0, 1}, f64[:1], 3, 1)},
	}
	for _, c := range cases {
		if c.err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
	for i, v := range out {
		if v != 0 {
			t.Fatalf("out[%d] = %g after failing calls; want it untouched", i, v)
		}
	}
}

// TestVectorPrimitives compares the assembly paths with the portable ones
// (and both with float64) on every length around the vector width, on
// special values, and on the full float32 range of the GELU argument.
func TestVectorPrimitives(t *testing.T) {
	t.Logf("vector kernels in use: %v", haveVec)
	rng := rand.New(rand.NewPCG(7, 1))
	for n := range 40 {
		x := randRows(rng, n, 30)
		if n > 0 {
			if got, want := maxOf(x), maxGo(x); got != want {
				t.Errorf("max of %d: %g, want %g", n, got, want)
			}
		}
		shift := float64(maxGo(append([]float32{-1e30}, x...)))
		e1, e2 := make([]float32, n), make([]float32, n)
		s1, s2 := expShift(e1, x, shift), expShiftGo(e2, x, shift)
		ref, mag := make([]float64, n), make([]float64, n)
		for i, v := range x {
			ref[i] = math.Exp(float64(v) - shift)
			mag[i] = ref[i]
		}
		check(t, fmt.Sprintf("exp_n%d", n), e1, ref, mag, ulp32)
		check(t, fmt.Sprintf("expGo_n%d", n), e2, ref, mag, ulp32)
		if math.Abs(s1-s2) > 1e-13*s2 || expShift(nil, x, shift) != s1 {
			t.Errorf("exp sums of %d: %g, %g (no store: %g)", n, s1, s2, expShift(nil, x, shift))
		}
	}
	// Special values: NaN propagates, −Inf and huge negative give 0.
	sp := []float32{float32(math.NaN()), float32(math.Inf(-1)), -1e30, -745, -100, 0, 1e-30, 88}
	e := make([]float32, len(sp))
	s := expShift(e, sp, 0)
	if !math.IsNaN(float64(e[0])) || !math.IsNaN(s) {
		t.Errorf("exp(NaN) = %g, sum %g; want NaN", e[0], s)
	}
	for i, want := range []float32{0, 0, 0, float32(math.Exp(-100)), 1, 1, float32(math.Exp(88))} {
		if got := e[i+1]; math.Abs(float64(got-want)) > float64(want)*ulp32 {
			t.Errorf("exp(%g) = %g, want %g", sp[i+1], got, want)
		}
	}
	// GELU over the whole useful range and past it, in place and not.
	x := make([]float32, 0, 20000)
	for i := range 20000 {
		x = append(x, float32(-20+40*float64(i)/20000))
	}
	x = append(x, float32(math.NaN()), -1e30, 1e30, 0, float32(math.Copysign(0, -1)), 1e-30, -1e-30)
	y, d := make([]float32, len(x)), make([]float32, len(x))
	gelu(y, d, x)
	yg, dg := make([]float32, len(x)), make([]float32, len(x))
	geluGo(yg, dg, x)
	ref, mag := make([]float64, len(x)), make([]float64, len(x))
	rd, md := make([]float64, len(x)), make([]float64, len(x))
	for i, v := range x {
		f := float64(v)
		phi := 0.5 * math.Erfc(-f/math.Sqrt2)
		pdf := math.Exp(-f*f/2) / math.Sqrt(2*math.Pi)
		ref[i], mag[i] = f*phi, math.Abs(f*phi)
		rd[i], md[i] = phi+f*pdf, phi+math.Abs(f*pdf)
		if math.IsInf(f*pdf, 0) || math.IsNaN(f*pdf) {
			rd[i], md[i] = phi, phi
		}
	}
	check(t, "gelu", y, ref, mag, 2*ulp32)
	check(t, "geluGo", yg, ref, mag, 2*ulp32)
	check(t, "gelu_deriv", d, rd, md, 2*ulp32)
	check(t, "geluGo_deriv", dg, rd, md, 2*ulp32)
	z := slices.Clone(x)
	gelu(z, nil, z)
	for i := range z {
		if z[i] != y[i] && !(math.IsNaN(float64(z[i])) && math.IsNaN(float64(y[i]))) {
			t.Fatalf("in-place gelu(%g) = %g, out of place %g", x[i], z[i], y[i])
		}
	}
}

func TestAddMul(t *testing.T) {
	rng := rand.New(rand.NewPCG(10, 1))
	for _, n := range []int{0, 1, 3, 7, 8, 9, 15, 16, 17, 1000} {
		a, b := randRows(rng, n, 3), randRows(rng, n, 3)
		sum, prod := make([]float32, n), make([]float32, n)
		if err := Add(sum, a, b); err != nil {
			t.Fatal(err)
		}
		if err := Mul(prod, a, b); err != nil {
			t.Fatal(err)
		}
		for i := range a {
			// One float32 operation each: exactly the rounded result.
			if sum[i] != float32(float64(a[i])+float64(b[i])) || prod[i] != float32(float64(a[i])*float64(b[i])) {
				t.Fatalf("n=%d [%d]: %g+%g = %g, %g·%g = %g", n, i, a[i], b[i], sum[i], a[i], b[i], prod[i])
			}
		}
		// In place.
		c := slices.Clone(a)
		if err := Add(c, c, b); err != nil || !slices.Equal(c, sum) {
			t.Fatalf("n=%d: in-place Add differs (%v)", n, err)
		}
		c = slices.Clone(a)
		if err := Mul(c, b, c); err != nil || !slices.Equal(c, prod) {
			t.Fatalf("n=%d: in-place Mul differs (%v)", n, err)
		}
	}
	if Add(make([]float32, 2), make([]float32, 3), make([]float32, 2)) == nil || Mul(make([]float32, 2), make([]float32, 2), nil) == nil {
		t.Error("length mismatch accepted")
	}
}

// ExpShift against float64 exp: every length around the vector width,
// with and without a destination, and a short destination rejected.
func TestExpShift(t *testing.T) {
	for _, n := range []int{0, 1, 3, 4, 5, 8, 17, 131} {
		src := make([]float32, n)
		for i := range src {
			src[i] = float32(i%7) - 3.5
		}
		const shift = 1.25
		var want float64
		for _, v := range src {
			want += math.Exp(float64(v) - shift)
		}
		dst := make([]float32, n)
		got, err := ExpShift(dst, src, shift)
		if err != nil || math.Abs(got-want) > 1e-12*math.Max(1, want) {
			t.Errorf("n=%d: sum %v, %v; want %v", n, got, err, want)
		}
		for i, v := range src {
			if e := math.Exp(float64(v) - shift); math.Abs(float64(dst[i])-e) > 1e-7*e {
				t.Errorf("n=%d: dst[%d] = %v, want %v", n, i, dst[i], e)
			}
		}
		if got2, err := ExpShift(nil, src, shift); err != nil || got2 != got {
			t.Errorf("n=%d: sum only %v, %v; want %v", n, got2, err, got)
		}
	}
	if _, err := ExpShift(make([]float32, 2), make([]float32, 3), 0); err == nil {
		t.Error("short dst accepted")
	}
}

// TestWorkersBoundTheSplit checks that forRows and permForRows split into
// w ranges (GOMAXPROCS for w <= 0) when every row is worth a goroutine,
// covering every row once.
func TestWorkersBoundTheSplit(t *testing.T) {
	const rows = 64
	splits := map[string]func(w Workers, f func(lo, hi int)){
		"forRows":     func(w Workers, f func(lo, hi int)) { forRows(w, rows, rowsMinPerWorker, f) },
		"permForRows": func(w Workers, f func(lo, hi int)) { permForRows(w, rows, permMinBytesPerWorker, f) },
	}
	for name, split := range splits {
		for _, w := range []Workers{-1, 0, 1, 2, 3, 7} {
			checkSplit(t, name, w, rows, split)
		}
	}
}

func checkSplit(t *testing.T, name string, w Workers, rows int, split func(w Workers, f func(lo, hi int))) {
	t.Helper()
	var mu sync.Mutex
	calls, seen := 0, make([]int, rows)
	split(w, func(lo, hi int) {
		mu.Lock()
		defer mu.Unlock()
		calls++
		for r := lo; r < hi; r++ {
			seen[r]++
		}
	})
	if want := w.Count(); calls != want {
		t.Errorf("%s, Workers(%d): %d ranges, want %d", name, w, calls, want)
	}
	for r, c := range seen {
		if c != 1 {
			t.Fatalf("%s, Workers(%d): row %d covered %d times", name, w, r, c)
		}
	}
}

// TestWorkersGiveTheSameBits runs every kernel that splits its rows with
// 1, 2, 3 and 7 workers on a block large enough to split, and requires the
// same bits each time.
func TestWorkersGiveTheSameBits(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	const rows, n, tt = 600, 256, 16
	x := randRows(rng, rows*n, 8)
	dy := randRows(rng, rows*n, 1)
	bias := randRows(rng, n, 1)
	targets := make([]int64, rows)
	for i := range targets {
		targets[i] = int64(rng.IntN(n))
	}
	batch, dh := rows*n/(tt*tt), 8
	q, k, v := randRows(rng, batch*tt*dh, 1), randRows(rng, batch*tt*dh, 1), randRows(rng, batch*tt*dh, 1)
	run := func(w Workers) [][]float32 {
		var out [][]float32
		add := func(b []float32, err error) {
			if err != nil {
				t.Fatalf("Workers(%d): %v", w, err)
			}
			out = append(out, b)
		}
		y := make([]float32, len(x))
		add(y, SoftmaxRows(w, y, x, n))
		y = make([]float32, len(x))
		add(y, LogSoftmaxRows(w, y, x, n))
		dx := make([]float32, len(x))
		add(dx, LogSoftmaxRowsBackward(w, dx, y, dy, n))
		y = make([]float32, len(x))
		add(y, CausalSoftmax(w, y, x, tt, 0.5))
		y, d := make([]float32, len(x)), make([]float32, len(x))
		add(y, BiasGELU(w, y, d, x, bias, n))
		add(d, nil)
		lse := make([]float64, rows)
		total, err := CrossEntropyRows(w, lse, x, targets, n)
		add([]float32{float32(total)}, err)
		dx = make([]float32, len(x))
		add(dx, CrossEntropyRowsBackward(w, dx, x, targets, lse, n, 0.25))
		o, p := make([]float32, len(v)), make([]float32, batch*tt*tt)
		add(o, CausalAttentionForward(w, o, p, q, k, v, batch, tt, dh, dh, 0.3))
		dq, dk, dv := make([]float32, len(q)), make([]float32, len(k)), make([]float32, len(v))
		add(dq, CausalAttentionBackward(w, dq, dk, dv, o, p, q, k, v, batch, tt, dh, dh, 0.3))
		return append(out, dk, dv)
	}
	ref := run(1)
	for _, w := range []Workers{2, 3, 7} {
		for i, b := range run(w) {
			if !slices.Equal(b, ref[i]) {
				t.Errorf("Workers(%d): output %d differs from one worker's", w, i)
			}
		}
	}
}

// TestLayerNormBackwardEmpty: an empty block (a rank's empty shard, whose
// forward saved no statistics) needs no mean and rstd and zeroes dw and
// db; a block with rows still needs them.
func TestLayerNormBackwardEmpty(t *testing.T) {
	for _, tc := range []struct {
		rows    int
		wantErr bool
	}{{0, false}, {2, true}} {
		const n = 4
		x, dy, dx := make([]float32, tc.rows*n), make([]float32, tc.rows*n), make([]float32, tc.rows*n)
		w, dw, db := []float32{1, 2, 3, 4}, []float32{5, 5, 5, 5}, []float32{6, 6, 6, 6}
		err := LayerNormBackward(dx, dw, db, dy, x, w, nil, nil, n)
		if gotErr := err != nil; gotErr != tc.wantErr {
			t.Fatalf("rows %d: error %v, want an error: %v", tc.rows, err, tc.wantErr)
		}
		if tc.wantErr {
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("rows %d: error %v does not wrap ErrInvalid", tc.rows, err)
			}
			continue
		}
		for j := range n {
			if dw[j] != 0 || db[j] != 0 {
				t.Fatalf("rows %d: dw %v db %v, want zeros", tc.rows, dw, db)
			}
		}
	}
}
