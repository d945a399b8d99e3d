package kernels

import (
	"fmt"
	"math"
)

// Float64-computed forms of the fused float32 row kernels: GELU, softmax
// over any dim, causal softmax, cross-entropy and LayerNorm. autograd runs
// them on float64 tensors, and on float32 layouts the float32 kernels do
// not take (a softmax over an inner dim). Each computes every
// intermediate in float64, in a fixed order, and rounds once to T; what a
// backward needs is saved in float64 by the forward. They run on one
// goroutine except GELU64 (elementwise, so the split cannot change a
// result).

// GELU64 sets y[i] = 0.5·x·(1 + erf(x/√2)) and erfs[i] = erf(x[i]/√2),
// which GELU64Backward reuses (erf is most of the cost). y and erfs have
// len(x) elements.
func GELU64[T Float](w Workers, y []T, erfs []float64, x []T) error {
	const op = "GELU64"
	if len(y) != len(x) || len(erfs) != len(x) {
		return fmt.Errorf("kernels: %s: %w: y %d and erfs %d elements for %d inputs", op, ErrInvalid, len(y), len(erfs), len(x))
	}
	forRows(w, len(x), 1, func(lo, hi int) {
		for i, v := range x[lo:hi] {
			f := float64(v)
			e := math.Erf(f / math.Sqrt2)
			erfs[lo+i] = e
			y[lo+i] = T(0.5 * f * (1 + e))
		}
	})
	return nil
}

// GELU64Backward sets dx[i] = g[i]·GELU'(x[i]), GELU'(x) = Φ(x) + x·φ(x)
// with Φ(x) = 0.5·(1 + erfs[i]) from GELU64. All four have len(x)
// elements; dx may alias g.
func GELU64Backward[T Float](w Workers, dx, x []T, erfs []float64, g []T) error {
	const op = "GELU64Backward"
	if len(dx) != len(x) || len(erfs) != len(x) || len(g) != len(x) {
		return fmt.Errorf("kernels: %s: %w: dx %d, erfs %d and g %d elements for %d inputs", op, ErrInvalid, len(dx), len(erfs), len(g), len(x))
	}
	c := 1 / math.Sqrt(2*math.Pi)
	forRows(w, len(x), 1, func(lo, hi int) {
		for i, v := range x[lo:hi] {
			f := float64(v)
			d := 0.5*(1+erfs[lo+i]) + f*c*math.Exp(-0.5*f*f)
			dx[lo+i] = T(float64(g[lo+i]) * d)
		}
	})
	return nil
}

// Softmax64 sets dst to the softmax (logOut: the log-softmax) of x, an
// [outer, n, inner] row-major array, over its middle dim, subtracting the
// maximum before exp. dst has len(x) elements and must not overlap x.
func Softmax64[T Float](dst, x []T, outer, n, inner int, logOut bool) error {
	const op = "Softmax64"
	l, err := size(op, outer, n, inner)
	if err != nil {
		return err
	}
	if len(x) != l || len(dst) != l {
		return fmt.Errorf("kernels: %s: %w: dst %d and x %d elements for [%d, %d, %d]", op, ErrInvalid, len(dst), len(x), outer, n, inner)
	}
	for o := range outer {
		for in := range inner {
			base := o*n*inner + in
			m := math.Inf(-1)
			for k := range n {
				m = max(m, float64(x[base+k*inner]))
			}
			s := 0.0
			for k := range n {
				s += math.Exp(float64(x[base+k*inner]) - m)
			}
			lse := m + math.Log(s)
			for k := range n {
				i := base + k*inner
				if logOut {
					dst[i] = T(float64(x[i]) - lse)
				} else {
					dst[i] = T(math.Exp(float64(x[i]) - lse))
				}
			}
		}
	}
	return nil
}

