package checkpoint_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
	"github.com/b7ea7098/loom/train"
)

// Train a small GPT on a text file with data and tensor parallelism
// (dp=2 × tp=2), save the whole job (parameters, AdamW's moments and step
// counts, the data's position) after 3 steps, and resume it in a new job
// on one rank, which goes on with step 4 from the saved state.
func ExampleLoadJob() {
	dir, err := os.MkdirTemp("", "resume")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	text := filepath.Join(dir, "text.txt")
	if err := os.WriteFile(text, []byte(strings.Repeat("to be or not to be, that is the question. ", 200)), 0o644); err != nil {
		panic(err)
	}
	root := filepath.Join(dir, "checkpoints")
	cfg := gpt.Config{Vocab: 128, Width: 32, Heads: 4, Layers: 1, MLPWidth: 64, SeqLen: 16, InitStd: 0.02, LNEps: 1e-5}
	run := tinygpt.Default()
	run.B = 4

	// job trains steps steps on a dp × tp mesh, resuming from root's latest
	// checkpoint when resume is set, and saves the job at the end.
	job := func(dp, tp, steps int, resume bool) error {
		return placementtest.Simulate(context.Background(), []int{dp, tp}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
			f, err := train.OpenTokens(text, cfg.Vocab) // one token a byte
			if err != nil {
				return err
			}
			defer f.Close()
			windows, err := train.NewWindows(f, cfg.SeqLen, m)
			if err != nil {
				return err
			}
			data, _, err := windows.Split(0.1) // hold out 10% for validation
			if err != nil {
				return err
			}
			tr, err := gpt.NewTrainer(ctx, m, cfg, gpt.WithRun(run), gpt.WithModel(gpt.WithSeed(1)),
				gpt.WithDataParallel("dp"), gpt.WithTensorParallel("tp"), gpt.WithWindows(data))
			if err != nil {
				return err
			}
			if resume {
				path, err := checkpoint.Latest(root)
				if err != nil {
					return err
				}
				step, _, err := checkpoint.LoadJob(ctx, path, tr.Parts())
				if err != nil {
					return err
				}
				if m.Rank() == 0 {
					fmt.Printf("resumed at step %d on %d rank(s)\n", step, dp*tp)
				}
			}
			for range steps {
				if _, _, err := tr.Step(ctx); err != nil {
					return err
				}
			}
			state, err := checkpoint.JobState(tr.Steps(), tr.Parts(), nil)
			if err != nil {
				return err
			}
			path, err := checkpoint.Save(ctx, root, state, checkpoint.WithStep(tr.Steps()), checkpoint.WithKeep(2))
			if m.Rank() == 0 {
				fmt.Println("saved", filepath.Base(path))
			}
			return err
		})
	}
	if err := job(2, 2, 3, false); err != nil {
		panic(err)
	}
	if err := job(1, 1, 3, true); err != nil {
		panic(err)
	}
	// Output:
	// saved step-0000000003
	// resumed at step 3 on 1 rank(s)
	// saved step-0000000006
}
