package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// userProgram is a program outside the module: it builds the tiny GPT with
// tensor and data parallelism from the public packages only and prints one
// loss per line, in full precision.
const userProgram = `package main

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

type stepper struct{ tr *gpt.Trainer }

func (s stepper) Step(ctx context.Context) (float64, error) {
	_, loss, err := s.tr.Step(ctx)
	return loss, err
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	fx, err := tinygpt.LoadFixture()
	if err != nil {
		return err
	}
	ref, err := fx.Cfg()
	if err != nil {
		return err
	}
	init, err := fx.Params(tinygpt.PrefixInit)
	if err != nil {
		return err
	}
	cfg := gpt.FromReference(ref)
	loop := train.Loop{Ranks: 4, Steps: 10, Every: 1, Tokens: ref.B * ref.T, Flags: train.Flags{Threads: 1, TraceSteps: 1}}
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		m, err := mesh.New(r.Comm, []int{2, 2}, []string{"dp", "tp"})
		if err != nil {
			return nil, err
		}
		tr, err := gpt.NewTrainer(ctx, m, cfg, gpt.WithRun(ref), gpt.WithModel(gpt.WithParams(init)),
			gpt.WithTape(r.Tape...), gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"))
		if err != nil {
			return nil, err
		}
		return stepper{tr}, nil
	}
	progress := func(_ int, loss, _ float64) { fmt.Println(strconv.FormatFloat(loss, 'g', -1, 64)) }
	job, err := launch.Detect(os.Getenv, "", loop.Ranks)
	if err != nil {
		return err
	}
	_, err = train.Run(context.Background(), nil, job, loop, setup, progress)
	return err
}
`

// TestExternalModule builds and runs userProgram as a module of its own
// (example.com/user, requiring this repository through a replace
// directive, offline) on dp=2 × tp=2 for 10 steps, and compares its losses
// with this command's in-process run of the same layout. They must be
// bit-identical: both run the same code on the same data with one GEMM
// thread per rank, and every reduction is in a fixed order, so any
// difference means the external program could not reach something the
// example uses. Skipped under -short only (it compiles a program).
func TestExternalModule(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles and runs a program in a module of its own")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to build the external module: %v", err)
	}
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	sum, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	gomod := "module example.com/user\n\ngo 1.26\n\nrequire github.com/b7ea7098/loom v0.0.0\n\nreplace github.com/b7ea7098/loom => " + root + "\n"
	for name, data := range map[string][]byte{"go.mod": []byte(gomod), "go.sum": sum, "main.go": []byte(userProgram)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(goBin, "run", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	got, err := cmd.Output()
	if err != nil {
		t.Fatalf("go run in the external module: %v\n%s", err, stderr.String())
	}
	var ext []float64
	sc := bufio.NewScanner(bytes.NewReader(got))
	for sc.Scan() {
		v, err := strconv.ParseFloat(strings.TrimSpace(sc.Text()), 64)
		if err != nil {
			t.Fatalf("external program printed %q: %v", sc.Text(), err)
		}
		ext = append(ext, v)
	}

	fx, err := tinygpt.LoadFixture()
	if err != nil {
		t.Fatal(err)
	}
	ref, err := fx.Cfg()
	if err != nil {
		t.Fatal(err)
	}
	init, err := fx.Params(tinygpt.PrefixInit)
	if err != nil {
		t.Fatal(err)
	}
	o, err := parse([]string{"-dp", "2", "-tp", "2", "-steps", "10", "-threads", "1"}, io.Discard, ref)
	if err != nil {
		t.Fatal(err)
	}
	job, err := launch.InProcess(o.loop.Ranks)
	if err != nil {
		t.Fatal(err)
	}
	if !o.fixture {
		t.Fatal("the default flags are not the reference run")
	}
	res, _, err := trainLayout(context.Background(), io.Discard, job, gpt.WithParams(init), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(ext) != len(res.Losses) {
		t.Fatalf("external program printed %d losses, the example %d:\n%s", len(ext), len(res.Losses), got)
	}
	for i := range ext {
		if ext[i] != res.Losses[i] {
			t.Errorf("step %d: external module %v, example %v", i+1, ext[i], res.Losses[i])
		}
	}
	t.Logf("external module and example agree on %d losses, last %v", len(ext), ext[len(ext)-1])
}
