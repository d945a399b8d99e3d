package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
)

// A fused tensor saved in one form loads into the other ([C·R, …] and
// [C, R, …], tensor parallelism's form of a fused projection), on other
// ranks and placements, with uneven shards that cut across the chunks:
// every loaded block equals the same elements of the saved tensor.
func TestLoadFusedForms(t *testing.T) {
	flat := []int{6, 4}    // C = 2 chunks of R = 3 rows
	fine := []int{2, 3, 4} // the same elements
	cases := []struct {
		name      string
		saveShape []int
		saveMesh  []int
		savePlace placement.Placement
		loadShape []int
		loadMesh  []int
		loadPlace placement.Placement
	}{
		{"fused rows on 4 → chunks' rows on 2", flat, []int{4}, S0, fine, []int{2}, S1},
		{"chunks' rows on 2 → fused rows on 4", fine, []int{2}, S1, flat, []int{4}, S0},
		{"fused columns on 3 → chunks on 2", flat, []int{3}, S1, fine, []int{2}, S0},
		{"chunks' columns on 3 → fused rows on 5", fine, []int{3}, placement.Shard(2), flat, []int{5}, S0},
		{"replicated fused → chunks' rows on 3", flat, []int{1}, R, fine, []int{3}, S1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			full := make([]float32, 24)
			for i := range full {
				full[i] = float32(i) + 0.5
			}
			var dir string
			simulate(t, c.saveMesh, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				s, err := placement.NewSpec(m, c.saveShape, comm.Float32, []placement.Placement{c.savePlace})
				if err != nil {
					return err
				}
				x, err := placement.FromFull(s, full)
				if err != nil {
					return err
				}
				d, err := Save(ctx, root, State{Tensors: map[string]*placement.DTensor{"qkv": x}})
				if m.Rank() == 0 {
					dir = d
				}
				return err
			})
			simulate(t, c.loadMesh, []string{"y"}, func(ctx context.Context, m *mesh.Mesh) error {
				s, err := placement.NewSpec(m, c.loadShape, comm.Float32, []placement.Placement{c.loadPlace})
				if err != nil {
					return err
				}
				st, err := Load(ctx, dir, map[string]*placement.Spec{"qkv": s})
				if err != nil {
					return err
				}
				want, err := placement.FromFull(s, full)
				if err != nil {
					return err
				}
				if err := bitsEqual(st.Tensors["qkv"].LocalData(), want.LocalData()); err != nil {
					return fmt.Errorf("rank %d: %w", m.Rank(), err)
				}
				return nil
			})
		})
	}
}

// part is a Stateful of one tensor and one entry, for the job helpers.
type part struct {
	x    *placement.DTensor
	n    int64
	fail error
}

func (p *part) StateDict(prefix string) (map[string]*placement.DTensor, map[string]any, error) {
	return map[string]*placement.DTensor{prefix + "x": p.x}, map[string]any{prefix + "n": p.n}, p.fail
}

func (p *part) LoadStateDict(prefix string, entries map[string]any) error {
	n, ok := entries[prefix+"n"].(int64)
	if !ok {
		return fmt.Errorf("no entry %q", prefix+"n")
	}
	p.n = n
	return nil
}

