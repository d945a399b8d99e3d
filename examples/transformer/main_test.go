package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestRun drives the command through its flags on dp=1 × tp=2 with
// sequence parallelism for two steps: the summary, -json, -trace and
// -compare (the one-rank run must agree).
func TestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: trains the tiny GPT for two steps, twice")
	}
	dir := t.TempDir()
	js, tr := filepath.Join(dir, "run.json"), filepath.Join(dir, "trace.json")
	var out bytes.Buffer
	args := []string{"-dp", "1", "-tp", "2", "-sp", "-steps", "2", "-every", "1", "-threads", "1",
		"-json", js, "-trace", tr, "-trace-steps", "1", "-compare"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, out.String())
	}
	for _, want := range []string{"step    1", "step    2", "final loss", "largest loss difference", "trace of the last 1 step(s)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	var res result
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	if res.DP != 1 || res.TP != 2 || !res.SP || res.Steps != 2 || len(res.Losses) != 2 || res.FinalLoss != res.Losses[1] || !(res.TokensPerS > 0) ||
		res.Backend != "local" || res.Processes != 1 || res.WorldSize != 2 {
		t.Errorf("-json wrote %+v", res)
	}
	var trace struct {
		TraceEvents []map[string]any `json:"traceEvents"`
	}
	if b, err = os.ReadFile(tr); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &trace); err != nil || len(trace.TraceEvents) == 0 {
		t.Errorf("trace: %d events, %v", len(trace.TraceEvents), err)
	}
}

// TestParse: bad flags and layouts are rejected by parse, before any rank
// starts, with one message naming what is wrong and what would work.
func TestParse(t *testing.T) {
	ref := tinygpt.Default()
	for _, tc := range []struct {
		args []string
		want []string // substrings of the one message, each once
	}{
		{[]string{"-tp", "3"}, []string{"heads (4) must be divisible by tp (3); tp can be 1, 2 or 4"}},
		{[]string{"-tp", "256"}, []string{"heads (4) must be divisible by tp (256); tp can be 1, 2 or 4"}},
		{[]string{"-dp", "3"}, []string{"dp (3) must divide the batch (16 sequences); dp can be 1, 2, 4, 8 or 16"}},
		{[]string{"-dp", "0"}, []string{"dp (0) and tp (2) must be at least 1"}},
		{[]string{"-tp", "1", "-sp"}, []string{"sequence parallelism needs tp of at least 2 (tp is 1)"}},
		{[]string{"-steps", "0"}, []string{"-steps 0; want at least 1"}},
		{[]string{"-steps", "-1"}, []string{"-steps -1"}},
		{[]string{"-every", "0"}, []string{"-every 0"}},
		{[]string{"-threads", "-2"}, []string{"-threads -2"}},
		{[]string{"-trace-steps", "0"}, []string{"-trace-steps 0"}},
		{[]string{"-peak", "-1"}, []string{"-peak -1: must be zero or positive"}},
		{[]string{"-peak", "NaN"}, []string{"-peak NaN"}},
		{[]string{"extra"}, []string{"unexpected arguments"}},
		{[]string{"-fsdp", "3", "-dp", "1"}, []string{"dp × fsdp (1 × 3) must divide the batch (16 sequences); their product can be 1, 2, 4, 8 or 16"}},
		{[]string{"-fsdp", "0"}, []string{"-fsdp 0; want at least 1"}},
		{[]string{"-fsdp", "4", "-dp", "1", "-reshard", "3"}, []string{"-reshard 3 must divide -fsdp (4); it can be 1, 2 or 4"}},
		{[]string{"-fsdp", "2", "-reshard", "yes"}, []string{`-reshard "yes"; want true, false or a group size`}},
		{[]string{"-fsdp", "2", "-zero", "4"}, []string{"-zero 4; want 1, 2 or 3"}},
		{[]string{"-fsdp", "2", "-mp", "fp16"}, []string{`-mp "fp16"; want bf16`}},
		{[]string{"-zero", "2"}, []string{"apply to fully sharded data parallelism: set -fsdp to 2 or more"}},
		{[]string{"-ac", "some"}, []string{`-ac "some"; want none, full or selective`}},
		// The model's shape: presets, overrides, and the layout checked
		// against the shape asked for.
		{[]string{"-model", "gpt5"}, []string{`-model "gpt5"; want tiny, gpt2-small, gpt2-medium, gpt2-large, gpt2-xl`}},
		{[]string{"-width", "0"}, []string{"-width 0: must be at least 1"}},
		{[]string{"-layers", "-1", "-heads", "-2"}, []string{"-layers -1: must be zero or positive", "-heads -2: must be at least 1"}},
		{[]string{"-width", "130"}, []string{"Width=130 is not divisible by Heads=4"}},
		{[]string{"-vocab", "100"}, []string{"V=100 is below 128"}},
		{[]string{"-batch", "6", "-dp", "4"}, []string{"dp (4) must divide the batch (6 sequences); dp can be 1, 2, 3 or 6"}},
		{[]string{"-model", "gpt2-small", "-tp", "8"}, []string{"heads (12) must be divisible by tp (8); tp can be 1, 2, 3, 4, 6 or 12"}},
		{[]string{"-model", "gpt2-small", "-dp", "3"}, []string{"dp (3) must divide the batch (8 sequences); dp can be 1, 2, 4 or 8"}},
		{[]string{"-seq", "63", "-sp"}, []string{"sequence length (63) must be divisible by tp (2); tp can be 1, 3, 7, 9, 21 or 63"}},
		{[]string{"-model", "gpt2-small", "-heads", "5"}, []string{"Width=768 is not divisible by Heads=5"}},
	} {
		_, err := parse(tc.args, io.Discard, ref)
		if err == nil {
			t.Errorf("parse(%q) accepted", tc.args)
			continue
		}
		for _, w := range tc.want {
			if strings.Count(err.Error(), w) != 1 {
				t.Errorf("parse(%q): %q; want %q once", tc.args, err, w)
			}
		}
	}
	o, err := parse(nil, io.Discard, ref)
	if err != nil || o.dp != 2 || o.fsdp != 1 || o.tp != 2 || o.ac != "none" || o.zero != 3 || o.loop.Steps != ref.Steps || o.loop.Ranks != 4 || o.loop.Tokens != ref.B*ref.T ||
		!o.fixture || o.cfg != gpt.FromReference(ref) || o.run != ref {
		t.Errorf("defaults: %+v, %v", o, err)
	}
}

