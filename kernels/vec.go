package kernels

import (
	"fmt"
	"math"
)

// Vector primitives of the row kernels. Each runs on the AVX2+FMA
// assembly of vec_amd64.s where the CPU has it, and on the portable loops
// below otherwise and for the last few elements (fewer than one vector).
// Both compute transcendentals in float64 and round once to float32, so
// they agree to within float32 rounding.

// expShift sets dst[i] = exp(src[i] − shift) for every i (dst nil: nothing
// is stored; otherwise len(dst) >= len(src)) and returns the sum of the
// unrounded values.
func expShift(dst, src []float32, shift float64) float64 {
	n := len(src)
	s, i := 0.0, 0
	if haveVec && n >= 4 {
		i = n &^ 3
		if dst != nil {
			s = expShiftStoreAVX2(&dst[0], &src[0], i, shift)
		} else {
			s = expShiftSumAVX2(&src[0], i, shift)
		}
	}
	if dst != nil {
		return s + expShiftGo(dst[i:n], src[i:], shift)
	}
	return s + expShiftGo(nil, src[i:], shift)
}

// expShiftGo is the portable expShift.
func expShiftGo(dst, src []float32, shift float64) float64 {
	s := 0.0
	for i, v := range src {
		e := math.Exp(float64(v) - shift)
		if dst != nil {
			dst[i] = float32(e)
		}
		s += e
	}
	return s
}

// maxOf returns the largest element of a non-empty x. NaN elements may be
// skipped; a row holding NaN yields NaN through exp anyway.
func maxOf(x []float32) float32 {
	if haveVec && len(x) >= 8 {
		n := len(x) &^ 7
		m := maxAVX2(&x[0], n)
		for _, v := range x[n:] {
			if v > m {
				m = v
			}
		}
		return m
	}
	return maxGo(x)
}

// maxGo is the portable maxOf.
func maxGo(x []float32) float32 {
	m := x[0]
	for _, v := range x[1:] {
		if v > m {
			m = v
		}
	}
	return m
}

// gelu sets y[i] = GELU(x[i]) = x·Φ(x) and, when d is not nil,
// d[i] = GELU'(x[i]) = Φ(x) + x·φ(x), with Φ and φ the standard normal
// distribution and density. y and d may alias x; both must be at least as
// long as x.
func gelu(y, d, x []float32) {
	i := 0
	if haveVec && len(x) >= 4 {
		i = len(x) &^ 3
		var dp *float32
		if d != nil {
			dp = &d[0]
		}
		geluAVX2(&y[0], dp, &x[0], i)
	}
	if d != nil {
		geluGo(y[i:len(x)], d[i:len(x)], x[i:])
		return
	}
	geluGo(y[i:len(x)], nil, x[i:])
}

// geluGo is the portable gelu, on math.Erfc and math.Exp: Φ(x) =
// erfc(−x/√2)/2 keeps its relative accuracy for negative x.
func geluGo(y, d, x []float32) {
	const invSqrt2Pi = 0.39894228040143267794
	for i, v := range x {
		f := float64(v)
		phi := 0.5 * math.Erfc(-f/math.Sqrt2)
		y[i] = float32(f * phi)
		if d != nil {
			d[i] = float32(phi + f*invSqrt2Pi*math.Exp(-0.5*f*f))
		}
	}
}

// addF32 sets dst[i] = a[i] + b[i] for i < len(a); dst and b are at least
// as long as a and may alias it.
func addF32(dst, a, b []float32) {
	i := 0
	if haveVec && len(a) >= 8 {
		i = len(a) &^ 7
		addF32AVX2(&dst[0], &a[0], &b[0], i)
	}
	for ; i < len(a); i++ {
		dst[i] = a[i] + b[i]
	}
}

// mulF32 sets dst[i] = a[i]·b[i] for i < len(a).
func mulF32(dst, a, b []float32) {
	i := 0
	if haveVec && len(a) >= 8 {
		i = len(a) &^ 7
		mulF32AVX2(&dst[0], &a[0], &b[0], i)
	}
	for ; i < len(a); i++ {
		dst[i] = a[i] * b[i]
	}
}

// colSums64 adds the column sums of x (rows of n = len(acc) values) to
// acc, in float64.
func colSums64(acc []float64, x []float32) {
	n := len(acc)
	if n == 0 {
		return
	}
	rows := len(x) / n
	j0 := 0
	if haveVec && n >= 4 && rows > 0 {
		j0 = n &^ 3
		if j0 == n {
			colSumAVX2(&acc[0], &x[0], rows, n)
			return
		}
		for r := range rows {
			colSumAVX2(&acc[0], &x[r*n], 1, j0)
		}
	}
	for r := range rows {
		row := x[r*n : (r+1)*n]
		for j := j0; j < n; j++ {
			acc[j] += float64(row[j])
		}
	}
}

