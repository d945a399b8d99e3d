package tests

import (
	"bufio"
	"bytes"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// userProgram is a program of a user's, written from loom's public API
// only: a classifier Sequential(Linear, ReLU, Dropout, Linear, MoE layer,
// Linear) trained with train's loop on -dp × -fsdp × -ep × -tp ranks,
// in-process or one per process as launch.Auto finds them. It prints one
// loss per step on world rank 0's stdout, in full precision, and the job
// on its stderr.
const userProgram = "testdata/usertrain/main.go"

// userLayouts are the layouts of four ranks that the external tests train
// on, against one rank.
var userLayouts = [][]string{{"-dp", "2", "-tp", "2"}, {"-fsdp", "4"}, {"-ep", "2", "-dp", "2"}}

// buildUserProgram builds userProgram as a module of its own
// (example.com/user, requiring this repository through a replace
// directive, offline, without cgo) in a temporary folder and returns the
// binary's path.
func buildUserProgram(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the external module: %v", err)
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(userProgram)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	gomod := "module example.com/user\n\ngo 1.26\n\nrequire github.com/b7ea7098/loom v0.0.0\n\nreplace github.com/b7ea7098/loom => " + root + "\n"
	for name, data := range map[string][]byte{"go.mod": []byte(gomod), "go.sum": sum, "main.go": src} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "user")
	build := exec.Command(goBin, "build", "-o", bin, ".")
	build.Dir = dir
	build.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off", "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in the external module: %v\n%s", err, out)
	}
	return bin
}

// userRun runs the command line args (the user program, or loomrun
// starting it) with env added to the test's environment and returns the
// losses that world rank 0 printed (loomrun's "[rank 0] " prefix taken
// off) and everything written to stderr.
func userRun(t *testing.T, env []string, args ...string) (losses []float64, stderr string) {
	t.Helper()
	var errBuf bytes.Buffer
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = &errBuf
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%v: %v\n%s%s", args, err, out, errBuf.String())
	}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimPrefix(sc.Text(), "[rank 0] ")
		v, err := strconv.ParseFloat(strings.TrimSpace(line), 64)
		if err != nil {
			t.Fatalf("%v printed %q: %v\n%s", args, sc.Text(), err, out)
		}
		losses = append(losses, v)
	}
	return losses, errBuf.String()
}

// lossTolerance is the largest difference, relative to the one-rank loss
// (at least 1), that a layout of several ranks may show: see
// TestExternalTrainModule for why.
const lossTolerance = 1e-6

// closeLosses reports the first step at which got leaves want by more
// than lossTolerance (0: none), and the largest difference.
func closeLosses(got, want []float64) (step int, worst float64) {
	for i := range got {
		d := math.Abs(got[i] - want[i])
		worst = math.Max(worst, d)
		if step == 0 && !(d <= lossTolerance*math.Max(1, math.Abs(want[i]))) {
			step = i + 1
		}
	}
	return step, worst
}

// oneRank runs the user program on one in-process rank and checks that
// it gave 8 falling losses.
func oneRank(t *testing.T, bin string, env []string) []float64 {
	t.Helper()
	want, _ := userRun(t, env, bin)
	if len(want) != 8 || want[7] >= want[0] {
		t.Fatalf("one rank: losses %v; want 8, falling", want)
	}
	return want
}

// TestExternalTrainModule builds the user program as a module of its own
// (example.com/user, requiring this repository through a replace
// directive, offline) and runs it on one rank, dp=2 × tp=2, fsdp=4 and
// ep=2 × dp=2 in-process ranks: every layout's 8 losses match the
// one-rank run's to 1e-6 relative. The parameters are float32 and the
// layouts differ only in the order of sums (tensor-parallel dot products,
// data-parallel gradient sums, the experts' rows gathered from other
// ranks); dropout draws the one-rank masks on every layout and the
// routing is the same, so only a few float32 roundings separate them
// (measured: at most 6e-8, one rounding of a loss near 0.7). Skipped under
// -short (it compiles a program).
func TestExternalTrainModule(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles and runs a program in a module of its own")
	}
	bin := buildUserProgram(t)
	env := []string{"LOOM_BACKEND="}
	want := oneRank(t, bin, env)
	for _, args := range userLayouts {
		got, _ := userRun(t, env, append([]string{bin}, args...)...)
		if len(got) != len(want) {
			t.Fatalf("%v: %d losses, one rank %d", args, len(got), len(want))
		}
		if step, worst := closeLosses(got, want); step > 0 {
			t.Errorf("%v: step %d: loss %v, one rank %v (largest difference %.3g)", args, step, got[step-1], want[step-1], worst)
		} else {
			t.Logf("%v: largest loss difference from one rank %.3g", args, worst)
		}
	}
}

