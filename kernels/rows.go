package kernels

import (
	"fmt"
	"math"
	"runtime"
	"sync"

	"github.com/b7ea7098/loom/internal/checked"
)

// Row kernels: fused float32 loops over the rows of row-major blocks, for
// the non-GEMM work of a transformer step (softmax, layer norm, GELU,
// cross-entropy). Reductions (sums, means, variances) accumulate in
// float64 and transcendentals are evaluated in float64, so every result is
// the float64 value rounded once to float32, up to the float64 rounding of
// the order of summation and the documented accuracy of the vector
// exp/erfc (about 1e-11 and 5e-10 relative). Outputs may alias the input
// they are computed from where a function says so. Bad lengths return an
// error and leave the outputs untouched; nothing panics on them.
//
// Large calls of the compute-bound kernels (those evaluating exp or erfc)
// split their rows over up to the goroutines their Workers argument allows;
// every row is computed exactly as by a serial loop, so the results do not
// depend on the split.

// Workers bounds the goroutines one kernel call may run on: its caller's
// share of the cores. A rank of p in-process ranks on c cores passes c/p,
// as it sizes its BLAS ([WithThreads]); more would make the ranks' kernels
// compete for the same cores. Zero or less means GOMAXPROCS.
type Workers int

// Count is the bound as a number of goroutines: w, or GOMAXPROCS for w <= 0.
func (w Workers) Count() int {
	if w <= 0 {
		return runtime.GOMAXPROCS(0)
	}
	return int(w)
}

// rowsMinPerWorker is the fewest elements a goroutine of forRows gets:
// below it, starting goroutines costs more than it saves.
const rowsMinPerWorker = 1 << 15

// forRows calls f on ranges [lo, hi) covering rows 0..rows−1 of width n,
// on up to w goroutines (the first range on the caller's), and waits for
// them.
func forRows(w Workers, rows, n int, f func(lo, hi int)) {
	k := 1
	if rows > 1 && n > 0 {
		k = min(w.Count(), rows, rows*n/rowsMinPerWorker)
	}
	if k <= 1 {
		f(0, rows)
		return
	}
	var wg sync.WaitGroup
	for i := 1; i < k; i++ {
		lo, hi := i*rows/k, (i+1)*rows/k
		wg.Go(func() { f(lo, hi) })
	}
	f(0, rows/k)
	wg.Wait()
}

// serialRows calls f on all rows at once. The memory-bound kernels use it:
// on 2 cores, splitting them over goroutines measured no faster (and the
// second core is often busy with a BLAS worker).
func serialRows(rows int, f func(lo, hi int)) { f(0, rows) }

// rowCount validates a block of rows of width n held in a slice of length
// l: n >= 0, l a multiple of n (l == 0 when n == 0).
func rowCount(op string, l, n int) (int, error) {
	switch {
	case n < 0:
		return 0, fmt.Errorf("kernels: %s: %w: negative row width %d", op, ErrInvalid, n)
	case n == 0:
		if l != 0 {
			return 0, fmt.Errorf("kernels: %s: %w: %d elements in rows of width 0", op, ErrInvalid, l)
		}
		return 0, nil
	case l%n != 0:
		return 0, fmt.Errorf("kernels: %s: %w: %d elements are not whole rows of width %d", op, ErrInvalid, l, n)
	}
	return l / n, nil
}

// causalBlocks is the number of t×t blocks in l elements.
func causalBlocks(op string, l, t int) (int, error) {
	tt, ok := checked.Mul(t, t)
	if !ok {
		return 0, fmt.Errorf("kernels: %s: %w: blocks of %d×%d elements: the count overflows int", op, ErrInvalid, t, t)
	}
	return rowCount(op, l, tt)
}

// sameLen checks that every named slice has length l.
func sameLen(op string, l int, names string, lens ...int) error {
	for _, v := range lens {
		if v != l {
			return fmt.Errorf("kernels: %s: %w: %s have lengths %v, want %d each", op, ErrInvalid, names, lens, l)
		}
	}
	return nil
}

