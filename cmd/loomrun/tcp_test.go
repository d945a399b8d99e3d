package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// buildTransformer builds examples/transformer into dir.
func buildTransformer(t *testing.T, dir string) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build examples/transformer: %v", err)
	}
	bin := filepath.Join(dir, "transformer")
	cmd := exec.Command(goBin, "build", "-o", bin, "../../examples/transformer")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./examples/transformer: %v\n%s", err, out)
	}
	return bin
}

// transformerRun is the part of the transformer's -json that the test
// compares.
type transformerRun struct {
	Backend   string    `json:"backend"`
	Processes int       `json:"processes"`
	WorldSize int       `json:"world_size"`
	Losses    []float64 `json:"losses"`
}

func readRun(t *testing.T, path string) transformerRun {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var r transformerRun
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return r
}

// TestTransformerTCP: `loomrun -n 4 ./transformer -dp 2 -tp 2` (and -n 2
// -dp 2) on a host without GPUs trains with one process per rank on the
// TCP backend, chosen by itself (LOOM_CUDA_DRIVER=off makes every host one
// without GPUs), and gives the losses of the same layout on in-process
// ranks bit for bit. Both runs force loom's pure-Go GEMM (LOOM_BLAS=go):
// by default the in-process run picks it and a process of one rank picks
// OpenBLAS, whose float32 sums round differently (up to 1.2e-6 on these
// losses). With the GEMM fixed, nothing else may differ: a two-rank sum
// does not depend on its order, and the four-rank loss reduction and the
// data-parallel gradients are summed in the same order by comm/local and
// comm/tcp (measured: identical with and without the cost model).
func TestTransformerTCP(t *testing.T) {
	dir := t.TempDir()
	bin := buildTransformer(t, dir)
	for _, tc := range []struct {
		n      int
		layout []string
	}{
		{4, []string{"-dp", "2", "-tp", "2"}},
		{2, []string{"-dp", "2", "-tp", "1"}},
	} {
		t.Run(fmt.Sprintf("n=%d %s", tc.n, strings.Join(tc.layout, " ")), func(t *testing.T) {
			args := append(slices.Clone(tc.layout), "-steps", "6", "-every", "3")
			env := append(os.Environ(), "LOOM_BLAS=go", "LOOM_CUDA_DRIVER=off", "LOOM_BACKEND=", "LOOM_TIMEOUT=60s")

			inproc := filepath.Join(dir, fmt.Sprintf("inproc%d.json", tc.n))
			cmd := exec.Command(bin, append(args, "-json", inproc)...)
			cmd.Env = env
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("in-process run: %v\n%s", err, out)
			}

			multi := filepath.Join(dir, fmt.Sprintf("tcp%d.json", tc.n))
			cmd = exec.Command(os.Args[0], append([]string{"-n", fmt.Sprint(tc.n), "--timeout", "3m", bin}, append(args, "-json", multi)...)...)
			cmd.Env = append(env, launcherEnv+"=1")
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("loomrun -n %d: %v\n%s", tc.n, err, out)
			}
			if want := fmt.Sprintf("%d tcp processes of one rank each (%d on this host)", tc.n, tc.n); !strings.Contains(string(out), want) {
				t.Errorf("loomrun's output lacks %q:\n%s", want, out)
			}
			for _, bad := range []string{"nccl", "CUDA"} {
				if strings.Contains(string(out), bad) {
					t.Errorf("loomrun's output mentions %s:\n%s", bad, out)
				}
			}
			want, got := readRun(t, inproc), readRun(t, multi)
			if got.Backend != "tcp" || got.Processes != tc.n || got.WorldSize != tc.n || want.Backend != "local" {
				t.Errorf("backends: loomrun %s with %d processes of %d ranks, in-process %s; want tcp, %d, %d and local", got.Backend, got.Processes, got.WorldSize, want.Backend, tc.n, tc.n)
			}
			if len(want.Losses) != 6 || !slices.Equal(got.Losses, want.Losses) {
				t.Errorf("losses on tcp %v; in-process %v", got.Losses, want.Losses)
			}
		})
	}
}