// TestParseShape: -model picks a preset, each override flag replaces its
// field and nothing else, and only the reference's shape, batch and init
// (no -seed) is the fixture run.
func TestParseShape(t *testing.T) {
	ref := tinygpt.Default()
	tiny := gpt.FromReference(ref)
	small, err := gpt.Preset("gpt2-small")
	if err != nil {
		t.Fatal(err)
	}
	with := func(c gpt.Config, f func(*gpt.Config)) gpt.Config { f(&c); return c }
	for _, tc := range []struct {
		args    []string
		cfg     gpt.Config
		batch   int
		fixture bool
	}{
		{nil, tiny, 16, true},
		{[]string{"-model", "tiny"}, tiny, 16, true},
		{[]string{"-layers", "2", "-width", "128", "-batch", "16"}, tiny, 16, true}, // the reference's values, set explicitly
		{[]string{"-seed", "1"}, tiny, 16, false},
		{[]string{"-batch", "8"}, tiny, 8, false},
		{[]string{"-layers", "0"}, with(tiny, func(c *gpt.Config) { c.Layers = 0 }), 16, false},
		{[]string{"-model", "gpt2-small"}, small, 8, false},
		{[]string{"-model", "gpt2-small", "-layers", "2", "-seq", "128", "-batch", "4"}, with(small, func(c *gpt.Config) { c.Layers, c.SeqLen = 2, 128 }), 4, false},
		{[]string{"-layers", "1", "-width", "32", "-heads", "2", "-ff", "64", "-seq", "16", "-vocab", "128"},
			gpt.Config{Vocab: 128, Width: 32, Heads: 2, Layers: 1, MLPWidth: 64, SeqLen: 16, InitStd: 0.02, LNEps: 1e-5}, 16, false},
	} {
		o, err := parse(tc.args, io.Discard, ref)
		if err != nil {
			t.Errorf("parse(%q): %v", tc.args, err)
			continue
		}
		if o.cfg != tc.cfg || o.run.B != tc.batch || o.fixture != tc.fixture || o.loop.Tokens != tc.batch*tc.cfg.SeqLen {
			t.Errorf("parse(%q): model %+v, batch %d, fixture %v, tokens %d; want %+v, %d, %v", tc.args, o.cfg, o.run.B, o.fixture, o.loop.Tokens, tc.cfg, tc.batch, tc.fixture)
		}
	}
}

