package gpt_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// PipelineParts and NewBatchSource refuse bad input with ErrConfig; a
// BatchSource draws a Trainer's batches and its part seeks them.
func TestPipelinePartsRefuses(t *testing.T) {
	cfg := gpt.Config{Vocab: 128, Width: 8, Heads: 2, Layers: 2, MLPWidth: 16, SeqLen: 4, InitStd: 0.1, LNEps: 1e-5}
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		st, err := gpt.NewStage(autograd.NewTape(), m, cfg, 0, 2, gpt.RandomInit(cfg, 1))
		if err != nil {
			return err
		}
		for _, c := range []struct {
			name   string
			stages []*gpt.Stage
			opts   []gpt.PartsOption
		}{
			{"no stage", nil, nil},
			{"a nil stage", []*gpt.Stage{st, nil}, nil},
			{"a nil option", []*gpt.Stage{st}, []gpt.PartsOption{nil}},
		} {
			if _, err := gpt.PipelineParts(c.stages, nil, nil, c.opts...); !errors.Is(err, gpt.ErrConfig) {
				t.Errorf("%s: %v, want ErrConfig", c.name, err)
			}
		}
		// The same stage twice: its parameters are named twice.
		parts, err := gpt.PipelineParts([]*gpt.Stage{st, st}, nil, nil)
		if err != nil {
			return err
		}
		if _, err := checkpoint.JobState(0, parts, nil); !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), "another of the rank's stages") {
			t.Errorf("a stage twice: %v, want ErrConfig", err)
		}
		return nil
	})
	small := cfg
	small.Vocab = 32
	if _, err := gpt.NewBatchSource(small); !errors.Is(err, gpt.ErrConfig) {
		t.Errorf("the corpus with a vocabulary of 32: %v, want ErrConfig", err)
	}
	// Seeking: a source resumed at step 2 draws the third batch.
	run := tinygpt.Default()
	run.B = 2
	a, err := gpt.NewBatchSource(cfg, gpt.WithRun(run), gpt.WithRandomTokens(3))
	if err != nil {
		t.Fatal(err)
	}
	var third tinygpt.Batch
	for range 3 {
		if third, err = a.Next(); err != nil {
			t.Fatal(err)
		}
	}
	b, err := gpt.NewBatchSource(cfg, gpt.WithRun(run), gpt.WithRandomTokens(3))
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Part().LoadStateDict("data.", map[string]any{"data.step": int64(2)}); err != nil {
		t.Fatal(err)
	}
	got, err := b.Next()
	if err != nil {
		t.Fatal(err)
	}
	if b.Steps() != 3 || got.Step != 3 || !slices.Equal(got.X, third.X) {
		t.Errorf("after seeking to step 2: batch %d (%d drawn), X equal %v; want the third", got.Step, b.Steps(), slices.Equal(got.X, third.X))
	}
}
