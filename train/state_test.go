package train

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/b7ea7098/loom/checkpoint"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// A Trainer's whole job (the model, SGD with momentum, the schedule's
// position and the shuffled sampler's) saved after 3 of 6 steps and
// loaded into a new job gives the last 3 losses of the uninterrupted run
// bit for bit. Without the trainer's step (the schedule restarts) or the
// sampler's position they differ, which the test checks too.
func TestTrainerResumes(t *testing.T) {
	sched, err := WarmupCosine(0.2, 0.01, 2, 6)
	if err != nil {
		t.Fatal(err)
	}
	type job struct {
		net *tnet
		tr  *Trainer[Classification]
		s   *Sampler
		opt *optim.SGD
	}
	mk := func(m *mesh.Mesh) (*job, error) {
		n := newTnet(t, m)
		ps, err := parallel.Params(n.model)
		if err != nil {
			return nil, err
		}
		opt, err := optim.NewSGD(ps, 0.1, optim.WithMomentum(0.9), optim.WithDampening(0.1))
		if err != nil {
			return nil, err
		}
		tr, err := NewTrainer(n.model, n.tape, opt, n.loss, WithSchedule(sched, &opt.LR))
		if err != nil {
			return nil, err
		}
		s, err := n.data.Sampler(8, WithShuffle(3))
		if err != nil {
			return nil, err
		}
		return &job{n, tr, s, opt}, nil
	}
	parts := func(j *job, skip string) checkpoint.Parts {
		p := checkpoint.Parts{"model": checkpoint.Module(j.net.model), "optim": j.opt, "trainer": j.tr, "data": j.s}
		delete(p, skip)
		return p
	}
	fit := func(ctx context.Context, j *job, steps int) ([]float64, error) {
		h, err := j.tr.Fit(ctx, j.net.data, j.s, steps)
		if err != nil {
			return nil, err
		}
		var out []float64
		for _, r := range h.Steps {
			out = append(out, r.Loss)
		}
		return out, nil
	}
	for _, skip := range []string{"", "trainer", "data"} {
		placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
			a, err := mk(m)
			if err != nil {
				return err
			}
			want, err := fit(ctx, a, 6)
			if err != nil {
				return err
			}
			b, err := mk(m)
			if err != nil {
				return err
			}
			if _, err := fit(ctx, b, 3); err != nil {
				return err
			}
			st, err := checkpoint.JobState(b.tr.Steps(), parts(b, skip), nil)
			if err != nil {
				return err
			}
			dir, err := checkpoint.Save(ctx, t.TempDir(), st)
			if err != nil {
				return err
			}
			c, err := mk(m)
			if err != nil {
				return err
			}
			if _, _, err := checkpoint.LoadJob(ctx, dir, parts(c, skip)); err != nil {
				return err
			}
			got, err := fit(ctx, c, 6)
			if err != nil {
				return err
			}
			same := len(got) == 3
			for i := range got {
				same = same && math.Float64bits(got[i]) == math.Float64bits(want[3+i])
			}
			if same != (skip == "") {
				t.Errorf("without part %q: resumed losses %v, straight %v", skip, got, want[3:])
			}
			return nil
		})
	}
}

// LoadStateDict refuses missing entries, entries of another type and a
// position outside the sampler's epoch, and changes nothing.
func TestLoadStateDictRejects(t *testing.T) {
	s, err := NewSampler(10, 2, 0, 1)
	if err != nil {
		t.Fatal(err)
	}
	s.Next()
	for _, entries := range []map[string]any{
		{"d.epoch": int64(0)},
		{"d.epoch": 0, "d.index": int64(1)},
		{"d.epoch": int64(0), "d.index": int64(5)},
	} {
		if err := s.LoadStateDict("d.", entries); !errors.Is(err, ErrInvalid) {
			t.Errorf("%v: %v, want ErrInvalid", entries, err)
		}
	}
	if s.State() != (SamplerState{Epoch: 0, Index: 1}) {
		t.Errorf("position %+v after refused loads", s.State())
	}
	var tr Trainer[int]
	if err := tr.LoadStateDict("t.", map[string]any{"t.step": int64(-1)}); !errors.Is(err, ErrInvalid) {
		t.Errorf("a negative step: %v", err)
	}
}
