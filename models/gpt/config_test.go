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

// TestPresets: every preset's shape, its parameters counted by hand with
// and without the embedding tables, and the error for an unknown name.
func TestPresets(t *testing.T) {
	// A block of width D and MLP width F holds 4D² + 2DF + 9D + F
	// parameters (LayerNorms, qkv, proj, fc, mlp proj with biases).
	block := func(d, f int) int { return 4*d*d + 2*d*f + 9*d + f }
	for _, tc := range []struct {
		name          string
		v, d, h, l, f int
		t             int
		matmul, total int
	}{
		{"tiny", 256, 128, 4, 2, 512, 64, 429568, 470528},
		{"gpt2-small", 50304, 768, 12, 12, 3072, 1024, 123689472, 123689472 + (50304+1024)*768},
		{"gpt2-medium", 50304, 1024, 16, 24, 4096, 1024, 24*block(1024, 4096) + 2*1024 + 50304*1024, 0},
		{"gpt2-large", 50304, 1280, 20, 36, 5120, 1024, 36*block(1280, 5120) + 2*1280 + 50304*1280, 0},
		{"gpt2-xl", 50304, 1600, 25, 48, 6400, 1024, 48*block(1600, 6400) + 2*1600 + 50304*1600, 0},
	} {
		c, err := gpt.Preset(tc.name)
		want := gpt.Config{Vocab: tc.v, Width: tc.d, Heads: tc.h, Layers: tc.l, MLPWidth: tc.f, SeqLen: tc.t, InitStd: 0.02, LNEps: 1e-5}
		if err != nil || c != want || c.Validate() != nil {
			t.Errorf("Preset(%q) = %+v, %v; want %+v", tc.name, c, err, want)
		}
		if got := c.MatmulParams(); got != tc.matmul {
			t.Errorf("%s: MatmulParams() = %d, want %d", tc.name, got, tc.matmul)
		}
		if total := c.MatmulParams() + (tc.v+tc.t)*tc.d; c.NumParams() != total || (tc.total != 0 && total != tc.total) {
			t.Errorf("%s: NumParams() = %d, want %d", tc.name, c.NumParams(), total)
		}
	}
	if got := gpt.Presets(); strings.Join(got, " ") != "tiny gpt2-small gpt2-medium gpt2-large gpt2-xl" {
		t.Errorf("Presets() = %v", got)
	}
	if _, err := gpt.Preset("gpt3"); !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), `no preset "gpt3"; the presets are [tiny gpt2-small`) {
		t.Errorf("Preset(gpt3): %v", err)
	}
}
