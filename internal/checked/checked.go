// Package checked is integer arithmetic that reports overflow instead of
// wrapping. loom forms products and sums of user-given dims (element
// counts, byte counts, offsets, row totals) in many places; an int that
// wraps there does not fail, it silently sizes a buffer wrong or moves
// nothing. Every such product or sum goes through this package, so that an
// overflow becomes an error before any allocation or data movement.
//
// The package is a leaf (standard library only).
package checked

// Mul returns a·b and whether it fits in an int.
func Mul(a, b int) (int, bool) {
	if a == 0 || b == 0 {
		return 0, true
	}
	c := a * b
	// The sign test catches MinInt·-1, whose quotient wraps back to a.
	if c/b != a || (c < 0) != ((a < 0) != (b < 0)) {
		return c, false
	}
	return c, true
}

// Add returns a+b and whether it fits in an int.
func Add(a, b int) (int, bool) {
	c := a + b
	if (c > a) != (b > 0) {
		return c, false
	}
	return c, true
}

// Product returns the product of dims (1 for none) and whether it fits in
// an int. Dims are sizes: a negative dim reports false. The rule is the
// strict one, independent of the order of dims: the product of the
// non-zero dims must fit, even when a zero dim makes the product 0. So
// every sub-product of a shape that passes (a block's size, a stride, the
// size of all dims but one) fits too.
func Product(dims []int) (int, bool) {
	n, zero := 1, false
	for _, d := range dims {
		switch {
		case d < 0:
			return 0, false
		case d == 0:
			zero = true
		default:
			var ok bool
			if n, ok = Mul(n, d); !ok {
				return 0, false
			}
		}
	}
	if zero {
		return 0, true
	}
	return n, true
}

// Sum returns the sum of v (0 for none) and whether every partial sum, in
// order, fits in an int.
func Sum(v []int) (int, bool) {
	n := 0
	for _, x := range v {
		var ok bool
		if n, ok = Add(n, x); !ok {
			return 0, false
		}
	}
	return n, true
}