// Softmax64Backward maps the gradient g of y = Softmax64(x) (logOut: of
// the log-softmax) over the middle dim of [outer, n, inner] to the
// gradient of x: y⊙(g − Σ g⊙y), or g − exp(y)·Σ g. dx, y and g have the
// same length; dx must not overlap them.
func Softmax64Backward[T Float](dx, y, g []T, outer, n, inner int, logOut bool) error {
	const op = "Softmax64Backward"
	l, err := size(op, outer, n, inner)
	if err != nil {
		return err
	}
	if len(y) != l || len(g) != l || len(dx) != l {
		return fmt.Errorf("kernels: %s: %w: dx %d, y %d and g %d elements for [%d, %d, %d]", op, ErrInvalid, len(dx), len(y), len(g), outer, n, inner)
	}
	for o := range outer {
		for in := range inner {
			base := o*n*inner + in
			s := 0.0
			for k := range n {
				i := base + k*inner
				if logOut {
					s += float64(g[i])
				} else {
					s += float64(g[i]) * float64(y[i])
				}
			}
			for k := range n {
				i := base + k*inner
				if logOut {
					dx[i] = T(float64(g[i]) - math.Exp(float64(y[i]))*s)
				} else {
					dx[i] = T(float64(y[i]) * (float64(g[i]) - s))
				}
			}
		}
	}
	return nil
}

// CausalSoftmax64 is the causal (lower-triangular) row softmax of
// consecutive t×t blocks of x: row i of a block is the softmax of its
// entries 0 … i, and its entries past i are 0. dst has len(x) elements,
// a whole number of blocks.
func CausalSoftmax64[T Float](dst, x []T, t int) error {
	const op = "CausalSoftmax64"
	if _, err := causalBlocks(op, len(x), t); err != nil {
		return err
	}
	if len(dst) != len(x) {
		return fmt.Errorf("kernels: %s: %w: dst has %d elements for %d inputs", op, ErrInvalid, len(dst), len(x))
	}
	for base := 0; base < len(x); base += t * t {
		for i := range t {
			row := x[base+i*t : base+(i+1)*t]
			m := math.Inf(-1)
			for j := 0; j <= i; j++ {
				m = max(m, float64(row[j]))
			}
			s := 0.0
			for j := 0; j <= i; j++ {
				s += math.Exp(float64(row[j]) - m)
			}
			out := dst[base+i*t : base+(i+1)*t]
			for j := 0; j <= i; j++ {
				out[j] = T(math.Exp(float64(row[j])-m) / s)
			}
			clear(out[i+1:])
		}
	}
	return nil
}

// targetCheck validates rows of v logits and one target class in [0, v)
// per row.
func targetCheck[T Float](op string, logits []T, targets []int64, v int) error {
	rows, err := rowCount(op, len(logits), v)
	if err != nil {
		return err
	}
	if rows != len(targets) {
		return fmt.Errorf("kernels: %s: %w: %d rows of logits for %d targets", op, ErrInvalid, rows, len(targets))
	}
	for r, tg := range targets {
		if tg < 0 || tg >= int64(v) {
			return fmt.Errorf("kernels: %s: %w: target %d of row %d is outside [0, %d)", op, ErrInvalid, tg, r, v)
		}
	}
	return nil
}

// CrossEntropy64 returns Σ_r (logsumexp(x_r) − x_r[targets[r]]) over the
// rows x_r of logits (rows of v values), in float64, and sets sm to the
// softmax of every row (len(logits) values) for CrossEntropy64Backward.
func CrossEntropy64[T Float](sm []float64, logits []T, targets []int64, v int) (float64, error) {
	const op = "CrossEntropy64"
	if err := targetCheck(op, logits, targets, v); err != nil {
		return 0, err
	}
	if len(sm) != len(logits) {
		return 0, fmt.Errorf("kernels: %s: %w: sm has %d elements for %d logits", op, ErrInvalid, len(sm), len(logits))
	}
	total := 0.0
	for r, tr := range targets {
		row := logits[r*v : (r+1)*v]
		m := math.Inf(-1)
		for _, e := range row {
			m = max(m, float64(e))
		}
		s := 0.0
		for _, e := range row {
			s += math.Exp(float64(e) - m)
		}
		lse := m + math.Log(s)
		for k, e := range row {
			sm[r*v+k] = math.Exp(float64(e) - lse)
		}
		total += lse - float64(row[tr])
	}
	return total, nil
}

// CrossEntropy64Backward sets dx = scale·(softmax − onehot(targets)) from
// the softmax sm that CrossEntropy64 saved (rows of v values); scale is
// the loss's gradient over the row count for a mean.
func CrossEntropy64Backward[T Float](dx []T, sm []float64, targets []int64, v int, scale float64) error {
	const op = "CrossEntropy64Backward"
	if err := targetCheck(op, sm, targets, v); err != nil {
		return err
	}
	if len(dx) != len(sm) {
		return fmt.Errorf("kernels: %s: %w: dx has %d elements for %d", op, ErrInvalid, len(dx), len(sm))
	}
	for r, tr := range targets {
		for k := range v {
			p := sm[r*v+k]
			if int64(k) == tr {
				p--
			}
			dx[r*v+k] = T(scale * p)
		}
	}
	return nil
}

