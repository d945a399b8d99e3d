package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
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
	cfg := gpt.FromReference(ref)
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
		{[]string{"extra"}, []string{"unexpected arguments"}},
		{[]string{"-fsdp", "3", "-dp", "1"}, []string{"dp × fsdp (1 × 3) must divide the batch (16 sequences); their product can be 1, 2, 4, 8 or 16"}},
		{[]string{"-fsdp", "0"}, []string{"-fsdp 0; want at least 1"}},
		{[]string{"-fsdp", "4", "-dp", "1", "-reshard", "3"}, []string{"-reshard 3 must divide -fsdp (4); it can be 1, 2 or 4"}},
		{[]string{"-fsdp", "2", "-reshard", "yes"}, []string{`-reshard "yes"; want true, false or a group size`}},
		{[]string{"-fsdp", "2", "-zero", "4"}, []string{"-zero 4; want 1, 2 or 3"}},
		{[]string{"-fsdp", "2", "-mp", "fp16"}, []string{`-mp "fp16"; want bf16`}},
		{[]string{"-zero", "2"}, []string{"apply to fully sharded data parallelism: set -fsdp to 2 or more"}},
		{[]string{"-ac", "some"}, []string{`-ac "some"; want none, full or selective`}},
	} {
		_, err := parse(tc.args, io.Discard, cfg, ref)
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
	// Sequence parallelism also needs the sequence to split over tp.
	odd := cfg
	odd.SeqLen = 63
	if _, err := parse([]string{"-sp"}, io.Discard, odd, ref); err == nil || !strings.Contains(err.Error(), "sequence length (63) must be divisible by tp (2); tp can be 1, 3, 7, 9, 21 or 63") {
		t.Errorf("-sp with T=63: %v", err)
	}
	o, err := parse(nil, io.Discard, cfg, ref)
	if err != nil || o.dp != 2 || o.fsdp != 1 || o.tp != 2 || o.ac != "none" || o.zero != 3 || o.loop.Steps != ref.Steps || o.loop.Ranks != 4 || o.loop.Tokens != ref.B*ref.T {
		t.Errorf("defaults: %+v, %v", o, err)
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
