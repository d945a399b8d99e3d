package kernels

import (
	"fmt"
	"math"
)

// Pointwise activation kernels (ReLU, SiLU, Tanh, Sigmoid and their
// backwards), the dropout mask and the row argmax: the arithmetic of
// autograd's ReLU, SiLU, Tanh, Sigmoid, Dropout and Argmax, one call each,
// so that a device can replace each call by one kernel. Every kernel
// checks its lengths first and returns ErrInvalid before writing
// anything; dst may alias an input of the same length. SiLU, Tanh and
// Sigmoid compute in float64 whatever T is, so float32 results are the
// correctly rounded float64 ones.

// ReLU sets dst[i] = max(x[i], 0) (NaN stays NaN).
func ReLU[T Float](dst, x []T) error {
	if err := sameLen("ReLU", len(dst), "dst and x", len(x)); err != nil {
		return err
	}
	for i, v := range x {
		if v < 0 {
			v = 0
		}
		dst[i] = v
	}
	return nil
}

// ReLUBackward sets dx[i] = dy[i] where x[i] > 0 and 0 elsewhere (the
// subgradient 0 at x = 0, PyTorch's choice).
func ReLUBackward[T Float](dx, x, dy []T) error {
	if err := sameLen("ReLUBackward", len(dx), "dx, x and dy", len(x), len(dy)); err != nil {
		return err
	}
	for i, v := range x {
		g := dy[i]
		if !(v > 0) {
			g = 0
		}
		dx[i] = g
	}
	return nil
}

// sigmoid is 1/(1+e^−x) without overflow for large |x|.
func sigmoid(x float64) float64 {
	if x >= 0 {
		return 1 / (1 + math.Exp(-x))
	}
	e := math.Exp(x)
	return e / (1 + e)
}

// SiLU sets dst[i] = x[i]·σ(x[i]) (σ the logistic sigmoid), computed in
// float64.
func SiLU[T Float](dst, x []T) error {
	if err := sameLen("SiLU", len(dst), "dst and x", len(x)); err != nil {
		return err
	}
	for i, v := range x {
		f := float64(v)
		dst[i] = T(f * sigmoid(f))
	}
	return nil
}

// SiLUBackward sets dx[i] = dy[i]·σ(x)·(1 + x·(1 − σ(x))), the derivative
// of x·σ(x), computed in float64.
func SiLUBackward[T Float](dx, x, dy []T) error {
	if err := sameLen("SiLUBackward", len(dx), "dx, x and dy", len(x), len(dy)); err != nil {
		return err
	}
	for i, v := range x {
		f := float64(v)
		s := sigmoid(f)
		dx[i] = T(float64(dy[i]) * s * (1 + f*(1-s)))
	}
	return nil
}

// Tanh sets dst[i] = tanh(x[i]), computed in float64.
func Tanh[T Float](dst, x []T) error {
	if err := sameLen("Tanh", len(dst), "dst and x", len(x)); err != nil {
		return err
	}
	for i, v := range x {
		dst[i] = T(math.Tanh(float64(v)))
	}
	return nil
}

// TanhBackward sets dx[i] = dy[i]·(1 − y[i]²) from the forward's result
// y = tanh(x), so that backward needs no input.
func TanhBackward[T Float](dx, y, dy []T) error {
	if err := sameLen("TanhBackward", len(dx), "dx, y and dy", len(y), len(dy)); err != nil {
		return err
	}
	for i, v := range y {
		f := float64(v)
		dx[i] = T(float64(dy[i]) * (1 - f*f))
	}
	return nil
}

// Sigmoid sets dst[i] = 1/(1 + e^−x[i]), computed in float64 without
// overflow.
func Sigmoid[T Float](dst, x []T) error {
	if err := sameLen("Sigmoid", len(dst), "dst and x", len(x)); err != nil {
		return err
	}
	for i, v := range x {
		dst[i] = T(sigmoid(float64(v)))
	}
	return nil
}