// LayerNorm64 normalises the rows of x (rows of n values): x̂ = (x − μ)·rs
// with μ the mean, rs = 1/sqrt(σ² + eps) and σ² the biased variance, and
// y = x̂·w + b (w and b have n values). It saves x̂ (len(x) values) and rs
// per row for LayerNorm64Backward. eps must not be negative.
func LayerNorm64[T Float](y []T, xhat, rstd []float64, x, w, b []T, n int, eps float64) error {
	const op = "LayerNorm64"
	rows, err := rowCount(op, len(x), n)
	if err != nil {
		return err
	}
	if len(y) != len(x) || len(xhat) != len(x) || len(rstd) != rows || len(w) != n || len(b) != n {
		return fmt.Errorf("kernels: %s: %w: y %d, xhat %d, rstd %d, w %d and b %d elements for %d rows of %d", op, ErrInvalid, len(y), len(xhat), len(rstd), len(w), len(b), rows, n)
	}
	if !(eps >= 0) { // LayerNorm's rule
		return fmt.Errorf("kernels: %s: %w: eps %v must be non-negative", op, ErrInvalid, eps)
	}
	for r := range rows {
		row := x[r*n : (r+1)*n]
		mu := 0.0
		for _, v := range row {
			mu += float64(v)
		}
		mu /= float64(n)
		v2 := 0.0
		for _, v := range row {
			d := float64(v) - mu
			v2 += d * d
		}
		v2 /= float64(n)
		rs := 1 / math.Sqrt(v2+eps)
		rstd[r] = rs
		for k, v := range row {
			h := (float64(v) - mu) * rs
			xhat[r*n+k] = h
			y[r*n+k] = T(h*float64(w[k]) + float64(b[k]))
		}
	}
	return nil
}

// LayerNorm64Backward maps the gradient g of LayerNorm64's y to dx (len(g)
// values), dw and db (n values each; sums over rows in float64, rounded
// once), from its saved xhat and rstd; a nil dx, dw or db is not
// computed.
func LayerNorm64Backward[T Float](dx, dw, db, g, w []T, xhat, rstd []float64, n int) error {
	const op = "LayerNorm64Backward"
	rows, err := rowCount(op, len(g), n)
	if err != nil {
		return err
	}
	if len(xhat) != len(g) || len(rstd) != rows || len(w) != n ||
		(dx != nil && len(dx) != len(g)) || (dw != nil && len(dw) != n) || (db != nil && len(db) != n) {
		return fmt.Errorf("kernels: %s: %w: dx %d, dw %d, db %d, w %d, xhat %d and rstd %d elements for %d rows of %d", op, ErrInvalid, len(dx), len(dw), len(db), len(w), len(xhat), len(rstd), rows, n)
	}
	needX, needW, needB := dx != nil, dw != nil, db != nil
	var dwa, dba []float64
	if needW {
		dwa = make([]float64, n)
	}
	if needB {
		dba = make([]float64, n)
	}
	for r := range rows {
		gr := g[r*n : (r+1)*n]
		hr := xhat[r*n : (r+1)*n]
		if needW || needB {
			for k := range n {
				if needW {
					dwa[k] += float64(gr[k]) * hr[k]
				}
				if needB {
					dba[k] += float64(gr[k])
				}
			}
		}
		if !needX {
			continue
		}
		m1, m2 := 0.0, 0.0
		for k := range n {
			dh := float64(gr[k]) * float64(w[k])
			m1 += dh
			m2 += dh * hr[k]
		}
		m1 /= float64(n)
		m2 /= float64(n)
		for k := range n {
			dh := float64(gr[k]) * float64(w[k])
			dx[r*n+k] = T(rstd[r] * (dh - m1 - hr[k]*m2))
		}
	}
	for k := range dwa {
		dw[k] = T(dwa[k])
	}
	for k := range dba {
		db[k] = T(dba[k])
	}
	return nil
}