// TestExternalTrainLoomrun runs the same user program as
// TestExternalTrainModule under `loomrun -n 4`: four processes of one
// rank each, on the TCP backend, which launch.Auto picks by itself on a
// host without GPUs (LOOM_CUDA_DRIVER=off makes this one such a host).
// For dp=2 × tp=2, fsdp=4 and ep=2 × dp=2:
//
//   - with the backends' own algorithms, the losses match the one-rank
//     run's to lossTolerance (1e-6 relative), as on in-process ranks;
//   - with LOOM_ALGO=direct (every collective sums the ranks in rank
//     order, as comm/local's direct algorithm does) they equal the
//     in-process run's of the same layout bit for bit: the processes
//     compute exactly what the in-process ranks compute.
//
// Every run uses loom's pure-Go GEMM (LOOM_BLAS=go), so that all compute
// their GEMMs with the same code whatever libraries the host has: the
// program leaves the choice to kernels.Default, which takes the first
// CBLAS library that loads (OpenBLAS here), whose float32 sums may round
// differently from loom's and depend on its threads. Measured here with the
// default algorithms: dp × tp and ep × dp gave the in-process losses bit
// for bit, fsdp=4 differed at step 8 by 6e-8 (one float32 rounding: its
// four-rank all-reduce of a few floats takes the TCP backend's binomial
// tree, (r0+r1)+(r2+r3), where comm/local sums r0+r1+r2+r3). Without
// LOOM_BLAS=go (every run on OpenBLAS) the same, except that ep × dp then
// differed from one rank by 6e-8 instead of 0. Skipped under -short (it
// compiles two programs).
func TestExternalTrainLoomrun(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles the user program and loomrun and runs them")
	}
	bin := buildUserProgram(t)
	loomrun := filepath.Join(filepath.Dir(bin), "loomrun")
	if out, err := exec.Command("go", "build", "-o", loomrun, "../cmd/loomrun").CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/loomrun: %v\n%s", err, out)
	}
	base := []string{"LOOM_BACKEND=", "LOOM_BLAS=go", "LOOM_CUDA_DRIVER=off", "LOOM_TIMEOUT=60s", "LOOM_ALGO="}
	want := oneRank(t, bin, base)
	for _, algo := range []string{"", "direct"} {
		env := append(slices.Clone(base), "LOOM_ALGO="+algo)
		for _, args := range userLayouts {
			t.Run(fmt.Sprintf("LOOM_ALGO=%s %s", algo, strings.Join(args, " ")), func(t *testing.T) {
				got, stderr := userRun(t, env, append([]string{loomrun, "-n", "4", "--timeout", "2m", bin}, args...)...)
				if !strings.Contains(stderr, "[rank 0] 4 tcp processes of one rank each (4 on this host)") {
					t.Errorf("the program does not say it runs as 4 tcp processes:\n%s", stderr)
				}
				if len(got) != len(want) {
					t.Fatalf("%d losses, one rank %d", len(got), len(want))
				}
				step, worst := closeLosses(got, want)
				if step > 0 {
					t.Errorf("step %d: loss %v, one rank %v (largest difference %.3g)", step, got[step-1], want[step-1], worst)
				}
				inproc, _ := userRun(t, env, append([]string{bin}, args...)...)
				same := slices.Equal(got, inproc)
				if algo == "direct" && !same {
					t.Errorf("losses on 4 tcp processes %v; on 4 in-process ranks %v: want them bit for bit", got, inproc)
				}
				t.Logf("largest loss difference from one rank %.3g; in-process losses bit for bit: %v", worst, same)
			})
		}
	}
}
