package tests

import (
	"context"
	"fmt"
	"io"
	"path/filepath"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/trace"
	"github.com/b7ea7098/loom/train"
)

// BenchmarkFSDP compares a training step of fsdp=2 (ZeRO-3) with DDP
// dp=2, on the tiny GPT and on one 4× wider (D=512, F=2048), on two
// in-process ranks: tokens/s of the median step, and for FSDP the part of
// its all-gather and reduce-scatter time (rank 0, the last traced steps)
// hidden behind compute. Run the layouts alternately, several times:
//
//	go test ./tests -run XXX -bench FSDP -benchtime 8x -count 3
func BenchmarkFSDP(b *testing.B) {
	for _, width := range []int{1, 4} {
		run := tinygpt.Default()
		run.D, run.F = run.D*width, run.F*width
		cfg := gpt.FromReference(run)
		init := gpt.RandomInit(cfg, 1)
		for _, layout := range []string{"ddp", "fsdp"} {
			b.Run(fmt.Sprintf("width=%dx/%s", width, layout), func(b *testing.B) {
				bl, err := kernels.Load(kernels.WithThreads(1), kernels.WithRanksInProcess(2))
				if err != nil {
					b.Fatal(err)
				}
				steps := warmupSteps + b.N
				tracer := train.NewTracer(filepath.Join(b.TempDir(), "trace.json"), steps, min(steps, 3), 0)
				var tokensPerS float64
				err = local.Run(context.Background(), 2, func(ctx context.Context, c comm.Communicator) error {
					rt := tracer.Rank(c)
					m, err := mesh.New(rt.Comm(), []int{2}, []string{"dp"})
					if err != nil {
						return err
					}
					opts := []gpt.TrainOption{gpt.WithRun(run), gpt.WithModel(gpt.WithParams(init)), gpt.WithTape(rt.Tape(autograd.WithBLAS(bl))...)}
					if layout == "ddp" {
						opts = append(opts, gpt.WithDataParallel("dp"))
					} else {
						opts = append(opts, gpt.WithFullyShard("dp"))
					}
					tr, err := gpt.NewTrainer(ctx, m, cfg, opts...)
					if err != nil {
						return err
					}
					rate, err := medianStepRate(b.N, run.B*run.T, func(i int) error {
						span, err := rt.BeginStep(ctx, i)
						if err != nil {
							return err
						}
						_, _, err = tr.Step(ctx)
						span.End()
						return err
					})
					if err != nil {
						return err
					}
					if m.Rank() == 0 {
						tokensPerS = rate
					}
					return nil
				})
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(tokensPerS, "tokens/s")
				if layout == "fsdp" {
					events, err := tracer.Write(io.Discard)
					if err != nil {
						b.Fatal(err)
					}
					s := train.Overlap(events, 0, func(e trace.Event) bool {
						return e.Op == comm.OpAllGather || e.Op == comm.OpReduceScatter
					})
					b.ReportMetric(100*s.Fraction(), "%hidden")
				}
			})
		}
	}
}
