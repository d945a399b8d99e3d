package autograd

import (
	"fmt"
	"math"
	"sync"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Local kernels of the neural-network ops. They work on row-major local
// blocks and accumulate reductions in float64.

// dataOf returns dt's local block as a []T.
func dataOf[T float](dt *placement.DTensor) ([]T, error) {
	d, ok := dt.LocalData().([]T)
	if !ok {
		var z T
		return nil, fmt.Errorf("autograd: internal: local data of type %T, want []%T", dt.LocalData(), z)
	}
	return d, nil
}

// isF32 reports whether spec holds float32.
func isF32(s *placement.Spec) bool { return s.DType() == comm.Float32 }

// splitDim returns the sizes before, at and after dim d of shape.
func splitDim(shape []int, d int) (outer, n, inner int) {
	return prod(shape[:d]), shape[d], prod(shape[d+1:])
}

// parallelMinChunk is the fewest elements parallelRange gives one
// goroutine: below it the start-up cost outweighs the work.
const parallelMinChunk = 16384

// parallelRange calls f on contiguous ranges [lo, hi) that cover [0, n),
// on up to w goroutines at once, and waits for them. It is for
// elementwise loops whose iterations are independent; since every element
// is computed as in a serial loop, the results are bit for bit the same.
func parallelRange(w kernels.Workers, n int, f func(lo, hi int)) {
	k := min(w.Count(), n/parallelMinChunk)
	if k <= 1 {
		f(0, n)
		return
	}
	chunk := (n + k - 1) / k
	var wg sync.WaitGroup
	for lo := chunk; lo < n; lo += chunk {
		hi := min(lo+chunk, n)
		wg.Go(func() { f(lo, hi) })
	}
	f(0, min(chunk, n))
	wg.Wait()
}

// geluFwd is 0.5·x·(1 + erf(x/√2)). It also returns every erf(x/√2), which
// the backward reuses: erf is the most expensive part of both passes.
func geluFwd[T float](w kernels.Workers, x []T) (out []T, erfs []float64) {
	out = make([]T, len(x))
	erfs = make([]float64, len(x))
	parallelRange(w, len(x), func(lo, hi int) {
		for i, v := range x[lo:hi] {
			f := float64(v)
			e := math.Erf(f / math.Sqrt2)
			erfs[lo+i] = e
			out[lo+i] = T(0.5 * f * (1 + e))
		}
	})
	return out, erfs
}

// geluBwd is g·GELU'(x), GELU'(x) = Φ(x) + x·φ(x), with Φ(x) = 0.5·(1 +
// erf(x/√2)) from the forward's erfs.
func geluBwd[T float](w kernels.Workers, x []T, erfs []float64, g []T) []T {
	out := make([]T, len(x))
	c := 1 / math.Sqrt(2*math.Pi)
	parallelRange(w, len(x), func(lo, hi int) {
		for i, v := range x[lo:hi] {
			f := float64(v)
			d := 0.5*(1+erfs[lo+i]) + f*c*math.Exp(-0.5*f*f)
			out[lo+i] = T(float64(g[lo+i]) * d)
		}
	})
	return out
}

// softmaxFwd computes softmax (or log-softmax) over dim d of a block of
// the given shape, subtracting the row maximum before exp.
func softmaxFwd[T float](x []T, shape []int, d int, logOut bool) []T {
	outer, n, inner := splitDim(shape, d)
	out := make([]T, len(x))
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
					out[i] = T(float64(x[i]) - lse)
				} else {
					out[i] = T(math.Exp(float64(x[i]) - lse))
				}
			}
		}
	}
	return out
}

// softmaxBwd maps the gradient g of y = softmax(x) (or log-softmax) over
// dim d to the gradient of x: y⊙(g − Σg⊙y), or g − softmax·Σg.
func softmaxBwd[T float](y, g []T, shape []int, d int, logOut bool) []T {
	outer, n, inner := splitDim(shape, d)
	out := make([]T, len(y))
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
					out[i] = T(float64(g[i]) - math.Exp(float64(y[i]))*s)
				} else {
					out[i] = T(float64(y[i]) * (float64(g[i]) - s))
				}
			}
		}
	}
	return out
}

// lnFwd normalises rows of length n: xhat = (x − μ)/sqrt(σ² + eps) with
// the biased variance, y = xhat·w + b. It returns y, xhat and 1/sqrt(σ²+eps)
// per row.
func lnFwd[T float](x, w, b []T, n int, eps float64) (y []T, xhat []float64, rstd []float64) {
	rows := 0
	if n > 0 {
		rows = len(x) / n
	}
	y = make([]T, len(x))
	xhat = make([]float64, len(x))
	rstd = make([]float64, rows)
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
	return y, xhat, rstd
}

// lnBwd returns dx, dw, db of LayerNorm for the gradient g (nil slices for
// gradients not wanted).
func lnBwd[T float](g, w []T, xhat, rstd []float64, n int, needX, needW, needB bool) (dx, dw, db []T) {
	rows := len(rstd)
	var dwa, dba []float64
	if needX {
		dx = make([]T, len(g))
	}
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
	return dx, fromF64[T](dwa), fromF64[T](dba)
}

