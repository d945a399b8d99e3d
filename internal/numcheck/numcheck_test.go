package numcheck

import (
	"errors"
	"math"
	"testing"
)

var errBad = errors.New("bad")

func TestRules(t *testing.T) {
	inf, nan := math.Inf(1), math.NaN()
	cases := []struct {
		name string
		rule func(error, string, float64) error
		ok   []float64
		bad  []float64
	}{
		{"Positive", Positive, []float64{1e-300, 1, 3.5e38}, []float64{0, -1, nan, inf, -inf, math.Copysign(0, -1)}},
		{"NonNegative", NonNegative, []float64{0, 1e-300, 7}, []float64{-1e-300, nan, inf, -inf}},
		{"Finite", Finite, []float64{-1, 0, 1}, []float64{nan, inf, -inf}},
		{"Fraction", Fraction, []float64{0, 0.5, 0.999}, []float64{1, -0.1, nan, inf}},
	}
	for _, c := range cases {
		for _, v := range c.ok {
			if err := c.rule(errBad, "x", v); err != nil {
				t.Errorf("%s(%v) = %v, want nil", c.name, v, err)
			}
		}
		for _, v := range c.bad {
			if err := c.rule(errBad, "x", v); !errors.Is(err, errBad) {
				t.Errorf("%s(%v) = %v, want an error matching the sentinel", c.name, v, err)
			}
		}
	}
}

func TestCounts(t *testing.T) {
	for _, c := range []struct {
		rule    func(error, string, int) error
		ok, bad []int
		name    string
	}{
		{Count, []int{1, 9}, []int{0, -1}, "Count"},
		{NonNegativeCount, []int{0, 9}, []int{-1, -9}, "NonNegativeCount"},
	} {
		for _, n := range c.ok {
			if err := c.rule(errBad, "n", n); err != nil {
				t.Errorf("%s(%d) = %v", c.name, n, err)
			}
		}
		for _, n := range c.bad {
			if err := c.rule(errBad, "n", n); !errors.Is(err, errBad) {
				t.Errorf("%s(%d) = %v, want the sentinel", c.name, n, err)
			}
		}
	}
}
