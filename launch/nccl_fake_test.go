//go:build linux && (amd64 || arm64)

package launch_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/launch"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// loss adapts gpt.Trainer to train.Stepper.
type loss struct{ tr *gpt.Trainer }

func (l loss) Step(ctx context.Context) (float64, error) {
	_, v, err := l.tr.Step(ctx)
	return v, err
}

// trainTiny trains a small GPT on dp=2 for steps steps as job says and
// returns this process's losses, with what its rank 0 printed.
func trainTiny(ctx context.Context, job *launch.Job, steps int) ([]float64, string, error) {
	run := tinygpt.Default()
	run.T, run.B = 16, 4
	cfg := gpt.Config{Vocab: 256, Width: 32, Heads: 2, Layers: 1, MLPWidth: 64, SeqLen: run.T, InitStd: 0.02, LNEps: 1e-5}
	l := train.Loop{Ranks: 2, Shape: []int{2}, Steps: steps, Every: steps, Tokens: run.B * run.T, Flags: train.Flags{Threads: 1, TraceSteps: 1}}
	setup := func(ctx context.Context, r train.Rank) (train.Stepper[float64], error) {
		m, err := mesh.New(r.Comm, []int{2}, []string{"dp"})
		if err != nil {
			return nil, err
		}
		tr, err := gpt.NewTrainer(ctx, m, cfg, gpt.WithRun(run), gpt.WithDataParallel("dp"),
			gpt.WithModel(gpt.WithSeed(1)), gpt.WithTape(r.Tape...))
		return loss{tr}, err
	}
	var out bytes.Buffer
	res, err := train.Run(ctx, &out, job, l, setup, nil)
	if err != nil {
		return nil, out.String(), err
	}
	return res.Steps, out.String(), nil
}

// TestNCCLFake starts two NCCL "processes" (goroutines with torchrun's
// environments of ranks 0 and 1, since the fake runs every rank of a
// communicator in one process) against the fake NCCL and CUDA library of
// comm/nccl, bootstrapped through a rendezvous server: Detect picks NCCL
// (the fake driver finds two GPUs; without them it would pick TCP),
// the root prints how it laid the mesh on the GPUs (the identity: without
// NVML the topology is uniform), and three training steps give the losses
// of in-process ranks exactly (two-rank sums do not depend on the order).
func TestNCCLFake(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	jobs := fakeNCCLJobs(t, ctx, 2) // the fake's driver finds GPUs: Detect picks NCCL by itself

	const steps = 3
	losses := make([][]float64, 2)
	outs := make([]string, 2)
	runRanks(t, jobs, func(rank int, job *launch.Job) error {
		if job.Rank != rank || job.Processes != 2 {
			return fmt.Errorf("Detect = %+v", *job)
		}
		var err error
		losses[rank], outs[rank], err = trainTiny(ctx, job, steps)
		if err != nil {
			return fmt.Errorf("%w\n%s", err, outs[rank])
		}
		return nil
	})
	if want := "NCCL: mesh [2], [2] on each host; local mesh position i on GPU [0 1][i] (topology from uniform"; !strings.Contains(outs[0], want) {
		t.Errorf("rank 0 printed %q; want the layout %q", outs[0], want)
	}
	if outs[1] != "" {
		t.Errorf("rank 1 printed %q; only world rank 0 reports", outs[1])
	}
	one, err := launch.InProcess(2)
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := trainTiny(ctx, one, steps)
	if err != nil {
		t.Fatal(err)
	}
	for rank := range 2 {
		if !slices.Equal(losses[rank], want) {
			t.Errorf("rank %d on NCCL: losses %v, in-process %v", rank, losses[rank], want)
		}
	}
}