// SoftmaxRows sets every row of dst (rows of n values in row-major order)
// to the softmax of the same row of src: exp(x − max)/Σ exp(x − max),
// evaluated as exp(x − logsumexp(x)). dst may alias src. len(dst) must
// equal len(src), a multiple of n.
func SoftmaxRows(w Workers, dst, src []float32, n int) error {
	return softmaxRows(w, "SoftmaxRows", dst, src, n, false)
}

// LogSoftmaxRows sets every row of dst to the log-softmax of the same row
// of src: x − logsumexp(x). dst may alias src.
func LogSoftmaxRows(w Workers, dst, src []float32, n int) error {
	return softmaxRows(w, "LogSoftmaxRows", dst, src, n, true)
}

func softmaxRows(w Workers, op string, dst, src []float32, n int, logOut bool) error {
	rows, err := rowCount(op, len(src), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(src), "dst and src", len(dst)); err != nil {
		return err
	}
	forRows(w, rows, n, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			x, y := src[r*n:(r+1)*n], dst[r*n:(r+1)*n]
			lse := logSumExp(x)
			if logOut {
				for j, v := range x {
					y[j] = float32(float64(v) - lse)
				}
			} else {
				expShift(y, x, lse)
			}
		}
	})
	return nil
}

// logSumExp is log Σ exp(x) of a non-empty row, with the maximum
// subtracted before exp.
func logSumExp(x []float32) float64 {
	m := float64(maxOf(x))
	return m + math.Log(expShift(nil, x, m))
}

// SoftmaxRowsBackward maps the gradient dy of y = SoftmaxRows(x) to the
// gradient of x, row by row: dx = y ⊙ (dy − Σ dy ⊙ y). dx may alias dy.
func SoftmaxRowsBackward(dx, y, dy []float32, n int) error {
	const op = "SoftmaxRowsBackward"
	rows, err := rowCount(op, len(y), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(y), "dx, y and dy", len(dx), len(dy)); err != nil {
		return err
	}
	serialRows(rows, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			softmaxBackRow(dx[r*n:(r+1)*n], y[r*n:(r+1)*n], dy[r*n:(r+1)*n], 1)
		}
	})
	return nil
}

// softmaxBackRow sets dx = scale·y⊙(dy − Σ dy⊙y) for one row.
func softmaxBackRow(dx, y, dy []float32, scale float64) {
	softBack(dx, y, dy, dot(dy, y), scale)
}

// LogSoftmaxRowsBackward maps the gradient dy of y = LogSoftmaxRows(x) to
// the gradient of x, row by row: dx = dy − exp(y)·Σ dy. dx may alias dy.
func LogSoftmaxRowsBackward(w Workers, dx, y, dy []float32, n int) error {
	const op = "LogSoftmaxRowsBackward"
	rows, err := rowCount(op, len(y), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(y), "dx, y and dy", len(dx), len(dy)); err != nil {
		return err
	}
	forRows(w, rows, n, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			yr, gr, xr := y[r*n:(r+1)*n], dy[r*n:(r+1)*n], dx[r*n:(r+1)*n]
			s := 0.0
			for _, g := range gr {
				s += float64(g)
			}
			for j, v := range yr {
				xr[j] = float32(float64(gr[j]) - math.Exp(float64(v))*s)
			}
		}
	})
	return nil
}

