package moegpt_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/moegpt"
	"github.com/b7ea7098/loom/parallel/ddp"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference/tinygpt"
)

// tiny is a model small enough for a few steps in a test.
func tiny() moegpt.Config {
	c := moegpt.Default()
	c.V, c.D, c.H, c.L, c.T = 128, 16, 2, 2, 8
	c.E, c.K, c.Hd = 4, 2, 16
	return c
}

// tinyRun is its training run: 8 sequences a step, a larger learning
// rate.
func tinyRun() tinygpt.Config {
	r := tinygpt.Default()
	r.B, r.LR = 8, 1e-2
	return r
}

// train runs steps steps of cfg on a dp × ep mesh and returns rank 0's
// results.
func train(t *testing.T, cfg moegpt.Config, dp, ep, steps int, opts ...moegpt.TrainOption) []*moegpt.StepResult {
	t.Helper()
	init := moegpt.RandomInit(cfg, 7)
	var out []*moegpt.StepResult
	placementtest.Run(t, []int{dp, ep}, []string{"dp", "ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		tr, err := moegpt.NewTrainer(ctx, m, cfg, init, "ep", append([]moegpt.TrainOption{moegpt.WithRun(tinyRun()), moegpt.WithModel(moegpt.WithDataParallel("dp"))}, opts...)...)
		if err != nil {
			return err
		}
		var rs []*moegpt.StepResult
		for range steps {
			r, err := tr.Step(ctx)
			if err != nil {
				return err
			}
			rs = append(rs, r)
		}
		if m.Rank() == 0 {
			out = rs
		}
		return nil
	})
	return out
}

// TestLayoutsMatchOneRank: dropless training on ep = 2 and dp = 2 × ep = 2
// gives one rank's losses, aux losses and expert counts.
//
// Tolerance 1e-4 relative: the layouts route every token identically and
// differ only in float32 summation order (the all-reduced gradients, the
// GEMMs' blocking), about 1e-7 per step, which AdamW's normalised update
// can amplify to 1e-5 over a few steps for parameters with tiny
// gradients; a lost token or a wrong reduction changes the loss by 1e-3
// or more.
func TestLayoutsMatchOneRank(t *testing.T) {
	cfg := tiny()
	const steps = 4
	ref := train(t, cfg, 1, 1, steps)
	if len(ref) != steps {
		t.Fatalf("one rank: %d results", len(ref))
	}
	for _, l := range []struct {
		dp, ep int
		opts   []moegpt.TrainOption
	}{{1, 2, nil}, {2, 2, nil}, {2, 2, []moegpt.TrainOption{moegpt.WithDDP(ddp.WithFirstBucket(64), ddp.WithBucketCap(64))}}} {
		got := train(t, cfg, l.dp, l.ep, steps, l.opts...)
		if len(got) != steps {
			t.Fatalf("dp=%d ep=%d: %d results", l.dp, l.ep, len(got))
		}
		for s := range steps {
			for _, v := range []struct {
				name   string
				g, ref float64
			}{{"loss", got[s].Loss, ref[s].Loss}, {"aux", got[s].Aux, ref[s].Aux}, {"z", got[s].Z, ref[s].Z}} {
				if math.Abs(v.g-v.ref) > 1e-4*math.Abs(v.ref) {
					t.Errorf("dp=%d ep=%d step %d: %s %v, one rank %v", l.dp, l.ep, s+1, v.name, v.g, v.ref)
				}
			}
			for i, ls := range got[s].Layers {
				for e, c := range ls.Counts {
					if c != ref[s].Layers[i].Counts[e] {
						t.Errorf("dp=%d ep=%d step %d layer %d: counts %v, one rank %v", l.dp, l.ep, s+1, i, ls.Counts, ref[s].Layers[i].Counts)
						break
					}
				}
				if st := ls.Dispatch; st.Ranks != l.ep || len(st.SendMatrix) != l.ep {
					t.Errorf("dp=%d ep=%d layer %d: stats of %d ranks, send matrix %v", l.dp, l.ep, i, st.Ranks, st.SendMatrix)
				}
			}
		}
	}
}

// TestCapacity: with a capacity factor and padding, slots are dropped and
// padded, and the fractions say so.
func TestCapacity(t *testing.T) {
	cfg := tiny()
	cfg.CapacityFactor, cfg.Pad = 1, true
	rs := train(t, cfg, 1, 2, 2)
	if len(rs) != 2 {
		t.Fatalf("%d results", len(rs))
	}
	for _, ls := range rs[0].Layers {
		if f := ls.DroppedFraction() + ls.PaddedFraction(); f <= 0 || f >= 1 {
			t.Errorf("dropped %v + padded %v: a random router at capacity factor 1 drops and pads some slots", ls.DroppedFraction(), ls.PaddedFraction())
		}
		if ls.Dispatch.Capacity == 0 {
			t.Errorf("the dispatch is not static: %+v", ls.Dispatch)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := moegpt.Default().Validate(); err != nil {
		t.Fatal(err)
	}
	c := moegpt.Default()
	c.K, c.Pad = 9, true
	if err := c.Validate(); err == nil {
		t.Fatal("K > E and padding without capacity accepted")
	}
}

// TestCheckLayout: layouts that do not split the experts or the batch are
// rejected with a message naming the values that would work.
func TestCheckLayout(t *testing.T) {
	c := moegpt.Default() // E=8
	for _, tc := range []struct {
		batch, dp, ep int
		want          string // empty: accepted
	}{
		{16, 1, 4, ""},
		{16, 2, 8, ""},
		{0, 3, 1, ""}, // no batch: the experts only
		{16, 1, 3, "ep (3) must divide the experts (8); ep can be 1, 2, 4 or 8"},
		{16, 3, 1, "dp × ep (3 × 1) must divide the batch (16 sequences)"},
		{16, 4, 8, "dp × ep (4 × 8) must divide the batch"},
		{16, 0, 1, "must be at least 1"},
	} {
		err := c.CheckLayout(tc.batch, tc.dp, tc.ep)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("dp=%d ep=%d: %v", tc.dp, tc.ep, err)
		case tc.want != "" && (!errors.Is(err, moegpt.ErrConfig) || !errors.Is(err, loom.ErrInvalid) || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("dp=%d ep=%d: %v; want ErrConfig with %q", tc.dp, tc.ep, err, tc.want)
		}
	}
}

// TestTrainerRejectsBadRun: a run the layout cannot split, or an invalid
// one, is refused by NewTrainer with ErrConfig.
func TestTrainerRejectsBadRun(t *testing.T) {
	cfg := tiny()
	init := moegpt.RandomInit(cfg, 7)
	odd, slow := tinyRun(), tinyRun()
	odd.B, slow.LR = 6, 0
	for _, tc := range []struct {
		name string
		run  tinygpt.Config
		want string
	}{
		{"batch", odd, "dp × ep (1 × 4) must divide the batch (6 sequences)"},
		{"learning rate", slow, "lr=0 must be positive"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := placementtest.Simulate(context.Background(), []int{1, 4}, []string{"dp", "ep"}, func(ctx context.Context, m *mesh.Mesh) error {
				_, err := moegpt.NewTrainer(ctx, m, cfg, init, "ep", moegpt.WithRun(tc.run), moegpt.WithModel(moegpt.WithDataParallel("dp")))
				return err
			})
			if !errors.Is(err, moegpt.ErrConfig) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%v; want ErrConfig with %q", err, tc.want)
			}
		})
	}
}
