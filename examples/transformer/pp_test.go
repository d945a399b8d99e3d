package main

import (
	"bytes"
	"context"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPipelineFlags: -schedule-print prints the lowered table without
// training; -pp 2 trains the tiny GPT pipelined with losses equal to one
// rank's (float32: 1e-5) and -json has "pp", "schedule", "bubble" and
// "bubble_theory"; flags that need -pp, or cannot join it yet, are
// refused before any rank starts.
func TestPipelineFlags(t *testing.T) {
	ctx := context.Background()
	var out bytes.Buffer
	if err := run(ctx, []string{"-pp", "2", "-schedule", "zb1", "-microbatches", "4", "-schedule-print"}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"schedule zb1: pp=2", "Rank 0", "0SEND_F0", "1I0", "bubble (unit costs)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("-schedule-print lacks %q:\n%s", want, out.String())
		}
	}
	for _, args := range [][]string{
		{"-schedule", "gpipe"},
		{"-pp", "2", "-dp", "2"},
		{"-pp", "2", "-schedule", "nonesuch.csv"},
		{"-pp", "2", "-schedule", "zbv", "-microbatches", "2"},
	} {
		if err := run(ctx, args, &bytes.Buffer{}); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	if testing.Short() {
		return
	}
	dir := t.TempDir()
	pj, oj := filepath.Join(dir, "pp.json"), filepath.Join(dir, "one.json")
	common := []string{"-steps", "2", "-every", "1", "-threads", "1"}
	if err := run(ctx, append([]string{"-pp", "2", "-schedule", "1f1b", "-microbatches", "4", "-json", pj}, common...), &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if err := run(ctx, append([]string{"-dp", "1", "-tp", "1", "-json", oj}, common...), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var p ppResult
	var one result
	for path, v := range map[string]any{pj: &p, oj: &one} {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatal(err)
		}
	}
	if p.Steps != 2 || p.PP != 2 || p.Schedule != "1f1b" || !(p.Bubble > 0 && p.Bubble < 1) || math.Abs(p.BubbleTheory-0.2) > 1e-9 {
		t.Errorf("-json: %+v", p)
	}
	for i := range one.Losses {
		if math.Abs(p.Losses[i]-one.Losses[i]) > 1e-5 {
			t.Errorf("step %d: pipelined loss %v, one rank %v", i+1, p.Losses[i], one.Losses[i])
		}
	}
}
