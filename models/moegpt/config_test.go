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

// TestPresets: the presets' shapes, the active parameters per token
// counted by hand (K of E experts, no embedding tables), and the error
// for an unknown name.
func TestPresets(t *testing.T) {
	// Per block: ln1, ln2 (4D), qkv (3D²+3D), proj (D²+D), router (E·D),
	// and K experts of W1, b1, W2, b2 (2·Hd·D + Hd + D each); then ln_f
	// (2D) and lm_head (V·D).
	active := func(v, d, l, e, k, hd int) int {
		return l*(4*d+3*d*d+3*d+d*d+d+e*d+k*(2*hd*d+hd+d)) + 2*d + v*d
	}
	for _, tc := range []struct {
		name                    string
		v, d, h, l, t, e, k, hd int
		active                  int
	}{
		// 2·(17408 + 33152) + 128 + 16384 = 117632.
		{"tiny", 256, 64, 4, 2, 64, 8, 2, 128, 117632},
		{"gpt2-small", 50304, 768, 12, 12, 1024, 8, 2, 3072, active(50304, 768, 12, 8, 2, 3072)},
		{"gpt2-medium", 50304, 1024, 16, 24, 1024, 8, 2, 4096, active(50304, 1024, 24, 8, 2, 4096)},
	} {
		c, err := moegpt.Preset(tc.name)
		if err != nil || c.V != tc.v || c.D != tc.d || c.H != tc.h || c.L != tc.l || c.T != tc.t || c.E != tc.e || c.K != tc.k || c.Hd != tc.hd || c.Validate() != nil {
			t.Errorf("Preset(%q) = %+v, %v", tc.name, c, err)
		}
		if got := c.ActiveParams(); got != tc.active || got != active(tc.v, tc.d, tc.l, tc.e, tc.k, tc.hd) {
			t.Errorf("%s: ActiveParams() = %d, want %d", tc.name, got, tc.active)
		}
	}
	if _, err := moegpt.Preset("huge"); !errors.Is(err, moegpt.ErrConfig) || !strings.Contains(err.Error(), `no preset "huge"; the presets are [tiny gpt2-small gpt2-medium]`) {
		t.Errorf("Preset(huge): %v", err)
	}
}