// CausalSoftmax computes, for every t×t block of src (scores [..., T, T]
// in row-major order, T = t), the softmax over each row i of scale·src
// restricted to columns j <= i; dst gets those probabilities and exactly 0
// at j > i. scale·src is rounded to float32 before the softmax, as when
// the scores are scaled by a separate float32 multiply. dst may alias
// src. len(dst) must equal len(src), a multiple of t·t.
func CausalSoftmax(w Workers, dst, src []float32, t int, scale float32) error {
	const op = "CausalSoftmax"
	if t < 0 {
		return fmt.Errorf("kernels: %s: %w: negative size %d", op, ErrInvalid, t)
	}
	blocks, err := causalBlocks(op, len(src), t)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(src), "dst and src", len(dst)); err != nil {
		return err
	}
	forRows(w, blocks, t*t/2, func(lo, hi int) {
		for r := lo * t; r < hi*t; r++ {
			i := r % t
			x, y := src[r*t:r*t+i+1], dst[r*t:(r+1)*t]
			if scale != 1 {
				for j, v := range x {
					y[j] = v * scale
				}
				x = y[:i+1]
			}
			expShift(y, x, logSumExp(x))
			clear(y[i+1:])
		}
	})
	return nil
}

// CausalSoftmaxBackward maps the gradient dy of y = CausalSoftmax(x, t,
// scale) to the gradient of x: per row i, dx_j = scale·y_j·(dy_j − Σ_{k<=i}
// dy_k·y_k) for j <= i and 0 for j > i. dx may alias dy.
func CausalSoftmaxBackward(dx, y, dy []float32, t int, scale float32) error {
	const op = "CausalSoftmaxBackward"
	if t < 0 {
		return fmt.Errorf("kernels: %s: %w: negative size %d", op, ErrInvalid, t)
	}
	blocks, err := causalBlocks(op, len(y), t)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(y), "dx, y and dy", len(dx), len(dy)); err != nil {
		return err
	}
	serialRows(blocks, func(lo, hi int) {
		for r := lo * t; r < hi*t; r++ {
			i := r % t
			row := dx[r*t : (r+1)*t]
			softmaxBackRow(row, y[r*t:r*t+i+1], dy[r*t:r*t+i+1], float64(scale))
			clear(row[i+1:])
		}
	})
	return nil
}

// LayerNorm normalises every row of x (rows of n values) over its n
// values with the biased variance, y = (x − μ)/sqrt(σ² + eps)·w + b, in
// one pass over the row for μ and σ² (shifted by the row's first value, so
// a large mean does not cancel the variance) and one for y. w and b have
// n values; nil means ones and zeros. mean and rstd, when not nil, receive
// each row's μ and 1/sqrt(σ² + eps) (one value per row), which
// LayerNormBackward takes. y may alias x. With n == 0 there is nothing to
// compute and mean and rstd are not touched.
func LayerNorm(y []float32, mean, rstd []float64, x, w, b []float32, n int, eps float64) error {
	const op = "LayerNorm"
	rows, err := rowCount(op, len(x), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(x), "y and x", len(y)); err != nil {
		return err
	}
	if err := optLen(op, n, "w and b", w, b); err != nil {
		return err
	}
	if !(eps >= 0) {
		return fmt.Errorf("kernels: %s: %w: eps %v must be non-negative", op, ErrInvalid, eps)
	}
	if n == 0 {
		return nil // no values: nothing to normalise, whatever the row count
	}
	if err := optLen64(op, rows, "mean and rstd", mean, rstd); err != nil {
		return err
	}
	serialRows(rows, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			xr, yr := x[r*n:(r+1)*n], y[r*n:(r+1)*n]
			k := float64(xr[0])
			s1, s2 := lnStats(xr, k)
			m1 := s1 / float64(n)
			mu := k + m1
			rs := 1 / math.Sqrt(max(s2/float64(n)-m1*m1, 0)+eps)
			if mean != nil {
				mean[r], rstd[r] = mu, rs
			}
			switch {
			case w != nil && b != nil:
				lnAffine(yr, xr, w, b, rs, -mu*rs)
			default:
				for j, v := range xr {
					h := (float64(v) - mu) * rs
					if w != nil {
						h *= float64(w[j])
					}
					if b != nil {
						h += float64(b[j])
					}
					yr[j] = float32(h)
				}
			}
		}
	})
	return nil
}

