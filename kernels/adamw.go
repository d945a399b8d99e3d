package kernels

import (
	"fmt"
	"math"
)

// AdamW applies one AdamW update in place to parameters p with gradient g
// and moments m and v (all of one length), in T's precision, in the order
// of PyTorch's float32 kernel (reference/TINY_GPT.md §4):
//
//	p   = p·c[0]                      (decoupled decay: 1 − lr·wd)
//	m   = m·c[1] + c[2]·g             (β1, 1 − β1)
//	v   = v·c[3] + (c[4]·g)·g         (β2, 1 − β2)
//	den = sqrt(v)/c[5] + c[7]         (sqrt(1 − β2^t), ε)
//	p   = p + (c[6]·m)/den            (−lr / (1 − β1^t))
//
// Every intermediate is rounded to T and nothing is fused, so the vector
// path (float32 on AVX2: eight lanes of the same IEEE operations) and the
// portable loop agree bit for bit. It returns an error, before writing
// anything, when the lengths differ or c is nil.
func AdamW[T Float](p, g, m, v []T, c *[8]T) error {
	n := len(p)
	if len(g) != n || len(m) != n || len(v) != n {
		return fmt.Errorf("kernels: AdamW: %w: lengths p %d, g %d, m %d, v %d differ", ErrInvalid, n, len(g), len(m), len(v))
	}
	if c == nil {
		return fmt.Errorf("kernels: AdamW: %w: nil coefficients", ErrInvalid)
	}
	i := 0
	if p32, ok := any(p).([]float32); ok && haveVec && n >= 8 {
		i = n &^ 7
		c32 := any(c).(*[8]float32)
		adamwAVX2(&p32[0], &any(g).([]float32)[0], &any(m).([]float32)[0], &any(v).([]float32)[0], i, c32)
	}
	adamwGo(p[i:], g[i:n], m[i:n], v[i:n], c)
	return nil
}

// adamwGo is AdamW's portable loop; explicit conversions keep the compiler
// from fusing multiply-adds.
func adamwGo[T Float](p, g, m, v []T, c *[8]T) {
	cwd, b1, c1, b2, c2, cbc2, cstep, eps := c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
	for i := range p {
		pi := T(p[i] * cwd)
		gi := g[i]
		mi := T(m[i]*b1) + T(c1*gi)
		vi := T(v[i]*b2) + T(T(c2*gi)*gi)
		den := T(T(sqrt(vi))/cbc2) + eps
		p[i] = pi + T(T(cstep*mi)/den)
		m[i], v[i] = mi, vi
	}
}

// sqrt is the correctly rounded square root in T: the float64 root of a
// float32 rounds to the float32 root exactly.
func sqrt[T Float](x T) T { return T(math.Sqrt(float64(x))) }