// JobState and LoadJob: a job's parts under their prefixes, the step and
// user entries round-trip in place, on another layout; bad prefixes, a
// part's error and a checkpoint of another job are refused, with nothing
// written into the tensors.
func TestJobStateAndLoadJob(t *testing.T) {
	root := t.TempDir()
	full := []float32{1, 2, 3, 4, 5}
	var dir string
	simulate(t, []int{2}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		s, err := placement.NewSpec(m, []int{5}, comm.Float32, []placement.Placement{S0})
		if err != nil {
			return err
		}
		x, err := placement.FromFull(s, full)
		if err != nil {
			return err
		}
		st, err := JobState(7, Parts{"a": &part{x: x, n: 3}}, map[string]any{"note": "hi"})
		if err != nil {
			return err
		}
		for _, bad := range []Parts{{"": &part{x: x}}, {"a.b": &part{x: x}}, {"user": &part{x: x}}, {"a": nil}, {"a": &part{x: x, fail: errors.New("boom")}}} {
			if _, err := JobState(1, bad, nil); err == nil {
				return fmt.Errorf("JobState(%v) took it", bad)
			}
		}
		d, err := Save(ctx, root, st)
		if m.Rank() == 0 {
			dir = d
		}
		return err
	})
	simulate(t, []int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		s, err := placement.NewSpec(m, []int{5}, comm.Float32, []placement.Placement{S0})
		if err != nil {
			return err
		}
		zero, err := placement.NewLocal(s, make([]float32, s.LocalShape()[0]))
		if err != nil {
			return err
		}
		p := &part{x: zero}
		// Another job's parts: its tensor is not in the checkpoint.
		if _, _, err := LoadJob(ctx, dir, Parts{"b": p}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `"b.x"`) {
			return fmt.Errorf("another job's parts: %v, want ErrInvalid naming b.x", err)
		}
		for _, v := range zero.LocalData().([]float32) {
			if v != 0 {
				return fmt.Errorf("a refused load wrote %v", zero.LocalData())
			}
		}
		step, user, err := LoadJob(ctx, dir, Parts{"a": p})
		if err != nil {
			return err
		}
		want, err := placement.FromFull(s, full)
		if err != nil {
			return err
		}
		if err := bitsEqual(zero.LocalData(), want.LocalData()); err != nil {
			return err
		}
		if step != 7 || p.n != 3 || user["note"] != "hi" || len(user) != 1 {
			return fmt.Errorf("step %d, entry %d, user %v; want 7, 3, map[note:hi]", step, p.n, user)
		}
		return nil
	})
}

// Module saves the parameters by name and a Dropout's random state under
// its path: a model loaded from the checkpoint draws the masks the saved
// one would draw next, so its next forward is the same bits, and the
// state is not just the seed (one without it differs).
func TestModuleDropoutState(t *testing.T) {
	simulate(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		build := func(seed uint64) (*parallel.Sequential, *autograd.Tape, error) {
			tape := autograd.NewTape()
			l, err := parallel.NewLinear(tape, m, 8, 8, parallel.WithName("0"), parallel.WithInit(parallel.Normal(0.5, seed)))
			if err != nil {
				return nil, nil, err
			}
			d, err := parallel.NewDropout(0.5, 9)
			if err != nil {
				return nil, nil, err
			}
			s, err := parallel.NewSequential(l, d)
			return s, tape, err
		}
		forward := func(s *parallel.Sequential, tape *autograd.Tape) ([]float32, error) {
			spec, err := placement.NewSpec(m, []int{2, 8}, comm.Float32, []placement.Placement{R})
			if err != nil {
				return nil, err
			}
			x, err := placement.FromFull(spec, make16())
			if err != nil {
				return nil, err
			}
			xv, err := tape.Constant(x)
			if err != nil {
				return nil, err
			}
			y, err := s.Forward(ctx, xv)
			if err != nil {
				return nil, err
			}
			out := slices.Clone(y.Data().LocalData().([]float32))
			tape.Reset()
			return out, nil
		}
		a, tapeA, err := build(1)
		if err != nil {
			return err
		}
		for range 3 {
			if _, err := forward(a, tapeA); err != nil {
				return err
			}
		}
		st, err := JobState(3, Parts{"model": Module(a)}, nil)
		if err != nil {
			return err
		}
		if _, ok := st.Entries["model.1.steps"]; !ok {
			return fmt.Errorf("no dropout state among %v", slices.Sorted(maps.Keys(st.Entries)))
		}
		dir, err := Save(ctx, t.TempDir(), st)
		if err != nil {
			return err
		}
		want, err := forward(a, tapeA)
		if err != nil {
			return err
		}
		for _, load := range []bool{true, false} {
			b, tapeB, err := build(2)
			if err != nil {
				return err
			}
			if load {
				if _, _, err := LoadJob(ctx, dir, Parts{"model": Module(b)}); err != nil {
					return err
				}
			} else {
				// The parameters alone: the masks start over.
				if _, _, err := LoadJob(ctx, dir, Parts{"model": paramsOnly{Module(b)}}); err != nil {
					return err
				}
			}
			got, err := forward(b, tapeB)
			if err != nil {
				return err
			}
			if err := bitsEqual(got, want); (err == nil) != load {
				return fmt.Errorf("with the dropout state %v: the next forward's match: %v", load, err)
			}
		}
		return nil
	})
}

// paramsOnly is a Stateful that loads no entries.
type paramsOnly struct{ Stateful }

func (paramsOnly) LoadStateDict(string, map[string]any) error { return nil }

func make16() []float32 {
	x := make([]float32, 16)
	for i := range x {
		x[i] = float32(i%5) - 2
	}
	return x
}
