package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
	if res.DP != 1 || res.TP != 2 || !res.SP || res.Steps != 2 || len(res.Losses) != 2 || res.FinalLoss != res.Losses[1] || !(res.TokensPerS > 0) {
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

func TestFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"-dp", "0"}, {"-tp", "1", "-sp"}, {"-every", "0"}, {"-steps", "-1"}, {"-trace-steps", "0"}, {"extra"},
	} {
		var out bytes.Buffer
		if err := run(context.Background(), args, &out); err == nil {
			t.Errorf("run %v: no error", args)
		}
	}
}
