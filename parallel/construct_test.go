package parallel

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestConstructors: the constructors name, shape and fill their
// parameters as documented, and reject what does not fit.
func TestConstructors(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		build := map[string]func(opts ...LayerOption) (Module, error){
			"linear": func(o ...LayerOption) (Module, error) { return NewLinear(tape, m, 3, 2, o...) },
			"embed":  func(o ...LayerOption) (Module, error) { return NewEmbedding(tape, m, 5, 3, o...) },
			"norm":   func(o ...LayerOption) (Module, error) { return NewLayerNorm(tape, m, 3, o...) },
			"attn":   func(o ...LayerOption) (Module, error) { return NewAttention(tape, m, 4, 2, o...) },
			"mlp":    func(o ...LayerOption) (Module, error) { return NewMLP(tape, m, 3, 6, o...) },
		}
		for _, tc := range []struct {
			build  string
			opts   []LayerOption
			names  []string // parameter names in Params order
			shapes [][]int
			err    string // non-empty: the error must wrap ErrInvalid and contain it
		}{
			{build: "linear", opts: []LayerOption{WithName("h.0.mlp.fc")}, names: []string{"h.0.mlp.fc.weight", "h.0.mlp.fc.bias"}, shapes: [][]int{{2, 3}, {2}}},
			{build: "linear", opts: []LayerOption{WithBias(false)}, names: []string{"weight"}, shapes: [][]int{{2, 3}}},
			{build: "embed", opts: []LayerOption{WithName("wte")}, names: []string{"wte"}, shapes: [][]int{{5, 3}}},
			{build: "norm", opts: []LayerOption{WithName("ln_f"), WithEps(1e-6)}, names: []string{"ln_f.weight", "ln_f.bias"}, shapes: [][]int{{3}, {3}}},
			{build: "attn", opts: []LayerOption{WithName("attn")}, names: []string{"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias"}, shapes: [][]int{{12, 4}, {12}, {4, 4}, {4}}},
			{build: "mlp", opts: []LayerOption{WithName("mlp"), WithDType(comm.Float64)}, names: []string{"mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"}, shapes: [][]int{{6, 3}, {6}, {3, 6}, {3}}},
			{build: "linear", opts: []LayerOption{WithInit(Values([]float32{1, 2}))}, err: "given 2 float32"},
			{build: "linear", opts: []LayerOption{WithInit(ByName(map[string][]float32{}))}, err: "no value"},
			{build: "linear", opts: []LayerOption{WithEps(1)}, err: "WithEps"},
			{build: "linear", opts: []LayerOption{WithDType(comm.Int32)}, err: "dtype"},
			{build: "embed", opts: []LayerOption{WithBias(true)}, err: "no bias"},
			{build: "norm", opts: []LayerOption{WithEps(0)}, err: "epsilon"},
			{build: "norm", opts: []LayerOption{WithBias(false)}, err: "always has a bias"},
			{build: "linear", opts: []LayerOption{WithInit(Normal(-1, 0))}, err: "std"},
		} {
			mod, err := build[tc.build](tc.opts...)
			if tc.err != "" {
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("%s: error %v; want ErrInvalid with %q", tc.build, err, tc.err)
				}
				continue
			}
			if err != nil {
				t.Errorf("%s: %v", tc.build, err)
				continue
			}
			ps, err := Params(mod)
			if err != nil {
				return err
			}
			var names []string
			for i, p := range ps {
				names = append(names, p.Name())
				if i < len(tc.shapes) && !slices.Equal(p.Spec().Shape(), tc.shapes[i]) {
					t.Errorf("%s: %s has shape %v, want %v", tc.build, p.Name(), p.Spec().Shape(), tc.shapes[i])
				}
			}
			if !slices.Equal(names, tc.names) {
				t.Errorf("%s: parameters %v, want %v", tc.build, names, tc.names)
			}
		}
		if _, err := NewAttention(tape, m, 6, 4); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "heads") {
			t.Errorf("6 channels over 4 heads: %v", err)
		}
		if _, err := NewLinear(nil, m, 1, 1); !errors.Is(err, ErrInvalid) {
			t.Errorf("nil tape: %v", err)
		}
		if _, err := NewMLP(tape, m, 0, 1); !errors.Is(err, ErrInvalid) {
			t.Errorf("zero width: %v", err)
		}
		return nil
	})
}

// TestInits: every Init fills as documented; one Normal shared by two
// constructors draws one stream (the second weight continues the first),
// and the default weight init differs by parameter name.
func TestInits(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		vals := func(l *Linear) []float32 { return l.Weight.Data().LocalData().([]float32) }
		shared := Normal(1, 7)
		a, err := NewLinear(tape, m, 2, 2, WithInit(shared))
		if err != nil {
			return err
		}
		b, err := NewLinear(tape, m, 2, 2, WithInit(shared))
		if err != nil {
			return err
		}
		both, err := NewLinear(tape, m, 2, 4, WithInit(Normal(1, 7)))
		if err != nil {
			return err
		}
		if got, want := append(slices.Clone(vals(a)), vals(b)...), vals(both); !slices.Equal(got, want) {
			t.Errorf("a shared Normal drew %v then %v; one stream gives %v", vals(a), vals(b), want)
		}
		if slices.Equal(vals(a), vals(b)) {
			t.Error("a shared Normal repeated its draws")
		}
		x, err := NewLinear(tape, m, 2, 2, WithName("x"))
		if err != nil {
			return err
		}
		y, err := NewLinear(tape, m, 2, 2, WithName("y"))
		if err != nil {
			return err
		}
		x2, err := NewLinear(tape, m, 2, 2, WithName("x"))
		if err != nil {
			return err
		}
		if slices.Equal(vals(x), vals(y)) || !slices.Equal(vals(x), vals(x2)) {
			t.Errorf("default init: x %v, y %v, x again %v; want x ≠ y and x = x again", vals(x), vals(y), vals(x2))
		}
		for _, tc := range []struct {
			in   Init
			want []float32
		}{
			{Zeros(), []float32{0, 0, 0, 0}},
			{Ones(), []float32{1, 1, 1, 1}},
			{Values([]float32{1, 2, 3, 4}), []float32{1, 2, 3, 4}},
			{ByName(map[string][]float32{"w.weight": {4, 3, 2, 1}}), []float32{4, 3, 2, 1}},
		} {
			l, err := NewLinear(tape, m, 2, 2, WithName("w"), WithInit(tc.in), WithBiasInit(Ones()))
			if err != nil {
				return err
			}
			if !slices.Equal(vals(l), tc.want) {
				t.Errorf("init %+v: %v, want %v", tc.in.kind, vals(l), tc.want)
			}
			if bias := l.Bias.Data().LocalData().([]float32); !slices.Equal(bias, []float32{1, 1}) {
				t.Errorf("WithBiasInit(Ones()): bias %v", bias)
			}
		}
		return nil
	})
}