// TestRunShape trains a small custom shape from a random init on random
// tokens for five steps on dp=2 × tp=2, with -compare (the one-rank run
// must agree) and -json: the first line says where the init and the data
// come from, the loss stays at ln V (random tokens cannot be learnt; on
// the corpus, whose bytes are below 128, it falls by half a nat in these
// steps), and the MFU line and fields are filled.
func TestRunShape(t *testing.T) {
	js := filepath.Join(t.TempDir(), "run.json")
	var out bytes.Buffer
	args := []string{"-dp", "2", "-tp", "2", "-layers", "1", "-width", "32", "-heads", "2", "-ff", "64", "-seq", "16", "-vocab", "4096", "-batch", "4",
		"-steps", "5", "-every", "1", "-threads", "1", "-compare", "-json", js, "-peak", "0.5"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, out.String())
	}
	first, _, _ := strings.Cut(out.String(), "\n")
	for _, want := range []string{"V=4096 D=32 H=2 L=1 F=64 T=16", "batch 4×16", "-model tiny changed by flags (", "random init on random tokens (seed 1"} {
		if !strings.Contains(first, want) {
			t.Errorf("first line %q lacks %q", first, want)
		}
	}
	for _, want := range []string{"MFU ", "/token", "-peak 0.5 TFLOP/s", "largest loss difference"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "pytorch") {
		t.Errorf("a random model printed PyTorch's losses:\n%s", out.String())
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var res result
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	cfg := gpt.Config{Vocab: 4096, Width: 32, Heads: 2, Layers: 1, MLPWidth: 64, SeqLen: 16}
	// 6·N + 12·L·D·T, N without the embedding tables.
	n := cfg.NumParams() - (4096+16)*32
	wantFPT := float64(6*n + 12*1*32*16)
	if len(res.Losses) != 5 || math.IsNaN(res.FinalLoss) || math.IsInf(res.FinalLoss, 0) || res.Params != cfg.NumParams() ||
		res.FlopsPerToken != wantFPT || res.PeakFLOPS != 0.5e12 || !(res.MFU.MFU > 0) || res.PeakSource == "" {
		t.Errorf("-json wrote %s", b)
	}
	if d := res.FinalLoss - math.Log(4096); d > 0.1 || d < -0.1 {
		t.Errorf("final loss %v, want ln 4096 = %.3f ± 0.1 on random tokens", res.FinalLoss, math.Log(4096))
	}
}

// TestRunEnvironment: a contradictory launch environment stops the command
// before any rank starts, naming the variable and the layout.
func TestRunEnvironment(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		args []string
		want string
	}{
		{map[string]string{"WORLD_SIZE": "4"}, nil, "WORLD_SIZE=4 is set but RANK is not"},
		{map[string]string{"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
			[]string{"-dp", "2", "-tp", "2"}, "-dp 2 -tp 2: launch: invalid job: WORLD_SIZE=2 but the layout needs 4 ranks"},
		{map[string]string{"LOOM_BACKEND": "gloo"}, nil, `LOOM_BACKEND="gloo"`},
	} {
		for k, v := range c.env {
			t.Setenv(k, v)
		}
		err := run(context.Background(), c.args, io.Discard)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("env %v: %v, want an error containing %q", c.env, err, c.want)
		}
		for k := range c.env {
			t.Setenv(k, "")
		}
	}
}
