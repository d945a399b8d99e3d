package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestPipelineFlags: -schedule-print prints the lowered table without
// training; -pp 2 trains the tiny GPT pipelined with losses equal to one
// rank's (float32: 1e-5) and -json has "pp", "schedule", "bubble" and
// "bubble_theory"; flags that need -pp, layouts that cannot join it yet
// (-cp-method hybrid, -cp-flat-fsdp), micro-batches dp × fsdp cannot share, -ac or
// FSDP's reshard-after-forward with a split backward are refused before
// any rank starts.
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
		{"-pp", "2", "-fsdp", "2", "-reshard", "true", "-schedule", "zb1"},
		{"-pp", "2", "-fsdp", "2", "-microbatches", "16"},
		{"-pp", "2", "-cp", "2", "-cp-method", "hybrid"},
		{"-pp", "2", "-fsdp", "2", "-cp", "2", "-cp-flat-fsdp"},
		{"-pp", "2", "-dp", "2", "-microbatches", "3"},
		{"-pp", "2", "-ac", "full", "-schedule", "zb1"},
		{"-pp", "2", "-schedule", "nonesuch.csv"},
		{"-pp", "2", "-schedule", "zbv", "-microbatches", "2"},
	} {
		// Refused before any rank starts: before the run's first line.
		var out bytes.Buffer
		if err := run(ctx, args, &out); err == nil || out.Len() > 0 {
			t.Errorf("%v: error %v after output %q; want an error before any", args, err, out.String())
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

// TestPipelineComposed: -pp 2 with -dp 2, with -tp 2 (and -sp), with
// both (8 ranks), with -dp 2 -cp 2 (ring attention), and with -fsdp 2
// (each stage's blocks FSDP units driven by the schedule's UNSHARD,
// RESHARD and REDUCE_GRAD; alone with ZB-H1, and with -tp 2 and
// reshard-after-forward) trains the tiny GPT to the one-rank losses within 1e-5
// (float32: the micro-batches' gradients are summed where one rank
// computes them in one GEMM, and dp's and tp's sums reassociate; over 2
// steps the losses differ by about 2e-7), and -json says the layout.
func TestPipelineComposed(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: trains on up to 8 in-process ranks")
	}
	ctx := context.Background()
	dir := t.TempDir()
	common := []string{"-steps", "2", "-every", "1", "-threads", "1"}
	one := filepath.Join(dir, "one.json")
	if err := run(ctx, append([]string{"-dp", "1", "-tp", "1", "-json", one}, common...), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	var want result
	readJSON(t, one, &want)
	for _, c := range []struct {
		args         []string
		dp, fsdp, tp int
	}{
		{[]string{"-pp", "2", "-dp", "2"}, 2, 1, 1},
		{[]string{"-pp", "2", "-tp", "2"}, 1, 1, 2},
		{[]string{"-pp", "2", "-tp", "2", "-sp", "-schedule", "zb1"}, 1, 1, 2},
		{[]string{"-pp", "2", "-dp", "2", "-tp", "2"}, 2, 1, 2},
		{[]string{"-pp", "2", "-dp", "2", "-cp", "2", "-cp-method", "ring", "-schedule", "zb1"}, 2, 1, 1},
		{[]string{"-pp", "2", "-fsdp", "2", "-schedule", "zb1"}, 1, 2, 1},
		{[]string{"-pp", "2", "-fsdp", "2", "-tp", "2", "-reshard", "true"}, 1, 2, 2},
	} {
		t.Run(strings.Join(c.args, " "), func(t *testing.T) {
			path := filepath.Join(dir, strings.Join(c.args, "")+".json")
			var out bytes.Buffer
			if err := run(ctx, append(append(c.args, "-json", path), common...), &out); err != nil {
				t.Fatalf("%v\n%s", err, out.String())
			}
			var got ppResult
			readJSON(t, path, &got)
			if got.PP != 2 || got.DP != c.dp || got.FSDP != c.fsdp || got.TP != c.tp || got.WorldSize != 2*c.dp*c.fsdp*c.tp*max(got.CP, 1) {
				t.Errorf("-json: pp %d dp %d fsdp %d tp %d cp %d world %d; want 2, %d, %d, %d", got.PP, got.DP, got.FSDP, got.TP, got.CP, got.WorldSize, c.dp, c.fsdp, c.tp)
			}
			if len(got.Losses) != len(want.Losses) {
				t.Fatalf("%d losses, one rank %d", len(got.Losses), len(want.Losses))
			}
			for i := range want.Losses {
				if d := math.Abs(got.Losses[i] - want.Losses[i]); d > 1e-5 {
					t.Errorf("step %d: loss %.7f, one rank %.7f", i+1, got.Losses[i], want.Losses[i])
				}
			}
		})
	}
}

// TestPipelineCompareTrace: -compare with -pp trains the one-rank
// reference and reports the differences (small: the composed run's
// parity), and -trace writes each rank's pipeline actions (F, I, W per
// stage and micro-batch, the waits for received tensors) into the trace
// file and prints each rank's idle time, and the mean traced costs with
// the schedule's bubble for them.
func TestPipelineCompareTrace(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: trains twice")
	}
	path := filepath.Join(t.TempDir(), "trace.json")
	var out bytes.Buffer
	args := []string{"-pp", "2", "-dp", "2", "-schedule", "zb1", "-steps", "2", "-every", "1", "-threads", "1", "-compare", "-trace", path, "-trace-steps", "1"}
	if err := run(context.Background(), args, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	var dl, dp float64
	if _, err := fmt.Sscanf(out.String()[strings.Index(out.String(), "largest loss difference"):], "largest loss difference %g, largest parameter difference %g", &dl, &dp); err != nil {
		t.Fatalf("no -compare line: %v\n%s", err, out.String())
	}
	// AdamW's first steps move each parameter by about lr whatever the
	// gradient's size, so rounding shows more in the parameters.
	if dl > 1e-5 || dp > 1e-4 {
		t.Errorf("-compare: loss difference %g, parameter difference %g", dl, dp)
	}
	for r := range 4 {
		if !strings.Contains(out.String(), fmt.Sprintf("rank %d: F/I/W/B ", r)) {
			t.Errorf("no idle line for rank %d:\n%s", r, out.String())
		}
	}
	if !strings.Contains(out.String(), "traced costs (mean over stages): F ") {
		t.Errorf("no line of traced costs:\n%s", out.String())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var tr struct {
		TraceEvents []struct {
			Name string `json:"name"`
			Pid  int    `json:"pid"`
		} `json:"traceEvents"`
	}
	if err := json.Unmarshal(b, &tr); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, e := range tr.TraceEvents {
		seen[fmt.Sprintf("%d %s", e.Pid, e.Name)] = true
	}
	// Stage 0 on ranks 0 and 1 (dp), stage 1 on ranks 2 and 3.
	for _, want := range []string{"0 F s0 mb0", "1 I s0 mb3", "2 W s1 mb2", "3 F s1 mb1", "0 wait RECV_B s0 mb0", "3 wait RECV_F s1 mb0"} {
		if !seen[want] {
			t.Errorf("the trace lacks %q", want)
		}
	}
}

// readJSON reads path's JSON into v.
func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatal(err)
	}
}

// TestPipelineLoomrun runs the example (built without cgo) under
// `loomrun -n 4 … -pp 2 -dp 2` and `… -pp 2 -cp 2`: four processes of one
// rank each on the TCP backend (launch.Auto's choice on a host without
// GPUs, which LOOM_CUDA_DRIVER=off makes this one), whose activations and
// gradients cross stages over TCP, and with -cp whose K/V blocks rotate
// around the ring over TCP. Its losses equal the same binary's on 4
// in-process ranks bit for bit (tolerance 0): both run the same code on
// the same batches with loom's GEMM (LOOM_BLAS=go) on one thread per
// rank, and every sum that crosses ranks adds two nonzero terms (dp's or
// cp's gradient all-reduce over 2 ranks; the loss, from the last stage's
// two dp or cp ranks, with zeros from the others), which any order adds
// alike.
// They are the one-rank run's within TestPipelineComposed's 1e-5.
// Skipped under -short (it compiles two programs).
func TestPipelineLoomrun(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles the example and loomrun and runs them")
	}
	dir := t.TempDir()
	bin, loomrun := filepath.Join(dir, "transformer"), filepath.Join(dir, "loomrun")
	for out, pkg := range map[string]string{bin: ".", loomrun: "../../cmd/loomrun"} {
		cmd := exec.Command("go", "build", "-o", out, pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build %s: %v\n%s", pkg, err, b)
		}
	}
	env := append(os.Environ(), "LOOM_BACKEND=", "LOOM_BLAS=go", "LOOM_CUDA_DRIVER=off", "LOOM_TIMEOUT=60s", "LOOM_COSTMODEL=off")
	losses := func(t *testing.T, what string, json string, cmdline ...string) ([]float64, string) {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, cmdline[0], append(cmdline[1:], "-json", json)...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", what, err, out)
		}
		var r ppResult
		readJSON(t, json, &r)
		if len(r.Losses) != 5 {
			t.Fatalf("%s: -json %+v", what, r)
		}
		return r.Losses, r.Backend + fmt.Sprintf(" %d processes", r.Processes)
	}
	one, _ := losses(t, "one rank", filepath.Join(dir, "one.json"), bin, "-backend", "local", "-dp", "1", "-tp", "1", "-steps", "5", "-every", "5", "-threads", "1")
	for _, layout := range [][]string{
		{"-pp", "2", "-dp", "2", "-schedule", "zb1"},
		{"-pp", "2", "-cp", "2", "-cp-method", "ring"},
	} {
		t.Run(strings.Join(layout, " "), func(t *testing.T) {
			args := append(layout, "-steps", "5", "-every", "5", "-threads", "1")
			got, gotJob := losses(t, "loomrun -n 4", filepath.Join(dir, "tcp.json"), append([]string{loomrun, "-n", "4", "--timeout", "2m", bin}, args...)...)
			want, wantJob := losses(t, "in-process", filepath.Join(dir, "local.json"), append([]string{bin, "-backend", "local"}, args...)...)
			if gotJob != "tcp 4 processes" || wantJob != "local 1 processes" {
				t.Errorf("jobs: loomrun %q, in-process %q", gotJob, wantJob)
			}
			for i := range want {
				if got[i] != want[i] {
					t.Errorf("step %d: loss %v on 4 tcp processes, %v on 4 in-process ranks", i+1, got[i], want[i])
				}
				if d := math.Abs(got[i] - one[i]); d > 1e-5 { // as TestPipelineComposed
					t.Errorf("step %d: loss %v on 4 tcp processes, %v on one rank", i+1, got[i], one[i])
				}
			}
			t.Logf("losses on 4 tcp processes, bit for bit the in-process ones: %v", got)
		})
	}
}
