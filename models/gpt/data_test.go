package gpt

import (
	"context"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/internal/randtok"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// TestRandomTokens: WithRandomTokens feeds the trainer randtok's batches
// for the model's vocabulary and sequence length and the run's batch;
// without it the trainer samples the reference's corpus.
func TestRandomTokens(t *testing.T) {
	cfg := Config{Vocab: 300, Width: 8, Heads: 2, Layers: 1, MLPWidth: 16, SeqLen: 6, InitStd: 0.02, LNEps: 1e-5}
	run := tinygpt.Default()
	run.B = 3
	for _, random := range []bool{true, false} {
		err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			opts := []TrainOption{WithRun(run)}
			if random {
				opts = append(opts, WithRandomTokens(5))
			}
			tr, err := NewTrainer(ctx, m, cfg, opts...)
			if err != nil {
				return err
			}
			got, err := tr.sampler.Next()
			if err != nil {
				return err
			}
			want := randtok.New(5, run.B, cfg.SeqLen, cfg.Vocab).Next()
			same := slices.Equal(got.X, want.X) && slices.Equal(got.Y, want.Y)
			if same != random || got.B != run.B || got.T != cfg.SeqLen {
				t.Errorf("random %v: batch %+v; randtok's %+v", random, got, want)
			}
			if !random && got.Offsets == nil {
				t.Errorf("without random tokens the batch has no corpus offsets: %+v", got)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
}