// optLen checks that every non-nil slice has length n.
func optLen(op string, n int, names string, s ...[]float32) error {
	for _, v := range s {
		if v != nil && len(v) != n {
			return fmt.Errorf("kernels: %s: %w: %s must have %d values each (or be nil); got %d", op, ErrInvalid, names, n, len(v))
		}
	}
	return nil
}

// optLen64 checks that the float64 slices are both nil or both of length n.
func optLen64(op string, n int, names string, a, b []float64) error {
	if (a == nil) != (b == nil) || (a != nil && (len(a) != n || len(b) != n)) {
		return fmt.Errorf("kernels: %s: %w: %s must both be nil or both have %d values; got lengths %d and %d", op, ErrInvalid, names, n, len(a), len(b))
	}
	return nil
}

// LayerNormBackward maps the gradient dy of y = LayerNorm(x, w, b) to dx,
// dw and db, from x, w (nil: ones) and the mean and rstd LayerNorm saved.
// With x̂ = (x − μ)·rstd and h = dy⊙w, per row dx = rstd·(h − mean(h) −
// x̂·mean(h⊙x̂)); dw = Σ_rows dy⊙x̂ and db = Σ_rows dy (accumulated in
// float64 and then stored, overwriting dw and db). Any of dx, dw and db may
// be nil when that gradient is not wanted. dx may alias dy.
func LayerNormBackward(dx, dw, db, dy, x, w []float32, mean, rstd []float64, n int) error {
	const op = "LayerNormBackward"
	rows, err := rowCount(op, len(x), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(x), "dy and x", len(dy)); err != nil {
		return err
	}
	if dx != nil && len(dx) != len(x) {
		return fmt.Errorf("kernels: %s: %w: dx has %d values, x %d", op, ErrInvalid, len(dx), len(x))
	}
	if err := optLen(op, n, "w, dw and db", w, dw, db); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	if mean == nil && rows > 0 { // an empty block (an empty shard) has no statistics
		return fmt.Errorf("kernels: %s: %w: nil mean and rstd", op, ErrInvalid)
	}
	if err := optLen64(op, rows, "mean and rstd", mean, rstd); err != nil {
		return err
	}
	var dwa, dba []float64
	if dw != nil {
		dwa = make([]float64, n)
	}
	if db != nil {
		dba = make([]float64, n)
	}
	if w == nil {
		w = make([]float32, n)
		for j := range w {
			w[j] = 1
		}
	}
	for r := range rows {
		xr, gr := x[r*n:(r+1)*n], dy[r*n:(r+1)*n]
		mu, rs := mean[r], rstd[r]
		m1, m2 := lnBackRow(dwa, dba, gr, xr, w, mu, rs)
		if dx != nil {
			lnDxRow(dx[r*n:(r+1)*n], gr, xr, w, mu, rs, m1/float64(n), m2/float64(n))
		}
	}
	for j := range dw {
		dw[j] = float32(dwa[j])
	}
	for j := range db {
		db[j] = float32(dba[j])
	}
	return nil
}

// BiasGELU sets y = GELU(x + bias) with the exact (erf) GELU, x·Φ(x), for
// rows of n values (bias, n values, is added to every row in float32; nil
// means no bias), and, when deriv is not nil, deriv = GELU'(x + bias) =
// Φ + (x + bias)·φ, which BiasGELUBackward takes. y and deriv may alias x.
func BiasGELU(w Workers, y, deriv, x, bias []float32, n int) error {
	const op = "BiasGELU"
	rows, err := rowCount(op, len(x), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(x), "y and x", len(y)); err != nil {
		return err
	}
	if deriv != nil && len(deriv) != len(x) {
		return fmt.Errorf("kernels: %s: %w: deriv has %d values, x %d", op, ErrInvalid, len(deriv), len(x))
	}
	if err := optLen(op, n, "bias", bias); err != nil {
		return err
	}
	forRows(w, rows, n, func(lo, hi int) {
		ys, xs := y[lo*n:hi*n], x[lo*n:hi*n]
		var ds []float32
		if deriv != nil {
			ds = deriv[lo*n : hi*n]
		}
		if bias != nil {
			for r := range hi - lo {
				addF32(ys[r*n:(r+1)*n], xs[r*n:(r+1)*n], bias)
			}
			xs = ys
		}
		gelu(ys, ds, xs)
	})
	return nil
}

