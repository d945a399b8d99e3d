package checked

import (
	"fmt"
	"math"
	"math/big"
	"testing"
)

// fits reports whether the exact big value is an int.
func fits(b *big.Int) bool {
	return b.IsInt64() && b.Int64() >= math.MinInt && b.Int64() <= math.MaxInt
}

var edges = []int{0, 1, -1, 2, -2, 3, 1 << 31, -(1 << 31), 1 << 32, 3037000499, 3037000500, -3037000500,
	math.MaxInt / 2, math.MaxInt/2 + 1, math.MaxInt, math.MinInt, math.MinInt + 1, math.MinInt / 2}

// Mul and Add agree with exact arithmetic on every pair of edge values.
func TestMulAddAgreeWithBigInts(t *testing.T) {
	for _, a := range edges {
		for _, b := range edges {
			bm := new(big.Int).Mul(big.NewInt(int64(a)), big.NewInt(int64(b)))
			if got, ok := Mul(a, b); ok != fits(bm) || (ok && int64(got) != bm.Int64()) {
				t.Errorf("Mul(%d, %d) = %d, %v; exact %v", a, b, got, ok, bm)
			}
			ba := new(big.Int).Add(big.NewInt(int64(a)), big.NewInt(int64(b)))
			if got, ok := Add(a, b); ok != fits(ba) || (ok && int64(got) != ba.Int64()) {
				t.Errorf("Add(%d, %d) = %d, %v; exact %v", a, b, got, ok, ba)
			}
		}
	}
}

func TestProduct(t *testing.T) {
	for _, tc := range []struct {
		dims []int
		want int
		ok   bool
	}{
		{nil, 1, true},
		{[]int{3, 4}, 12, true},
		{[]int{5, 0, 7}, 0, true},
		{[]int{1 << 31, 1 << 31, 1 << 31}, 0, false},
		{[]int{1 << 32, 1 << 32}, 0, false}, // wraps to exactly 0
		{[]int{math.MaxInt, 2}, 0, false},
		{[]int{math.MaxInt, 1}, math.MaxInt, true},
		// Strict: the non-zero dims must fit, in any order.
		{[]int{1 << 32, 1 << 32, 0}, 0, false},
		{[]int{0, 1 << 32, 1 << 32}, 0, false},
		{[]int{2, -3}, 0, false},
	} {
		t.Run(fmt.Sprint(tc.dims), func(t *testing.T) {
			got, ok := Product(tc.dims)
			if got != tc.want || ok != tc.ok {
				t.Errorf("Product(%v) = %d, %v; want %d, %v", tc.dims, got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestSum(t *testing.T) {
	for _, tc := range []struct {
		v    []int
		want int
		ok   bool
	}{
		{nil, 0, true},
		{[]int{1, 2, 3}, 6, true},
		{[]int{math.MaxInt, math.MaxInt, 1, 1}, 0, false}, // wraps to exactly 0
		{[]int{math.MaxInt, 1}, 0, false},
		{[]int{math.MaxInt, -1, 1}, math.MaxInt, true},
		{[]int{math.MinInt, -1}, 0, false},
	} {
		t.Run(fmt.Sprint(tc.v), func(t *testing.T) {
			got, ok := Sum(tc.v)
			if got != tc.want || ok != tc.ok {
				t.Errorf("Sum(%v) = %d, %v; want %d, %v", tc.v, got, ok, tc.want, tc.ok)
			}
		})
	}
}
