package moegpt_test

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/models/moegpt"
)

// TestConfigNumericOptions: every numeric field moegpt adds to the model
// shape, given NaN, ±Inf, 0 and a negative value (integers: 0 and a
// negative value), is rejected by Validate with ErrConfig naming it,
// except where 0 means something: dropless (CapacityFactor), a loss off
// (AuxCoef, ZCoef), weights starting at 0 (InitStd).
func TestConfigNumericOptions(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	floats := []struct {
		name string
		set  func(c *moegpt.Config, v float64)
	}{
		{"CapacityFactor", func(c *moegpt.Config, v float64) { c.CapacityFactor = v }},
		{"AuxCoef", func(c *moegpt.Config, v float64) { c.AuxCoef = v }},
		{"ZCoef", func(c *moegpt.Config, v float64) { c.ZCoef = v }},
		{"InitStd", func(c *moegpt.Config, v float64) { c.InitStd = v }},
	}
	for _, f := range floats {
		for _, v := range []float64{nan, inf, -inf, 0, -1} {
			c := moegpt.Default()
			f.set(&c, v)
			check(t, f.name, v, c.Validate(), v == 0)
		}
	}
	ints := []struct {
		name string
		set  func(c *moegpt.Config, v int)
	}{
		{"L", func(c *moegpt.Config, v int) { c.L = v }},
		{"E", func(c *moegpt.Config, v int) { c.E = v }},
		{"K", func(c *moegpt.Config, v int) { c.K = v }},
		{"Hd", func(c *moegpt.Config, v int) { c.Hd = v }},
	}
	for _, f := range ints {
		for _, v := range []int{0, -1} {
			c := moegpt.Default()
			f.set(&c, v)
			check(t, f.name, v, c.Validate(), false)
		}
	}
}

func check(t *testing.T, name string, v any, err error, ok bool) {
	t.Helper()
	if ok {
		if err != nil {
			t.Errorf("%s = %v: %v, want it accepted", name, v, err)
		}
		return
	}
	if want := fmt.Sprintf("%s %v: must", name, v); !errors.Is(err, moegpt.ErrConfig) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), want) {
		t.Errorf("%s = %v: %v, want ErrConfig containing %q", name, v, err, want)
	}
}
