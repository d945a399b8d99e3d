package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// tiny is a configuration that trains a few steps in milliseconds.
func tiny() moegpt.Config {
	c := moegpt.Default()
	c.D, c.H, c.L, c.T = 16, 2, 2, 16
	c.E, c.K, c.Hd = 4, 2, 16
	return c
}

// tinyRun is its run: 8 sequences a step, a larger learning rate.
func tinyRun() tinygpt.Config {
	r := tinygpt.Default()
	r.B, r.LR = 8, 1e-2
	return r
}

// TestTrains runs a few steps of the tiny model on one rank, on ep = 2 and
// on dp = 2 × ep = 2, and checks that the loss falls and that the layouts
// agree with one rank (dropless routing: only float32 rounding differs).
func TestTrains(t *testing.T) {
	ctx := context.Background()
	const steps = 12
	var ref *result
	for _, l := range []struct{ dp, ep int }{{1, 1}, {1, 2}, {2, 2}} {
		o := options{dp: l.dp, ep: l.ep, run: tinyRun(), loop: train.Loop{Ranks: l.dp * l.ep, Steps: steps, Every: steps, Tokens: 1, Flags: train.Flags{Threads: 1, TraceSteps: 1}}}
		job, err := launch.InProcess(o.loop.Ranks)
		if err != nil {
			t.Fatal(err)
		}
		res, params, err := trainLayout(ctx, job, tiny(), moegpt.RandomInit(tiny(), 3), o, io.Discard)
		if err != nil {
			t.Fatalf("dp=%d ep=%d: %v", l.dp, l.ep, err)
		}
		if len(res.CE) != steps || len(params) != len(tiny().Params()) {
			t.Fatalf("dp=%d ep=%d: %d losses, %d parameters", l.dp, l.ep, len(res.CE), len(params))
		}
		// ln 256 ≈ 5.5 at the start; a dozen AdamW steps at lr 1e-2
		// learn the byte frequencies, well over half a nat.
		if first, last := res.CE[0], res.CE[steps-1]; !(last < first-0.5) {
			t.Errorf("dp=%d ep=%d: cross-entropy %v -> %v: the loss did not fall", l.dp, l.ep, first, last)
		}
		t.Logf("dp=%d ep=%d: cross-entropy %.4f -> %.4f", l.dp, l.ep, res.CE[0], res.CE[steps-1])
		if ref == nil {
			ref = res
			continue
		}
		for s := range steps {
			if d := res.Losses[s] - ref.Losses[s]; d > 1e-4 || d < -1e-4 {
				t.Errorf("dp=%d ep=%d step %d: loss %v, one rank %v", l.dp, l.ep, s+1, res.Losses[s], ref.Losses[s])
			}
		}
	}
}

