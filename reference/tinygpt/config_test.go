package tinygpt

import (
	"math"
	"strconv"
	"strings"
	"testing"
)

func TestDefault(t *testing.T) {
	c := Default()
	// The "value here" column of reference/TINY_GPT.md §1.
	for _, tc := range []struct {
		sym       string
		got, want any
	}{
		{"V", c.V, 256}, {"D", c.D, 128}, {"H", c.H, 4}, {"Dh", c.HeadDim(), 32},
		{"L", c.L, 2}, {"F", c.F, 512}, {"T", c.T, 64}, {"B", c.B, 16},
		{"CORPUS_LEN", c.CorpusLen, 131072}, {"CORPUS_SEED", c.CorpusSeed, uint32(20240601)},
		{"BATCH_SEED", c.BatchSeed, uint32(12345)},
		{"lr", c.LR, 3e-3}, {"wd", c.WD, 0.01}, {"beta1", c.Beta1, 0.9}, {"beta2", c.Beta2, 0.999},
		{"eps", c.Eps, 1e-8}, {"steps", c.Steps, 200},
		{"init_std", c.InitStd, 0.02}, {"ln_eps", c.LNEps, 1e-5},
		{"CORPUS_LEN−T−1", c.OffsetRange(), 131007},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %v, want %v", tc.sym, tc.got, tc.want)
		}
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Default().Validate() = %v", err)
	}
}

func TestDefaultMatchesFixture(t *testing.T) {
	fx := loadFixture(t)
	cfg, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	if cfg != Default() {
		t.Errorf("fixture config %+v\n!= Default() %+v", cfg, Default())
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		modify func(*Config)
		want   []string // substrings of the error; none means valid
	}{
		{"default", func(*Config) {}, nil},
		{"tiny but valid", func(c *Config) { c.D, c.H, c.L, c.F, c.T, c.B, c.CorpusLen = 8, 2, 1, 16, 4, 2, 6 }, nil},
		{"no blocks", func(c *Config) { c.L = 0 }, nil},
		{"D not divisible by H", func(c *Config) { c.D = 130 }, []string{"D=130 is not divisible by H=4"}},
		{"H zero", func(c *Config) { c.H = 0 }, []string{"H=0 must be positive"}},
		{"small vocabulary", func(c *Config) { c.V = 100 }, []string{"V=100"}},
		{"negative L", func(c *Config) { c.L = -1 }, []string{"L=-1"}},
		{"F zero", func(c *Config) { c.F = 0 }, []string{"F=0"}},
		{"B zero", func(c *Config) { c.B = 0 }, []string{"B=0"}},
		{"T zero", func(c *Config) { c.T = 0 }, []string{"T=0"}},
		{"corpus too short", func(c *Config) { c.CorpusLen = 65 }, []string{"CORPUS_LEN=65 must be at least T+2=66"}},
		{"steps zero", func(c *Config) { c.Steps = 0 }, []string{"steps=0"}},
		{"lr zero", func(c *Config) { c.LR = 0 }, []string{"lr=0 must be positive"}},
		{"lr NaN", func(c *Config) { c.LR = math.NaN() }, []string{"lr=NaN must be finite"}},
		{"decay too large", func(c *Config) { c.LR, c.WD = 1, 2 }, []string{"lr·wd=2"}},
		{"beta1 one", func(c *Config) { c.Beta1 = 1 }, []string{"beta1=1 must be in [0, 1)"}},
		{"beta2 negative", func(c *Config) { c.Beta2 = -0.5 }, []string{"beta2=-0.5"}},
		{"eps zero", func(c *Config) { c.Eps = 0 }, []string{"eps=0"}},
		{"init_std negative", func(c *Config) { c.InitStd = -1 }, []string{"init_std=-1"}},
		{"ln_eps zero", func(c *Config) { c.LNEps = 0 }, []string{"ln_eps=0"}},
		{"several at once", func(c *Config) { c.D, c.B, c.Eps = 7, 0, -1 },
			[]string{"D=7 is not divisible by H=4", "B=0", "eps=-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Default()
			tc.modify(&c)
			err := c.Validate()
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate() = nil, want an error containing %q", tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if !strings.HasPrefix(err.Error(), "tinygpt: config: ") {
				t.Errorf("error %q lacks the tinygpt: config: prefix", err)
			}
		})
	}
}

func TestValidateCorpusTooLong(t *testing.T) {
	if strconv.IntSize < 64 {
		t.Skip("int cannot exceed the 32-bit range")
	}
	c := Default()
	c.CorpusLen = math.MaxInt
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "does not fit the 32-bit LCG") {
		t.Errorf("Validate() = %v", err)
	}
}

// TrainFLOPs counted by hand for a tiny config: B=1, T=2, D=2, F=4, V=3,
// L=1. Weights: qkv 12 + proj 4 + MLP 16 + lm_head 6 = 38, so 6·38·2 =
// 456; attention: 3 causal scores, two products of 2·D·3 = 12 each in
// forward, three times that with backward: 72.
func TestTrainFLOPs(t *testing.T) {
	c := Config{B: 1, T: 2, D: 2, F: 4, V: 3, L: 1}
	if got := c.TrainFLOPs(); got != 456+72 {
		t.Errorf("TrainFLOPs = %v, want %v", got, 456+72)
	}
}
