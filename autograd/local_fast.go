package autograd

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/placement"
)

// Local kernels of the nn ops with a float32 fast path: float32 blocks run
// on the fused row kernels of package kernels (float64 accumulation and
// transcendentals, one rounding to float32) with saved values and
// gradients in the tape's arena; float64 blocks (references, gradient
// checks) keep the plain loops of local_nn.go.
//
// rec says whether the op is recorded (its backward will run), so that
// values are saved only then; t's arena holds them until the tape is
// cleared.

// as32 reports whether T is float32 and converts x.
func as32[T float](x []T) ([]float32, bool) {
	v, ok := any(x).([]float32)
	return v, ok
}

// from32 converts back a []float32 known to be a []T.
func from32[T float](x []float32) []T {
	v, _ := any(x).([]T)
	return v
}

// geluSaved is what GELU's backward needs: GELU'(x) per element for
// float32 (kernels.BiasGELU's deriv), erf(x/√2) per element for float64.
type geluSaved struct {
	deriv []float32
	erfs  []float64
}

// geluForward computes GELU(x) for rows of n values into a result block.
func geluForward[T float](t *Tape, rec bool, x []T, n int) ([]T, geluSaved, error) {
	if x32, ok := as32(x); ok {
		y := resultBlock[float32](t, len(x32))
		var s geluSaved
		if rec {
			s.deriv = getBuf[float32](t, len(x32))
		}
		if err := kernels.BiasGELU(t.Workers(), y, s.deriv, x32, nil, rowWidth(len(x32), n)); err != nil {
			return nil, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), s, nil
	}
	y, erfs := geluFwd(t.Workers(), x)
	return y, geluSaved{erfs: erfs}, nil
}

// geluBackward maps g to g·GELU'(x), in t's arena for float32.
func geluBackward[T float](t *Tape, x []T, s geluSaved, g []T, n int) ([]T, error) {
	if g32, ok := as32(g); ok {
		dx := getBuf[float32](t, len(g32))
		if err := kernels.BiasGELUBackward(dx, nil, g32, s.deriv, rowWidth(len(g32), n)); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return geluBwd(t.Workers(), x, s.erfs, g), nil
}

// rowWidth is n when it divides l into whole rows, else l (one row): the
// row kernels only use the width to split work.
func rowWidth(l, n int) int {
	if n > 0 && l%n == 0 {
		return n
	}
	return l
}

// softmaxForward is softmax (or log-softmax) over dim d of a block of
// shape; float32 blocks reduced over their last dim run on the row
// kernels. The result is a result block of t.
func softmaxForward[T float](t *Tape, x []T, shape []int, d int, logOut bool) ([]T, error) {
	outer, n, inner := splitDim(shape, d)
	if x32, ok := as32(x); ok && inner == 1 && outer*n == len(x32) {
		y := resultBlock[float32](t, len(x32))
		f := kernels.SoftmaxRows
		if logOut {
			f = kernels.LogSoftmaxRows
		}
		if err := f(t.Workers(), y, x32, n); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), nil
	}
	return softmaxFwd(x, shape, d, logOut), nil
}

// softmaxBackward maps g to the gradient of x, in t's arena for float32
// blocks reduced over their last dim.
func softmaxBackward[T float](t *Tape, y, g []T, shape []int, d int, logOut bool) ([]T, error) {
	outer, n, inner := splitDim(shape, d)
	y32, ok := as32(y)
	g32, _ := as32(g)
	if ok && inner == 1 && outer*n == len(y32) && len(g32) == len(y32) {
		dx := getBuf[float32](t, len(y32))
		f := kernels.SoftmaxRowsBackward // memory-bound: one goroutine
		if logOut {
			f = func(dx, y, dy []float32, n int) error {
				return kernels.LogSoftmaxRowsBackward(t.Workers(), dx, y, dy, n)
			}
		}
		if err := f(dx, y32, g32, n); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return softmaxBwd(y, g, shape, d, logOut), nil
}

// lnSaved is what LayerNorm's backward needs: the rows' mean and
// 1/sqrt(σ²+eps) (float32, with x itself), or x̂ (float64).
type lnSaved struct {
	mean, rstd []float64
	xhat       []float64
}

// lnForward is LayerNorm over rows of n values into a result block.
func lnForward[T float](t *Tape, rec bool, x, w, b []T, n int, eps float64) ([]T, lnSaved, error) {
	if x32, ok := as32(x); ok {
		w32, _ := as32(w)
		b32, _ := as32(b)
		y := resultBlock[float32](t, len(x32))
		var s lnSaved
		if rec && n > 0 {
			rows := len(x32) / n
			s.mean, s.rstd = getBuf[float64](t, rows), getBuf[float64](t, rows)
		}
		if err := kernels.LayerNorm(y, s.mean, s.rstd, x32, w32, b32, n, eps); err != nil {
			return nil, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), s, nil
	}
	y, xhat, rstd := lnFwd(x, w, b, n, eps)
	return y, lnSaved{xhat: xhat, rstd: rstd}, nil
}

// lnBackward returns dx, dw and db (nil where not needed), in t's arena
// for float32.
func lnBackward[T float](t *Tape, g, x, w []T, s lnSaved, n int, needX, needW, needB bool) (dx, dw, db []T, err error) {
	g32, ok := as32(g)
	if !ok {
		dx, dw, db = lnBwd(g, w, s.xhat, s.rstd, n, needX, needW, needB)
		return dx, dw, db, nil
	}
	x32, _ := as32(x)
	w32, _ := as32(w)
	var dx32, dw32, db32 []float32
	if needX {
		dx32 = getBuf[float32](t, len(g32))
	}
	if needW {
		dw32 = zeroBuf[float32](t, n) // stays 0 when there are no rows
	}
	if needB {
		db32 = zeroBuf[float32](t, n)
	}
	if err := kernels.LayerNormBackward(dx32, dw32, db32, g32, x32, w32, s.mean, s.rstd, n); err != nil {
		return nil, nil, nil, fmt.Errorf("autograd: internal: %w", err)
	}
	return from32[T](dx32), from32[T](dw32), from32[T](db32), nil
}

// columnSums sums the rows of an [rows, n] block (a bias gradient), in t's
// arena for float32.
func columnSums[T float](t *Tape, g []T, n int) ([]T, error) {
	if g32, ok := as32(g); ok {
		out := getBuf[float32](t, n)
		if err := kernels.ColumnSums(out, g32, n); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](out), nil
	}
	return rowSum(g, n), nil
}

