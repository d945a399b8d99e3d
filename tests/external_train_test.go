package tests

import (
	"bufio"
	"bytes"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// moeUserProgram is a program in a module of its own, written from the
// public API only: a classifier Sequential(Linear, ReLU, Dropout, Linear,
// MoE layer, Linear) trained with train's loop on -dp × -fsdp × -ep × -tp
// in-process ranks. It prints one loss per line, in full precision.
const moeUserProgram = `package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/parallel/fsdp"
	"github.com/b7ea7098/loom/parallel/tp"
	"github.com/b7ea7098/loom/train"
)

const features, hidden, width, experts, ffn, classes = 8, 16, 8, 4, 12, 3

func main() {
	dp := flag.Int("dp", 1, "")
	fsdp := flag.Int("fsdp", 1, "")
	ep := flag.Int("ep", 1, "")
	tp := flag.Int("tp", 1, "")
	steps := flag.Int("steps", 8, "")
	flag.Parse()
	if err := run(*dp, *fsdp, *ep, *tp, *steps); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func normal(n int, std float64, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 0))
	out := make([]float32, n)
	for i := range out {
		out[i] = float32(std * r.NormFloat64())
	}
	return out
}

func model(tape *autograd.Tape, m *mesh.Mesh) (*parallel.Sequential, *moe.SeqLayer, error) {
	l0, err := parallel.NewLinear(tape, m, features, hidden, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.3, 1)))
	if err != nil {
		return nil, nil, err
	}
	drop, err := parallel.NewDropout(0.2, 5)
	if err != nil {
		return nil, nil, err
	}
	l3, err := parallel.NewLinear(tape, m, hidden, width, parallel.WithName("3"), parallel.WithInit(parallel.Normal(0.3, 2)))
	if err != nil {
		return nil, nil, err
	}
	gate, err := parallel.NewLinear(tape, m, width, experts, parallel.WithName("4.router"), parallel.WithBias(false), parallel.WithInit(parallel.Normal(0.5, 3)))
	if err != nil {
		return nil, nil, err
	}
	router, err := moe.NewRouter(gate.Weight, moe.RouterConfig{K: 2, Renormalize: true, AuxCoef: 0.01, ZCoef: 0.001})
	if err != nil {
		return nil, nil, err
	}
	ex, err := moe.ShardExperts(tape, m, "ep", experts, ffn, width, normal(experts*ffn*width, 0.3, 4), make([]float32, experts*ffn),
		normal(experts*width*ffn, 0.3, 5), make([]float32, experts*width), moe.WithPrefix("4"))
	if err != nil {
		return nil, nil, err
	}
	mo := &moe.SeqLayer{Layer: &moe.Layer{Router: router, Experts: ex}}
	l5, err := parallel.NewLinear(tape, m, width, classes, parallel.WithName("5"), parallel.WithInit(parallel.Normal(0.3, 6)))
	if err != nil {
		return nil, nil, err
	}
	seq, err := parallel.NewSequential(l0, parallel.NewReLU(), drop, l3, mo, l5)
	return seq, mo, err
}

func run(ndp, nfsdp, nep, ntp, steps int) error {
	job, err := launch.InProcess(ndp * nfsdp * nep * ntp)
	if err != nil {
		return err
	}
	x, y, err := train.Blobs(512, features, classes, 11)
	if err != nil {
		return err
	}
	return job.Run(context.Background(), func(ctx context.Context, c comm.Communicator) error {
		m, err := mesh.New(c, []int{ndp, nfsdp, nep, ntp}, []string{"dp", "fsdp", "ep", "tp"})
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		seq, mo, err := model(tape, m)
		if err != nil {
			return err
		}
		plan := tp.Plan{{Pattern: "0", Style: tp.ColwiseParallel{}}, {Pattern: "3", Style: tp.RowwiseParallel{}}}
		if err := tp.Parallelize(ctx, seq, "tp", plan); err != nil {
			return err
		}
		var opts []train.Option
		if nfsdp > 1 {
			f, err := fsdp.FullyShard(ctx, seq, []string{"0", "3", "4"})
			if err != nil {
				return err
			}
			opts = append(opts, train.WithReducer(f))
		}
		params, err := parallel.Params(seq)
		if err != nil {
			return err
		}
		if ndp > 1 {
			d, err := ddp.New(ctx, params)
			if err != nil {
				return err
			}
			opts = append(opts, train.WithReducer(d))
		}
		opts = append(opts, train.WithReducer(train.SyncGrads(params)), train.WithClip(1))
		opt, err := optim.NewAdamW(params, optim.LR(1e-2))
		if err != nil {
			return err
		}
		data := &train.InMemory{X: x, Features: features, Y: y, Tape: tape, Mesh: m, Axes: []string{"dp", "fsdp", "ep"}}
		s, err := data.Sampler(32, train.WithShuffle(2))
		if err != nil {
			return err
		}
		loss := func(ctx context.Context, b train.Classification) (*autograd.Value, error) {
			logits, err := seq.Forward(ctx, b.X)
			if err != nil {
				return nil, err
			}
			ce, err := autograd.CrossEntropy(logits, b.Y)
			if err != nil {
				return nil, err
			}
			return mo.AddLosses(ce)
		}
		tr, err := train.NewTrainer(seq, tape, opt, loss, opts...)
		if err != nil {
			return err
		}
		h, err := tr.Fit(ctx, data, s, steps)
		if err != nil {
			return err
		}
		if c.Rank() == 0 {
			for _, r := range h.Steps {
				fmt.Println(strconv.FormatFloat(r.Loss, 'g', -1, 64))
			}
		}
		return nil
	})
}
`

// TestExternalTrainModule builds moeUserProgram as a module of its own
// (example.com/user, requiring this repository through a replace
// directive, offline) and runs it on one rank, dp=2 × tp=2, fsdp=4 and
// ep=2 × dp=2: every layout's 8 losses match the one-rank run's to 1e-6
// relative. The parameters are float32 and the layouts differ only in the
// order of sums (tensor-parallel dot products, data-parallel gradient
// sums, the experts' rows gathered from other ranks); dropout draws the
// one-rank masks on every layout and the routing is the same, so only a
// few float32 roundings separate them. Skipped under -short (it compiles
// a program).
func TestExternalTrainModule(t *testing.T) {
	if testing.Short() {
		t.Skip("skipped in -short mode: compiles and runs a program in a module of its own")
	}
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
	dir := t.TempDir()
	gomod := "module example.com/user\n\ngo 1.26\n\nrequire github.com/b7ea7098/loom v0.0.0\n\nreplace github.com/b7ea7098/loom => " + root + "\n"
	for name, data := range map[string][]byte{"go.mod": []byte(gomod), "go.sum": sum, "main.go": []byte(moeUserProgram)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(dir, "user")
	build := exec.Command(goBin, "build", "-o", bin, ".")
	build.Dir = dir
	build.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOPROXY=off", "GOWORK=off")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in the external module: %v\n%s", err, out)
	}
	losses := func(args ...string) []float64 {
		t.Helper()
		var stderr bytes.Buffer
		cmd := exec.Command(bin, args...)
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("user program %v: %v\n%s", args, err, stderr.String())
		}
		var ls []float64
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			v, err := strconv.ParseFloat(strings.TrimSpace(sc.Text()), 64)
			if err != nil {
				t.Fatalf("user program %v printed %q: %v", args, sc.Text(), err)
			}
			ls = append(ls, v)
		}
		return ls
	}
	want := losses()
	if len(want) != 8 || want[7] >= want[0] {
		t.Fatalf("one rank: losses %v; want 8, falling", want)
	}
	for _, args := range [][]string{{"-dp", "2", "-tp", "2"}, {"-fsdp", "4"}, {"-ep", "2", "-dp", "2"}} {
		got := losses(args...)
		if len(got) != len(want) {
			t.Fatalf("%v: %d losses, one rank %d", args, len(got), len(want))
		}
		worst := 0.0
		for i := range got {
			d := math.Abs(got[i] - want[i])
			worst = math.Max(worst, d)
			if d > 1e-6*math.Max(1, math.Abs(want[i])) {
				t.Errorf("%v: step %d: loss %v, one rank %v", args, i+1, got[i], want[i])
			}
		}
		t.Logf("%v: largest loss difference from one rank %.3g", args, worst)
	}
}
