package gpt_test

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/models/gpt"
)

// TestConfigNumericOptions: every numeric field of Config, given NaN,
// ±Inf, 0 and a negative value (integers: 0 and a negative value), is
// rejected by Validate with ErrConfig naming it, except where 0 means
// something: no blocks (Layers), weights starting at 0 (InitStd).
func TestConfigNumericOptions(t *testing.T) {
	nan, inf := math.NaN(), math.Inf(1)
	floats := []struct {
		name   string
		set    func(c *gpt.Config, v float64)
		zeroOK bool
	}{
		{"InitStd", func(c *gpt.Config, v float64) { c.InitStd = v }, true},
		{"LNEps", func(c *gpt.Config, v float64) { c.LNEps = v }, false},
	}
	for _, f := range floats {
		for _, v := range []float64{nan, inf, -inf, 0, -1} {
			c := gpt.Tiny()
			f.set(&c, v)
			checkConfig(t, f.name, v, c.Validate(), v == 0 && f.zeroOK, "must")
		}
	}
	ints := []struct {
		name   string
		set    func(c *gpt.Config, v int)
		zeroOK bool
	}{
		{"Vocab", func(c *gpt.Config, v int) { c.Vocab = v }, false},
		{"Width", func(c *gpt.Config, v int) { c.Width = v }, false},
		{"Heads", func(c *gpt.Config, v int) { c.Heads = v }, false},
		{"MLPWidth", func(c *gpt.Config, v int) { c.MLPWidth = v }, false},
		{"SeqLen", func(c *gpt.Config, v int) { c.SeqLen = v }, false},
		{"Layers", func(c *gpt.Config, v int) { c.Layers = v }, true},
	}
	for _, f := range ints {
		for _, v := range []int{0, -1} {
			c := gpt.Tiny()
			f.set(&c, v)
			checkConfig(t, f.name, v, c.Validate(), v == 0 && f.zeroOK, "must")
		}
	}
}

// checkConfig checks Validate's verdict on option name = v.
func checkConfig(t *testing.T, name string, v any, err error, ok bool, word string) {
	t.Helper()
	if ok {
		if err != nil {
			t.Errorf("%s = %v: %v, want it accepted", name, v, err)
		}
		return
	}
	if want := fmt.Sprintf("%s %v: %s", name, v, word); !errors.Is(err, gpt.ErrConfig) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), want) {
		t.Errorf("%s = %v: %v, want ErrConfig containing %q", name, v, err, want)
	}
}