// gemmBias computes x·wᵀ for the local blocks x [m, k] and w [n, k], plus
// bias (n values; nil for none) in every row, and lays the m×n result (a
// result block of t) out by spec: Linear's forward. The result is
// prefilled with the bias rows and the GEMM adds into it (beta = 1), so
// there is no separate pass adding the bias and no pass of the BLAS
// clearing C for beta = 0.
func gemmBias[T float](t *Tape, b *kernels.BLAS, spec *placement.Spec, x, w *placement.DTensor, bias []T, m, n, k int) (*placement.DTensor, error) {
	if bias == nil {
		return gemm(t.result(), b, spec, x, w, false, true, m, n, k)
	}
	xd, err := dataOf[T](x)
	if err != nil {
		return nil, err
	}
	wd, err := dataOf[T](w)
	if err != nil {
		return nil, err
	}
	c := resultBlock[T](t, m*n)
	for r := 0; n > 0 && r+n <= len(c); r += n {
		copy(c[r:r+n], bias)
	}
	if k > 0 && m > 0 && n > 0 {
		switch cd := any(c).(type) {
		case []float32:
			err = b.Sgemm(false, true, m, n, k, 1, any(xd).([]float32), k, any(wd).([]float32), k, 1, cd, n)
		case []float64:
			err = b.Dgemm(false, true, m, n, k, 1, any(xd).([]float64), k, any(wd).([]float64), k, 1, cd, n)
		}
		if err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
	}
	return placement.NewLocal(spec, c)
}

// ceSaved is what CrossEntropy's backward needs: each local row's
// logsumexp (float32), or the softmax of every row (float64).
type ceSaved struct {
	lse []float64
	sm  []float64
}

// ceForward returns Σ_rows (logsumexp(x_r) − x_r[t_r]) / n over the local
// rows of an [rows, v] block.
func ceForward[T float](t *Tape, rec bool, x []T, tg []int64, v, n int) (T, ceSaved, error) {
	if x32, ok := as32(x); ok {
		var s ceSaved
		if rec {
			s.lse = getBuf[float64](t, len(tg))
		}
		total, err := kernels.CrossEntropyRows(t.Workers(), s.lse, x32, tg, v)
		if err != nil {
			return 0, s, fmt.Errorf("autograd: internal: %w", err)
		}
		return T(total / float64(n)), s, nil
	}
	loss, sm := ceFwd(x, tg, v, n)
	return loss, ceSaved{sm: sm}, nil
}

// ceBackward is g·(softmax − onehot(t))/n, in t's arena for float32.
func ceBackward[T float](t *Tape, x []T, tg []int64, s ceSaved, v, n int, g float64) ([]T, error) {
	if x32, ok := as32(x); ok {
		dx := getBuf[float32](t, len(x32))
		if err := kernels.CrossEntropyRowsBackward(t.Workers(), dx, x32, tg, s.lse, v, g/float64(n)); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return ceBwd[T](s.sm, tg, v, n, g), nil
}

// records reports whether an op on inputs will be recorded (its backward
// may run), so that it needs to save values for it.
func (t *Tape) records(inputs ...*Value) bool {
	return t.recording() && slices.ContainsFunc(inputs, (*Value).RequiresGrad)
}

// causalForward is the causal row softmax of [..., T, T] blocks (tt = T)
// into a result block of t.
func causalForward[T float](t *Tape, x []T, tt int) ([]T, error) {
	if x32, ok := as32(x); ok {
		y := resultBlock[float32](t, len(x32))
		if err := kernels.CausalSoftmax(t.Workers(), y, x32, tt, 1); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](y), nil
	}
	return causalFwd(x, tt), nil
}

// causalBackward maps g to the gradient of the causal softmax's input, in
// t's arena for float32 (masked entries get 0).
func causalBackward[T float](t *Tape, y, g []T, shape []int) ([]T, error) {
	if y32, ok := as32(y); ok {
		g32, _ := as32(g)
		tt := 0
		if len(shape) > 0 {
			tt = shape[len(shape)-1]
		}
		dx := getBuf[float32](t, len(y32))
		if err := kernels.CausalSoftmaxBackward(dx, y32, g32, tt, 1); err != nil {
			return nil, fmt.Errorf("autograd: internal: %w", err)
		}
		return from32[T](dx), nil
	}
	return softmaxBwd(y, g, shape, len(shape)-1, false), nil
}
