package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// stageTensors are two pipeline stages' tensors: stage 0 holds "a", stage
// 1 holds "b", each on its stage's tp sub-mesh.
var stageTensors = map[string]tdef{
	"a": {shape: []int{5, 3}, dtype: comm.Float32, seed: 11},
	"b": {shape: []int{3}, dtype: comm.Float64, seed: 12},
}

// stageState builds the tensors of this rank's stage on a pp×tp mesh.
func stageState(m *mesh.Mesh, p placement.Placement) (map[string]*placement.Spec, State, error) {
	tp, err := m.Sub("tp")
	if err != nil {
		return nil, State{}, err
	}
	stage, err := m.Local("pp")
	if err != nil {
		return nil, State{}, err
	}
	name := []string{"a", "b"}[stage]
	d := stageTensors[name]
	s, err := placement.NewSpec(tp, d.shape, d.dtype, []placement.Placement{p})
	if err != nil {
		return nil, State{}, err
	}
	specs := map[string]*placement.Spec{name: s}
	st, err := stateOn(specs, map[string]tdef{name: d})
	return specs, st, err
}

// TestStages saves a pipeline's stages, each rank passing only its own
// stage's tensor on its stage's sub-mesh, loads them all on one rank,
// then back onto the stages with other placements.
func TestStages(t *testing.T) {
	root := t.TempDir()
	var path string
	simulate(t, []int{2, 2}, []string{"pp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		_, st, err := stageState(m, S0)
		if err != nil {
			return err
		}
		p, err := Save(ctx, root, st)
		if m.Rank() == 0 {
			path = p
		}
		return err
	})
	if err := loadCheck(path, stageTensors); err != nil {
		t.Fatal(err)
	}
	simulate(t, []int{2, 2}, []string{"pp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		specs, _, err := stageState(m, R)
		if err != nil {
			return err
		}
		st, err := Load(ctx, path, specs)
		if err != nil {
			return err
		}
		for n, x := range st.Tensors {
			if err := bitsEqual(x.LocalData(), stageTensors[n].full()); err != nil {
				return fmt.Errorf("%s: %v", n, err)
			}
		}
		return nil
	})
}

// TestRanksDisagree: a tensor laid out differently by two ranks, or not
// passed by a rank of its mesh, is refused with ErrMismatch on every rank.
func TestRanksDisagree(t *testing.T) {
	d := tdef{shape: []int{4, 2}, dtype: comm.Float32, seed: 1}
	cases := []struct {
		name string
		lay  func(m *mesh.Mesh) map[string]tdef
		p    func(m *mesh.Mesh) placement.Placement
		says string
	}{
		{"layouts differ", func(*mesh.Mesh) map[string]tdef { return map[string]tdef{"x": d} },
			func(m *mesh.Mesh) placement.Placement { return []placement.Placement{S0, R, S0}[m.Rank()] }, `tensor "x": rank 1's layout differs`},
		{"not passed", func(m *mesh.Mesh) map[string]tdef {
			if m.Rank() == 2 {
				return nil
			}
			return map[string]tdef{"x": d}
		}, func(*mesh.Mesh) placement.Placement { return S0 }, "rank 2 did not pass it"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			root := t.TempDir()
			err := simulateErr([]int{3}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
				defs := c.lay(m)
				specs, err := specsOn(m, defs, func(m *mesh.Mesh, _ string, _ tdef) ([]placement.Placement, []placement.SpecOption) {
					return []placement.Placement{c.p(m)}, nil
				})
				if err != nil {
					return err
				}
				st, err := stateOn(specs, defs)
				if err != nil {
					return err
				}
				_, err = Save(ctx, root, st, WithComm(m.World()))
				if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), c.says) {
					return fmt.Errorf("got %v, want ErrMismatch saying %q", err, c.says)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}