// lnStats returns Σ (x − k) and Σ (x − k)² in float64.
func lnStats(x []float32, k float64) (s1, s2 float64) {
	i := 0
	if haveVec && len(x) >= 4 {
		i = len(x) &^ 3
		s1, s2 = lnStatsAVX2(&x[0], i, k)
	}
	for _, v := range x[i:] {
		d := float64(v) - k
		s1 += d
		s2 += d * d
	}
	return s1, s2
}

// lnAffine sets y = (x·a + c)·w + b, computed in float64; w and b have
// len(x) values.
func lnAffine(y, x, w, b []float32, a, c float64) {
	i := 0
	if haveVec && len(x) >= 4 {
		i = len(x) &^ 3
		lnAffineAVX2(&y[0], &x[0], &w[0], &b[0], i, a, c)
	}
	for ; i < len(x); i++ {
		y[i] = float32((float64(x[i])*a+c)*float64(w[i]) + float64(b[i]))
	}
}

// lnBackRow accumulates dwa += g·x̂ and dba += g (nil: skipped) with x̂ =
// (x − mu)·rs, and returns Σ g·w and Σ g·w·x̂, for one row.
func lnBackRow(dwa, dba []float64, g, x, w []float32, mu, rs float64) (m1, m2 float64) {
	i := 0
	if haveVec && len(x) >= 4 {
		i = len(x) &^ 3
		var pw, pb *float64
		if dwa != nil {
			pw = &dwa[0]
		}
		if dba != nil {
			pb = &dba[0]
		}
		m1, m2 = lnBackAVX2(pw, pb, &g[0], &x[0], &w[0], i, mu, rs)
	}
	for ; i < len(x); i++ {
		gv := float64(g[i])
		xh := (float64(x[i]) - mu) * rs
		if dwa != nil {
			dwa[i] += gv * xh
		}
		if dba != nil {
			dba[i] += gv
		}
		h := gv * float64(w[i])
		m1 += h
		m2 += h * xh
	}
	return m1, m2
}

// lnDxRow sets dx = rs·(g·w − m1 − x̂·m2) with x̂ = (x − mu)·rs for one
// row; dx may alias g.
func lnDxRow(dx, g, x, w []float32, mu, rs, m1, m2 float64) {
	i := 0
	if haveVec && len(x) >= 4 {
		i = len(x) &^ 3
		lnDxAVX2(&dx[0], &g[0], &x[0], &w[0], i, mu, rs, m1, m2)
	}
	for ; i < len(x); i++ {
		xh := (float64(x[i]) - mu) * rs
		dx[i] = float32(rs * (float64(g[i])*float64(w[i]) - m1 - xh*m2))
	}
}

// dot returns Σ a[i]·b[i] over i < len(a), in float64.
func dot(a, b []float32) float64 {
	s, i := 0.0, 0
	if haveVec && len(a) >= 4 {
		i = len(a) &^ 3
		s = dotAVX2(&a[0], &b[0], i)
	}
	for ; i < len(a); i++ {
		s += float64(a[i]) * float64(b[i])
	}
	return s
}

// softBack sets dx = scale·y·(dy − s) over i < len(y), in float64; dx may
// alias dy.
func softBack(dx, y, dy []float32, s, scale float64) {
	i := 0
	if haveVec && len(y) >= 4 {
		i = len(y) &^ 3
		softBackAVX2(&dx[0], &y[0], &dy[0], i, s, scale)
	}
	for ; i < len(y); i++ {
		dx[i] = float32(scale * float64(y[i]) * (float64(dy[i]) - s))
	}
}

// ExpShift sets dst[i] = exp(src[i] − shift) for every i of src, computed
// in float64 and rounded once to float32, and returns the sum of the
// unrounded values (a softmax denominator for shift = the row's max). dst
// may be nil (only the sum); otherwise it needs len(src) elements.
func ExpShift(dst, src []float32, shift float64) (float64, error) {
	if dst != nil && len(dst) < len(src) {
		return 0, fmt.Errorf("kernels: ExpShift: %w: dst has %d elements for %d inputs", ErrInvalid, len(dst), len(src))
	}
	return expShift(dst, src, shift), nil
}