// TestRun drives the command through its flags: ep = 2 with a capacity
// factor, -diag, -json, -trace and -compare, on the tiny model's default
// sizes for two steps.
func TestRun(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: trains the default model for two steps, twice")
	}
	dir := t.TempDir()
	js, tr := filepath.Join(dir, "run.json"), filepath.Join(dir, "trace.json")
	var out bytes.Buffer
	args := []string{"-ep", "2", "-steps", "2", "-every", "1", "-capacity", "1.5", "-diag", "-threads", "1",
		"-json", js, "-trace", tr, "-trace-steps", "1", "-compare"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	for _, want := range []string{"step    2", "balance max/mean", "padded", "wait ", "fused dispatch and combine", "send matrix", "largest loss difference", "MoE payload passes"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var res result
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	if res.EP != 2 || len(res.Losses) != 2 || res.LossDiff == nil || res.Backend != "local" || res.Processes != 1 || res.WorldSize != 2 || res.TimeUS["fused"] <= 0 || res.TimeUS["payload_exchange"] != 0 || res.TimeUS["wait"] <= 0 {
		t.Errorf("-json wrote %s", b)
	}
	if fi, err := os.Stat(tr); err != nil || fi.Size() == 0 {
		t.Errorf("-trace: %v", err)
	}

	// -collectives: the all-to-all-v path computes the same losses as
	// the fused one (the same rows summed in the same order).
	js2 := filepath.Join(dir, "run2.json")
	out.Reset()
	args = []string{"-ep", "2", "-steps", "2", "-every", "1", "-capacity", "1.5", "-threads", "1", "-json", js2, "-collectives"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("-collectives: %v\n%s", err, out.String())
	}
	b, err = os.ReadFile(js2)
	if err != nil {
		t.Fatal(err)
	}
	var coll result
	if err := json.Unmarshal(b, &coll); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(coll.Losses, res.Losses) {
		t.Errorf("-collectives losses %v, fused %v", coll.Losses, res.Losses)
	}
}

// TestParse: bad flags and layouts are rejected by parse, before any rank
// starts, with one message naming what is wrong and what would work.
func TestParse(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want []string // substrings of the one message
	}{
		{[]string{"-ep", "0"}, []string{"dp (1) and ep (0) must be at least 1"}},
		{[]string{"-ep", "3"}, []string{"ep (3) must divide the experts (8); ep can be 1, 2, 4 or 8"}},
		{[]string{"-ep", "256"}, []string{"ep (256) must divide the experts (8)", "dp × ep (1 × 256) must divide the batch (16 sequences)"}},
		{[]string{"-dp", "3", "-ep", "2"}, []string{"dp × ep (3 × 2) must divide the batch (16 sequences); dp × ep can be 1, 2, 4, 8 or 16"}},
		{[]string{"-experts", "6", "-ep", "4"}, []string{"ep (4) must divide the experts (6); ep can be 1, 2, 3 or 6"}},
		{[]string{"-topk", "9"}, []string{"K=9"}},
		{[]string{"-steps", "0"}, []string{"-steps 0; want at least 1"}},
		{[]string{"-every", "0"}, []string{"-every 0"}},
		{[]string{"-threads", "-1"}, []string{"-threads -1"}},
		{[]string{"-trace-steps", "0"}, []string{"-trace-steps 0"}},
		{[]string{"-capacity", "-1"}, []string{"-capacity"}},
		{[]string{"extra"}, []string{"unexpected arguments"}},
		{[]string{"-peak", "-3"}, []string{"-peak -3: must be zero or positive"}},
		{[]string{"-model", "gpt5"}, []string{`-model "gpt5"; want tiny, gpt2-small, gpt2-medium`}},
		{[]string{"-width", "0", "-batch", "-1"}, []string{"-width 0: must be at least 1", "-batch -1: must be at least 1"}},
		{[]string{"-layers", "0"}, []string{"L 0: must be at least 1"}},
		{[]string{"-width", "66"}, []string{"D=66 is not divisible by H=4"}},
		{[]string{"-vocab", "64"}, []string{"V=64 is below 128"}},
		{[]string{"-batch", "6", "-ep", "4"}, []string{"dp × ep (1 × 4) must divide the batch (6 sequences); dp × ep can be 1, 2, 3 or 6"}},
		{[]string{"-model", "gpt2-small", "-dp", "3", "-ep", "1"}, []string{"dp × ep (3 × 1) must divide the batch (8 sequences)"}},
	} {
		_, _, err := parse(tc.args, io.Discard)
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
	o, cfg, err := parse(nil, io.Discard)
	if err != nil || o.dp != 1 || o.ep != 4 || o.loop.Steps != 100 || o.capacity != 0 || o.loop.Ranks != 4 || cfg.E != 8 {
		t.Errorf("defaults: %+v, %v", o, err)
	}
	if err := runConfig(context.Background(), tiny(), options{dp: 1, ep: 3, run: tinyRun(), loop: train.Loop{Steps: 1, Every: 1, Flags: train.Flags{TraceSteps: 1}}}, io.Discard); err == nil {
		t.Error("4 experts over 3 ranks accepted")
	}
}

// TestParseShape: -model picks a preset, each override flag replaces its
// field, the expert flags still apply, and any shape or batch but the
// tiny preset's trains on random tokens.
func TestParseShape(t *testing.T) {
	def := moegpt.Default()
	small, err := moegpt.Preset("gpt2-small")
	if err != nil {
		t.Fatal(err)
	}
	with := func(c moegpt.Config, f func(*moegpt.Config)) moegpt.Config { f(&c); return c }
	for _, tc := range []struct {
		args   []string
		cfg    moegpt.Config
		batch  int
		random bool
	}{
		{nil, def, 16, false},
		{[]string{"-experts", "4", "-topk", "1"}, with(def, func(c *moegpt.Config) { c.E, c.K = 4, 1 }), 16, false},
		{[]string{"-width", "64", "-batch", "16"}, def, 16, false}, // the tiny preset's values, set explicitly
		{[]string{"-batch", "8"}, def, 8, true},
		{[]string{"-layers", "1", "-ff", "32"}, with(def, func(c *moegpt.Config) { c.L, c.Hd = 1, 32 }), 16, true},
		{[]string{"-model", "gpt2-small"}, small, 8, true},
		{[]string{"-model", "gpt2-small", "-seq", "256", "-vocab", "1024", "-heads", "6"}, with(small, func(c *moegpt.Config) { c.T, c.V, c.H = 256, 1024, 6 }), 8, true},
	} {
		o, cfg, err := parse(tc.args, io.Discard)
		if err != nil {
			t.Errorf("parse(%q): %v", tc.args, err)
			continue
		}
		if cfg != tc.cfg || o.run.B != tc.batch || o.random != tc.random || o.loop.Tokens != tc.batch*tc.cfg.T {
			t.Errorf("parse(%q): model %+v, batch %d, random %v, tokens %d; want %+v, %d, %v", tc.args, cfg, o.run.B, o.random, o.loop.Tokens, tc.cfg, tc.batch, tc.random)
		}
	}
}

// TestRunShape trains a small custom shape on random tokens for five
// steps on dp=2 × ep=2 with -compare and -json: the first line says where
// the data come from, the cross-entropy stays at ln V (random tokens
// cannot be learnt; on the corpus, whose bytes are below 128, it falls
// by a quarter of a nat in these steps), and the MFU counts the active
// parameters (K of E experts per token) on one host's peak (in-process
// ranks share its CPUs).
func TestRunShape(t *testing.T) {
	js := filepath.Join(t.TempDir(), "run.json")
	var out bytes.Buffer
	args := []string{"-dp", "2", "-ep", "2", "-layers", "1", "-width", "16", "-heads", "2", "-ff", "16", "-seq", "16", "-vocab", "4096", "-batch", "4",
		"-experts", "4", "-steps", "5", "-every", "1", "-threads", "1", "-compare", "-json", js, "-peak", "0.25"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("run %v: %v\n%s", args, err, out.String())
	}
	first, _, _ := strings.Cut(out.String(), "\n")
	for _, want := range []string{"V=4096 D=16 H=2 L=1, E=4 experts of width 16, top-2", "batch 4×16", "random tokens (seed 1"} {
		if !strings.Contains(first, want) {
			t.Errorf("first line %q lacks %q", first, want)
		}
	}
	for _, want := range []string{"MFU ", "-peak 0.25 TFLOP/s", "largest loss difference"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	b, err := os.ReadFile(js)
	if err != nil {
		t.Fatal(err)
	}
	var res result
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	// Active parameters by hand: ln1, qkv, proj, ln2, router, two of the
	// four experts (W1, b1, W2, b2), ln_f and lm_head; not wte, wpe.
	const d, hd, v, seq = 16, 16, 4096, 16
	active := 2*d + 3*d*d + 3*d + d*d + d + 2*d + 4*d + 2*(hd*d+hd+d*hd+d) + 2*d + v*d
	wantFPT := float64(6*active + 12*1*d*seq)
	if d := res.FinalCE - math.Log(v); d > 0.1 || d < -0.1 {
		t.Errorf("final cross-entropy %v, want ln %d = %.3f ± 0.1 on random tokens", res.FinalCE, v, math.Log(v))
	}
	if len(res.Losses) != 5 || math.IsNaN(res.FinalLoss) || math.IsInf(res.FinalLoss, 0) || res.FlopsPerToken != wantFPT ||
		res.PeakFLOPS != 0.25e12 || !(res.MFU.MFU > 0) || res.LossDiff == nil {
		t.Errorf("-json wrote %s; want flops_per_token %v", b, wantFPT)
	}
}