// BiasGELUBackward maps the gradient dy of y = BiasGELU(x, bias) to
// dx = dy⊙deriv (a float32 product, the deriv BiasGELU saved) and, when
// dbias is not nil, the bias gradient dbias = Σ_rows dx (accumulated in
// float64, overwriting dbias). dx may alias dy or deriv.
func BiasGELUBackward(dx, dbias, dy, deriv []float32, n int) error {
	const op = "BiasGELUBackward"
	rows, err := rowCount(op, len(dy), n)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(dy), "dx, dy and deriv", len(dx), len(deriv)); err != nil {
		return err
	}
	if err := optLen(op, n, "dbias", dbias); err != nil {
		return err
	}
	serialRows(rows, func(lo, hi int) {
		mulF32(dx[lo*n:hi*n], dy[lo*n:hi*n], deriv[lo*n:hi*n])
	})
	if dbias != nil {
		colSums(dbias, dx, n)
	}
	return nil
}

// ColumnSums sets out[j] to the sum over the rows of x (rows of n values)
// of column j, accumulated in float64 row by row and rounded once to T:
// the bias gradient of a linear layer. len(out) must be n.
func ColumnSums[T Float](out, x []T, n int) error {
	const op = "ColumnSums"
	rows, err := rowCount(op, len(x), n)
	if err != nil {
		return err
	}
	if len(out) != n {
		return fmt.Errorf("kernels: %s: %w: out has %d values for rows of %d", op, ErrInvalid, len(out), n)
	}
	if o32, ok := any(out).([]float32); ok {
		colSums(o32, any(x).([]float32), n)
		return nil
	}
	acc := make([]float64, n)
	for r := range rows {
		for j, v := range x[r*n : (r+1)*n] {
			acc[j] += float64(v)
		}
	}
	for j, v := range acc {
		out[j] = T(v)
	}
	return nil
}

// colSums sets out[j] = Σ_r x[r·n + j] for the rows of x, accumulating in
// float64.
func colSums(out, x []float32, n int) {
	acc := make([]float64, n)
	colSums64(acc, x)
	for j, v := range acc {
		out[j] = float32(v)
	}
}

// CrossEntropyRows returns Σ_r (logsumexp(x_r) − x_r[targets[r]]) over the
// rows x_r of logits (rows of v values, one target class per row), the
// summed negative log-likelihood in float64; divide by the row count for
// the mean. lse, when not nil, receives each row's logsumexp for
// CrossEntropyRowsBackward. A target outside [0, v) is an error.
func CrossEntropyRows(w Workers, lse []float64, logits []float32, targets []int64, v int) (float64, error) {
	const op = "CrossEntropyRows"
	rows, err := ceCheck(op, logits, targets, v)
	if err != nil {
		return 0, err
	}
	if lse != nil && len(lse) != rows {
		return 0, fmt.Errorf("kernels: %s: %w: lse has %d values for %d rows", op, ErrInvalid, len(lse), rows)
	}
	parts := make([]float64, rows)
	forRows(w, rows, v, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			x := logits[r*v : (r+1)*v]
			l := logSumExp(x)
			if lse != nil {
				lse[r] = l
			}
			parts[r] = l - float64(x[targets[r]])
		}
	})
	total := 0.0
	for _, p := range parts {
		total += p
	}
	return total, nil
}