// SigmoidBackward sets dx[i] = dy[i]·y[i]·(1 − y[i]) from the forward's
// result y = σ(x).
func SigmoidBackward[T Float](dx, y, dy []T) error {
	if err := sameLen("SigmoidBackward", len(dx), "dx, y and dy", len(y), len(dy)); err != nil {
		return err
	}
	for i, v := range y {
		f := float64(v)
		dx[i] = T(float64(dy[i]) * f * (1 - f))
	}
	return nil
}

// DropoutMask fills mask, the row-major block of shape box at offset
// offset of a tensor of global shape global, with 0 (dropped) or 1/(1−p)
// (kept) per element. Whether element e (its row-major index in the
// global tensor) is kept depends only on (seed, step, e): a 64-bit hash
// of the three mapped to [0, 1) is kept when ≥ p. So a block's mask is
// the matching slice of the whole tensor's mask, whichever block and
// whichever rank computes it: ranks holding the same elements (replicated
// or partial) draw the same mask, ranks holding different elements
// (sharded) draw different ones, and any layout equals one rank exactly.
// p must lie in [0, 1); the block must lie inside the global shape.
func DropoutMask[T Float](mask []T, offset, box, global []int, p float64, seed, step uint64) error {
	const op = "DropoutMask"
	if !(p >= 0 && p < 1) {
		return fmt.Errorf("kernels: %s: %w: probability %v outside [0, 1)", op, ErrInvalid, p)
	}
	if len(offset) != len(global) || len(box) != len(global) {
		return fmt.Errorf("kernels: %s: %w: offset %v and size %v for a %d-d tensor", op, ErrInvalid, offset, box, len(global))
	}
	if _, err := size(op, global...); err != nil {
		return err
	}
	n, err := size(op, box...)
	if err != nil {
		return err
	}
	for d := range global {
		if offset[d] < 0 || offset[d]+box[d] > global[d] {
			return fmt.Errorf("kernels: %s: %w: block at %v of size %v outside %v", op, ErrInvalid, offset, box, global)
		}
	}
	if len(mask) != n {
		return fmt.Errorf("kernels: %s: %w: mask of %d elements for a block of %d", op, ErrInvalid, len(mask), n)
	}
	if n == 0 {
		return nil
	}
	keep := T(1 / (1 - p))
	key := mix64(seed ^ mix64(step+0x9e3779b97f4a7c15))
	// Global strides, and the global index of the block's first element.
	st := make([]int, len(global))
	s, base := 1, 0
	for d := len(global) - 1; d >= 0; d-- {
		st[d] = s
		base += offset[d] * s
		s *= global[d]
	}
	idx := make([]int, len(box))
	e := base
	for i := range mask {
		u := float64(mix64(key^uint64(e))>>11) * 0x1p-53
		if u >= p {
			mask[i] = keep
		} else {
			mask[i] = 0
		}
		// Next element of the block, row-major.
		for d := len(box) - 1; d >= 0; d-- {
			idx[d]++
			e += st[d]
			if idx[d] < box[d] {
				break
			}
			e -= idx[d] * st[d]
			idx[d] = 0
		}
	}
	return nil
}

// mix64 is SplitMix64's finaliser: a bijective 64-bit hash.
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// ArgmaxRows sets dst[r] to the index of the largest value of row r of x
// (rows of n values; len(x) = len(dst)·n, n ≥ 1). Ties go to the first
// index; a NaN wins over numbers (the first NaN), as torch.argmax does.
func ArgmaxRows[T Float](dst []int64, x []T, n int) error {
	const op = "ArgmaxRows"
	if n < 1 {
		return fmt.Errorf("kernels: %s: %w: row width %d", op, ErrInvalid, n)
	}
	if len(x) != len(dst)*n {
		return fmt.Errorf("kernels: %s: %w: %d values for %d rows of %d", op, ErrInvalid, len(x), len(dst), n)
	}
	for r := range dst {
		row := x[r*n : (r+1)*n]
		best := 0
		for j := 1; j < n; j++ {
			if row[best] != row[best] {
				break
			}
			if row[j] > row[best] || row[j] != row[j] {
				best = j
			}
		}
		dst[r] = int64(best)
	}
	return nil
}
