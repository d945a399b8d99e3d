// Package numcheck holds loom's one rule per kind of numeric option, so
// that every package rejects the same bad values with the same words
// before any data moves: NaN and ±Inf are never a valid setting, and
// zero or a negative value only where the kind allows it.
//
// Each function returns nil or an error wrapping the caller's sentinel
// (its package's ErrInvalid), naming the option and the value:
//
//	if err := numcheck.Positive(ErrInvalid, "GradientDivideFactor", f); err != nil {
//		return err
//	}
//
// The package is a leaf (standard library only).
package numcheck

import (
	"fmt"
	"math"
)

// Positive accepts a finite v > 0: a factor, a scale, a learning rate
// that must move the weights, an epsilon.
func Positive(sentinel error, name string, v float64) error {
	if !(v > 0) || math.IsInf(v, 1) {
		return fmt.Errorf("%w: %s %v: must be positive and finite", sentinel, name, v)
	}
	return nil
}

// NonNegative accepts a finite v ≥ 0: a weight decay, a momentum, a
// coefficient whose zero turns something off.
func NonNegative(sentinel error, name string, v float64) error {
	if !(v >= 0) || math.IsInf(v, 1) {
		return fmt.Errorf("%w: %s %v: must be zero or positive, and finite", sentinel, name, v)
	}
	return nil
}

// Finite accepts any v that is neither NaN nor ±Inf.
func Finite(sentinel error, name string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return fmt.Errorf("%w: %s %v: must be finite", sentinel, name, v)
	}
	return nil
}

// Fraction accepts 0 ≤ v < 1: a decay rate such as Adam's betas, a
// dropout probability.
func Fraction(sentinel error, name string, v float64) error {
	if !(v >= 0 && v < 1) {
		return fmt.Errorf("%w: %s %v: must be in [0, 1)", sentinel, name, v)
	}
	return nil
}

// Count accepts an integer n ≥ 1: a size, a number of ranks, of steps, of
// buckets.
func Count(sentinel error, name string, n int) error {
	if n < 1 {
		return fmt.Errorf("%w: %s %d: must be at least 1", sentinel, name, n)
	}
	return nil
}

// NonNegativeCount accepts an integer n ≥ 0, where zero has a documented
// meaning (none, off).
func NonNegativeCount(sentinel error, name string, n int) error {
	if n < 0 {
		return fmt.Errorf("%w: %s %d: must be zero or positive", sentinel, name, n)
	}
	return nil
}