// fromF64 converts a float64 accumulator (nil stays nil).
func fromF64[T float](a []float64) []T {
	if a == nil {
		return nil
	}
	out := make([]T, len(a))
	for i, v := range a {
		out[i] = T(v)
	}
	return out
}

// permuteT writes into out (len(x) elements) the block of shape permuted
// so that result dim i is input dim perm[i], and returns it. It walks the
// result row by row: trailing dims that keep their order are merged into
// one contiguous run copied at once, and otherwise the last result dim is
// a strided gather.
func permuteT[T float](out, x []T, shape, perm []int) []T {
	out = out[:len(x)]
	if len(x) == 0 {
		return out
	}
	// Strides of the input, in result-dim order.
	in := make([]int, len(shape))
	s := 1
	for d := len(shape) - 1; d >= 0; d-- {
		in[d] = s
		s *= shape[d]
	}
	oshape := make([]int, len(perm))
	st := make([]int, len(perm))
	for i, p := range perm {
		oshape[i], st[i] = shape[p], in[p]
	}
	// Merge trailing result dims that are contiguous in the input.
	r := len(oshape)
	run := 1
	for r > 0 && st[r-1] == run {
		run *= oshape[r-1]
		r--
	}
	if run > 1 || r == 0 {
		// Copy runs of `run` contiguous elements; odometer over dims [0, r).
		idx := make([]int, r)
		j := 0
		for o := 0; o < len(out); o += run {
			copy(out[o:o+run], x[j:j+run])
			for d := r - 1; d >= 0; d-- {
				idx[d]++
				j += st[d]
				if idx[d] < oshape[d] {
					break
				}
				j -= st[d] * oshape[d]
				idx[d] = 0
			}
		}
		return out
	}
	// The last result dim is strided in the input: gather each result row.
	n, stride := oshape[r-1], st[r-1]
	idx := make([]int, r-1)
	j := 0
	for o := 0; o < len(out); o += n {
		row := out[o : o+n]
		k := j
		for c := range row {
			row[c] = x[k]
			k += stride
		}
		for d := r - 2; d >= 0; d-- {
			idx[d]++
			j += st[d]
			if idx[d] < oshape[d] {
				break
			}
			j -= st[d] * oshape[d]
			idx[d] = 0
		}
	}
	return out
}

// rowSum sums the rows of an [rows, n] block in float64.
func rowSum[T float](g []T, n int) []T {
	acc := make([]float64, n)
	for i, v := range g {
		acc[i%n] += float64(v)
	}
	return fromF64[T](acc)
}

// embedFwd gathers rows of a table block holding rows [lo, lo+vl) of d
// columns each into a result block of t: ids in that range copy their
// row, others give zero rows (a vocab-parallel rank's share of the
// lookup).
func embedFwd[T float](t *Tape, table []T, ids []int64, lo, vl, d int) []T {
	out := resultBlock[T](t, len(ids)*d)
	for i, id := range ids {
		if r := int(id) - lo; r >= 0 && r < vl {
			copy(out[i*d:(i+1)*d], table[r*d:(r+1)*d])
		} else {
			clear(out[i*d : (i+1)*d])
		}
	}
	return out
}

// embedBwd scatter-adds the rows of g whose ids lie in [lo, lo+vl) into a
// zero [vl, d] table-block gradient, in t's arena (accumulated in float64,
// also arena memory).
func embedBwd[T float](t *Tape, g []T, ids []int64, lo, vl, d int) []T {
	acc := zeroBuf[float64](t, vl*d)
	defer putBuf(t, acc)
	for i, id := range ids {
		r := int(id) - lo
		if r < 0 || r >= vl {
			continue
		}
		row := acc[r*d : (r+1)*d]
		for k := range d {
			row[k] += float64(g[i*d+k])
		}
	}
	out := getBuf[T](t, len(acc))
	for i, v := range acc {
		out[i] = T(v)
	}
	return out
}

// ceFwd returns Σ_rows (logsumexp(x_r) − x_r[t_r]) / n over the local rows
// of an [rows, v] block, and the softmax of every row.
func ceFwd[T float](x []T, t []int64, v int, n int) (T, []float64) {
	sm := make([]float64, len(x))
	total := 0.0
	for r, tr := range t {
		row := x[r*v : (r+1)*v]
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
	return T(total / float64(n)), sm
}

// ceBwd is g·(softmax − onehot(t))/n.
func ceBwd[T float](sm []float64, t []int64, v, n int, g float64) []T {
	out := make([]T, len(sm))
	c := g / float64(n)
	for r, tr := range t {
		for k := range v {
			p := sm[r*v+k]
			if int64(k) == tr {
				p--
			}
			out[r*v+k] = T(c * p)
		}
	}
	return out
}