// ceCheck validates logits [rows, v] and one target in [0, v) per row.
func ceCheck(op string, logits []float32, targets []int64, v int) (int, error) {
	rows, err := rowCount(op, len(logits), v)
	if err != nil {
		return 0, err
	}
	if v == 0 {
		rows = len(targets)
	}
	if len(targets) != rows {
		return 0, fmt.Errorf("kernels: %s: %w: %d targets for %d rows of %d logits", op, ErrInvalid, len(targets), rows, v)
	}
	for r, t := range targets {
		if t < 0 || t >= int64(v) {
			return 0, fmt.Errorf("kernels: %s: %w: target %d of row %d outside [0, %d)", op, ErrInvalid, t, r, v)
		}
	}
	return rows, nil
}

// CrossEntropyRowsBackward sets dx = scale·(softmax(x_r) − onehot(t_r))
// for every row x_r of logits, from the logsumexp values lse that
// CrossEntropyRows returned: the gradient of scale·CrossEntropyRows. With
// scale = g/N it is the gradient of the mean loss times g. dx may alias
// logits.
func CrossEntropyRowsBackward(w Workers, dx, logits []float32, targets []int64, lse []float64, v int, scale float64) error {
	const op = "CrossEntropyRowsBackward"
	rows, err := ceCheck(op, logits, targets, v)
	if err != nil {
		return err
	}
	if err := sameLen(op, len(logits), "dx and logits", len(dx)); err != nil {
		return err
	}
	if len(lse) != rows {
		return fmt.Errorf("kernels: %s: %w: lse has %d values for %d rows", op, ErrInvalid, len(lse), rows)
	}
	// scale·exp(x − l) = ±exp(x − (l − log|scale|)): one rounding, with
	// the scale folded into the shift.
	fold := scale != 0 && !math.IsInf(scale, 0) && !math.IsNaN(scale)
	logScale := 0.0
	if fold {
		logScale = math.Log(math.Abs(scale))
	}
	forRows(w, rows, v, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			x, d := logits[r*v:(r+1)*v], dx[r*v:(r+1)*v]
			t := targets[r]
			xt := float64(x[t]) // read before dx (which may alias x) is written
			if fold {
				expShift(d, x, lse[r]-logScale)
				if scale < 0 {
					for j := range d {
						d[j] = -d[j]
					}
				}
			} else {
				for j, e := range x {
					d[j] = float32(scale * math.Exp(float64(e)-lse[r]))
				}
			}
			d[t] = float32(scale * (math.Exp(xt-lse[r]) - 1))
		}
	})
	return nil
}

// Add sets dst[i] = a[i] + b[i]. dst may alias a or b; all three must
// have the same length. float32 runs on the vector kernel.
func Add[T Float](dst, a, b []T) error {
	if len(a) != len(dst) || len(b) != len(dst) {
		return fmt.Errorf("kernels: Add: %w: lengths %d, %d and %d differ", ErrInvalid, len(dst), len(a), len(b))
	}
	if d32, ok := any(dst).([]float32); ok {
		addF32(d32, any(a).([]float32), any(b).([]float32))
		return nil
	}
	for i, v := range a {
		dst[i] = v + b[i]
	}
	return nil
}

// Mul sets dst[i] = a[i]·b[i]. dst may alias a or b; all three must have
// the same length. float32 runs on the vector kernel.
func Mul[T Float](dst, a, b []T) error {
	if len(a) != len(dst) || len(b) != len(dst) {
		return fmt.Errorf("kernels: Mul: %w: lengths %d, %d and %d differ", ErrInvalid, len(dst), len(a), len(b))
	}
	if d32, ok := any(dst).([]float32); ok {
		mulF32(d32, any(a).([]float32), any(b).([]float32))
		return nil
	}
	for i, v := range a {
		dst[i] = v * b[i]
	}
	return nil
}
