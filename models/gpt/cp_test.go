package gpt_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/parallel/cp"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Context-parallel layouts the model cannot take are refused before
// anything is communicated, each naming what is wrong: sequence
// parallelism beside it, a sequence shorter than cp (2·cp when load
// balanced), Ulysses (Hybrid) with heads per tensor-parallel rank not
// divisible by cp (its inner ranks), a Ulysses axis
// without a cp axis or before it, one axis named for two kinds, FSDP over
// fsdp×cp without FSDP.
func TestContextParallelRefused(t *testing.T) {
	cfg := gpt.Tiny()
	for _, c := range []struct {
		l    gpt.Layout
		want string
	}{
		{gpt.Layout{DP: 1, TP: 2, SP: true, CP: 2}, "context parallelism (cp 2) and sequence parallelism both shard the sequence"},
		{gpt.Layout{DP: 1, TP: 1, CP: 128}, "the sequence length (64) must be at least cp (128)"},
		{gpt.Layout{DP: 1, TP: 1, CP: -1}, "cp (-1) must be at least 0"},
		{gpt.Layout{DP: 1, TP: 1, CP: 48}, "its length (64) must be at least 2·cp (2 × 48); use plain shards or cp of at most 32"},
		{gpt.Layout{DP: 1, TP: 1, CP: 3, CPMethod: cp.Ulysses}, "Ulysses splits the 4 heads per tensor-parallel rank over cp (3): they must be divisible; cp can be 1, 2 or 4"},
		{gpt.Layout{DP: 1, TP: 2, CP: 4, CPMethod: cp.Hybrid, CPInner: 4}, "Hybrid's Ulysses splits the 2 heads per tensor-parallel rank over its inner ranks (4)"},
		{gpt.Layout{DP: 1, TP: 1, CP: 3, CPMethod: cp.Hybrid, CPInner: 2}, "Hybrid's inner (Ulysses) ranks (2) must divide cp (3), which counts them; the inner size can be 1 or 3"},
	} {
		if err := cfg.CheckLayout(16, c.l); !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("CheckLayout(%+v): %v; want ErrConfig with %q", c.l, err, c.want)
		}
	}
	for _, l := range []gpt.Layout{
		{DP: 2, TP: 2, CP: 2},
		{DP: 1, TP: 1, CP: 48, CPPlain: true},
		{DP: 1, TP: 1, CP: 4, CPMethod: cp.Ulysses},
		{DP: 1, TP: 2, CP: 4, CPMethod: cp.Hybrid, CPInner: 2},
	} {
		if err := cfg.CheckLayout(16, l); err != nil {
			t.Errorf("CheckLayout(%+v): %v", l, err)
		}
	}
	// The trainer checks the method its options give before any
	// communication; so does NewStage.
	placementtest.Run(t, []int{3}, []string{"cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, err := gpt.NewTrainer(ctx, m, cfg, gpt.WithContextParallel("cp", cp.WithMethod(cp.Ulysses)))
		if want := "Ulysses splits the 4 heads per tensor-parallel rank over cp (3)"; !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), want) {
			return fmt.Errorf("NewTrainer: %v; want ErrConfig with %q", err, want)
		}
		_, err = gpt.NewStage(autograd.NewTape(), m, cfg, 0, 1, gpt.RandomInit(cfg, 1), gpt.WithStageContextParallel("cp", cp.WithMethod(cp.Ulysses)))
		if want := `WithStageContextParallel("cp"): gpt: invalid configuration: Ulysses splits the 4 heads per tensor-parallel rank over cp (3)`; !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), want) {
			return fmt.Errorf("NewStage: %v; want ErrConfig with %q", err, want)
		}
		return nil
	})
	placementtest.Run(t, []int{1, 1}, []string{"cp", "cpu"}, func(ctx context.Context, m *mesh.Mesh) error {
		for _, c := range []struct {
			opts []gpt.TrainOption
			want string
		}{
			{[]gpt.TrainOption{gpt.WithUlyssesAxis("cpu")}, `WithUlyssesAxis("cpu") needs WithContextParallel`},
			{[]gpt.TrainOption{gpt.WithContextParallel("cpu"), gpt.WithUlyssesAxis("cp")}, `the Ulysses axis "cp" must come after the context-parallel axis "cpu"`},
			{[]gpt.TrainOption{gpt.WithContextParallel("cp"), gpt.WithDataParallel("cp")}, `axis "cp" named for both context and data parallelism`},
			{[]gpt.TrainOption{gpt.WithContextParallel("seq")}, `the mesh has no axis "seq"`},
			{[]gpt.TrainOption{gpt.WithContextParallel("cp"), gpt.WithShardOverCP()}, `WithShardOverCP needs WithFullyShard and WithContextParallel`},
		} {
			_, err := gpt.NewTrainer(ctx, m, cfg, c.opts...)
			if !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), c.want) {
				return fmt.Errorf("NewTrainer: %v; want ErrConfig with %q", err, c.want)
			}
		}
		return nil
	})
}

// A stage's context-parallel axis must be an axis of the stage's mesh:
// NewStage refuses another, or none, with ErrConfig, naming it and the
// mesh's axes.
func TestStageContextParallelRefused(t *testing.T) {
	placementtest.Run(t, []int{1, 1}, []string{"dp", "cp"}, func(ctx context.Context, m *mesh.Mesh) error {
		cfg := gpt.Tiny()
		for _, axis := range []string{"seq", ""} {
			_, err := gpt.NewStage(autograd.NewTape(), m, cfg, 0, 1, gpt.RandomInit(cfg, 1), gpt.WithStageContextParallel(axis))
			if want := fmt.Sprintf(`WithStageContextParallel(%q): the stage mesh's axes are [dp cp]`, axis); !errors.Is(err, gpt.ErrConfig) || !strings.Contains(err.Error(), want) {
				return fmt.Errorf("NewStage: %v; want ErrConfig with %q", err, want)
			}
		}
		return nil
	})
}
