package checkpoint

import (
	"context"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// testTensors are uneven on 2, 3 and 5 ranks, and include a zero-size
// tensor, a scalar and a tensor with fewer rows than some meshes' ranks.
var testTensors = map[string]tdef{
	"w": {shape: []int{7, 5}, dtype: comm.Float32, seed: 1},
	"b": {shape: []int{5}, dtype: comm.Float64, seed: 2},
	"e": {shape: []int{0, 3}, dtype: comm.Float32, seed: 3},
	"s": {shape: []int{}, dtype: comm.Float32, seed: 4},
	"m": {shape: []int{2, 4}, dtype: comm.Float32, seed: 5},
}

var (
	R  = placement.Replicate()
	S0 = placement.Shard(0)
	S1 = placement.Shard(1)
)

// A mesh layout: the mesh and each tensor's placements on it.
type meshLayout struct {
	name  string
	shape []int
	axes  []string
	lay   layoutFn
}

// byName lays out tensors from a table of placements.
func byName(t map[string][]placement.Placement, opts map[string][]placement.SpecOption) layoutFn {
	return func(m *mesh.Mesh, name string, d tdef) ([]placement.Placement, []placement.SpecOption) {
		return t[name], opts[name]
	}
}

func allReplicated(n int) layoutFn {
	return func(*mesh.Mesh, string, tdef) ([]placement.Placement, []placement.SpecOption) {
		p := make([]placement.Placement, n)
		for i := range p {
			p[i] = R
		}
		return p, nil
	}
}

var (
	oneRank   = meshLayout{"one rank", []int{1}, []string{"x"}, allReplicated(1)}
	repl3     = meshLayout{"replicated on 3", []int{3}, []string{"dp"}, allReplicated(1)}
	dp2tp2    = meshLayout{"dp2×tp2", []int{2, 2}, []string{"dp", "tp"}, byName(map[string][]placement.Placement{"w": {R, S0}, "b": {S0, R}, "e": {R, S1}, "s": {R, R}, "m": {S1, S0}}, nil)}
	fsdpOverT = meshLayout{"fsdp over tp", []int{2, 2}, []string{"dp", "tp"}, byName(map[string][]placement.Placement{"w": {S0, S0}, "b": {S0, S0}, "e": {S1, S0}, "s": {R, R}, "m": {S0, S0}},
		map[string][]placement.SpecOption{"w": {placement.WithOrder(0, "tp", "dp")}, "b": {placement.WithOrder(0, "tp", "dp")}})}
	tp2    = meshLayout{"tp2", []int{2}, []string{"tp"}, byName(map[string][]placement.Placement{"w": {S1}, "b": {S0}, "e": {S0}, "s": {R}, "m": {S0}}, nil)}
	tp3    = meshLayout{"tp3", []int{3}, []string{"tp"}, byName(map[string][]placement.Placement{"w": {S0}, "b": {S0}, "e": {S1}, "s": {R}, "m": {S0}}, nil)}
	five   = meshLayout{"5 ranks", []int{5}, []string{"tp"}, byName(map[string][]placement.Placement{"w": {S1}, "b": {S0}, "e": {S0}, "s": {R}, "m": {S1}}, nil)}
	dp3tp2 = meshLayout{"dp3×tp2", []int{3, 2}, []string{"dp", "tp"}, byName(map[string][]placement.Placement{"w": {S1, S0}, "b": {S0, S0}, "e": {R, R}, "s": {R, R}, "m": {R, S1}}, nil)}
)

// saveOn saves testTensors laid out by l under root, with opts.
func saveOn(t *testing.T, root string, l meshLayout, defs map[string]tdef, opts ...Option) string {
	t.Helper()
	var path string
	simulate(t, l.shape, l.axes, func(ctx context.Context, m *mesh.Mesh) error {
		specs, err := specsOn(m, defs, l.lay)
		if err != nil {
			return err
		}
		st, err := stateOn(specs, defs)
		if err != nil {
			return err
		}
		p, err := Save(ctx, root, st, opts...)
		if m.Rank() == 0 {
			path = p
		}
		return err
	})
	return path
}

// TestRoundTripAcrossLayouts saves on one layout and loads on another:
// every loaded tensor equals the saved one bit for bit, and each rank
// reads exactly the bytes its blocks need (checksum blocks of 4 bytes, so
// no rounding), computed element by element from the manifest.
func TestRoundTripAcrossLayouts(t *testing.T) {
	cases := []struct{ from, to meshLayout }{
		{dp2tp2, oneRank},
		{oneRank, tp3},
		{tp2, tp3},
		{repl3, dp2tp2},
		{fsdpOverT, tp2},
		{tp3, dp3tp2},
		{five, oneRank},
		{dp3tp2, five},
		{dp2tp2, dp2tp2},
	}
	for _, c := range cases {
		t.Run(c.from.name+"→"+c.to.name, func(t *testing.T) {
			root := t.TempDir()
			path := saveOn(t, root, c.from, testTensors, WithStep(7), WithBlockSize(4))
			if want := filepath.Join(root, "step-0000000007"); path != want {
				t.Fatalf("Save returned %s, want %s", path, want)
			}
			m, err := readManifest("test", path)
			if err != nil {
				t.Fatal(err)
			}
			rec := &recorder{}
			simulate(t, c.to.shape, c.to.axes, func(ctx context.Context, msh *mesh.Mesh) error {
				specs, err := specsOn(msh, testTensors, c.to.lay)
				if err != nil {
					return err
				}
				st, err := Load(ctx, path, specs, withHook(rec.hook))
				if err != nil {
					return err
				}
				for _, n := range slices.Sorted(maps.Keys(testTensors)) {
					got := st.Tensors[n]
					if !got.Spec().Equal(specs[n]) {
						return fmt.Errorf("%s: loaded as %v, want %v", n, got.Spec(), specs[n])
					}
					full, err := got.Full(ctx)
					if err != nil {
						return err
					}
					if err := bitsEqual(full, testTensors[n].full()); err != nil {
						return fmt.Errorf("tensor %s: %v", n, err)
					}
				}
				return nil
			})
			// The bytes each rank read, against what its blocks need.
			got := rec.ranges("read")
			simulate(t, c.to.shape, c.to.axes, func(ctx context.Context, msh *mesh.Mesh) error {
				specs, err := specsOn(msh, testTensors, c.to.lay)
				if err != nil {
					return err
				}
				want := map[string][][2]int64{}
				for n, s := range specs {
					off, size, err := s.Box(msh.Rank())
					if err != nil {
						return err
					}
					for f, rs := range neededRanges(m.Tensors[n], off, size) {
						want[f] = append(want[f], rs...)
					}
				}
				for f := range want {
					want[f] = mergeRanges(want[f])
				}
				mine := got[msh.Rank()]
				if mine == nil {
					mine = map[string][][2]int64{}
				}
				if fmt.Sprint(mine) != fmt.Sprint(want) {
					return fmt.Errorf("read %v, want %v", mine, want)
				}
				return nil
			})
		})
	}
}
