package autograd_test

import (
	"context"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
)

// mesh1 is a one-rank mesh with one axis.
func mesh1(t *testing.T, axis string) *mesh.Mesh {
	t.Helper()
	w, err := local.NewWorld(1)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mesh.New(w.Comm(0), []int{1}, []string{axis})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// wave32 returns n deterministic values in [-0.5, 0.5).
func wave32(n, seed int) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = float32((i*7+seed*13)%17)/17 - 0.5 + float32(i%5)*1e-3
	}
	return out
}

// replicated is a Replicate float32 tensor of shape on m holding data.
func replicated(t *testing.T, m *mesh.Mesh, shape []int, data []float32) *placement.DTensor {
	t.Helper()
	pl := make([]placement.Placement, m.NDim())
	for i := range pl {
		pl[i] = placement.Replicate()
	}
	s, err := placement.NewSpec(m, shape, comm.Float32, pl)
	if err != nil {
		t.Fatal(err)
	}
	d, err := placement.NewLocal(s, data)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// stage is one case of the split-backward tests: it builds parameters on
// tape and records a forward from the stage input x (nil for a first
// stage, whose input is token ids) to an output.
type stage struct {
	name  string
	in    []int // the input's shape; nil: no input leaf
	shard bool  // the input is Shard(0) (on the one-rank mesh: whole)
	build func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) (params []*autograd.Value, fwd func(ctx context.Context, x *autograd.Value) (*autograd.Value, error))
}

func mustParams(t *testing.T, m parallel.Module) []*autograd.Value {
	t.Helper()
	ps, err := parallel.Params(m)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

func splitStages() []stage {
	const b, s, d = 2, 4, 8
	ids := func(m *mesh.Mesh, vocab int) (*autograd.Indices, error) {
		v := make([]int64, b*s)
		for i := range v {
			v[i] = int64((i*5 + 3) % vocab)
		}
		return autograd.IndicesFromFull(m, []int{b, s}, []placement.Placement{placement.Replicate()}, v)
	}
	params := func(ps ...[]*autograd.Value) []*autograd.Value { return slices.Concat(ps...) }
	return []stage{
		{"Linear", []int{b, s, d}, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			l, err := parallel.NewLinear(tape, m, d, 2*d, parallel.WithName("lin"))
			if err != nil {
				t.Fatal(err)
			}
			return mustParams(t, l), l.Forward
		}},
		{"LayerNorm", []int{b, s, d}, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			n, err := parallel.NewLayerNorm(tape, m, d, parallel.WithName("ln"), parallel.WithInit(parallel.Normal(0.5, 3)), parallel.WithBiasInit(parallel.Normal(0.1, 4)))
			if err != nil {
				t.Fatal(err)
			}
			return mustParams(t, n), n.Forward
		}},
		{"Embedding", nil, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			e, err := parallel.NewEmbedding(tape, m, 11, d, parallel.WithName("wte"))
			if err != nil {
				t.Fatal(err)
			}
			return mustParams(t, e), func(ctx context.Context, _ *autograd.Value) (*autograd.Value, error) {
				x, err := ids(m, 11)
				if err != nil {
					return nil, err
				}
				return e.Forward(ctx, x)
			}
		}},
		{"Attention", []int{b, s, d}, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			a, err := parallel.NewAttention(tape, m, d, 2, parallel.WithName("attn"), parallel.WithBiasInit(parallel.Normal(0.1, 5)))
			if err != nil {
				t.Fatal(err)
			}
			return mustParams(t, a), a.Forward
		}},
		{"MoE", []int{b * s, d}, true, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			const e, hd = 4, 6
			wr, err := tape.Param("router", replicated(t, m, []int{e, d}, wave32(e*d, 2)))
			if err != nil {
				t.Fatal(err)
			}
			router, err := moe.NewRouter(wr, moe.RouterConfig{K: 2, Renormalize: true})
			if err != nil {
				t.Fatal(err)
			}
			ex, err := moe.ShardExperts(tape, m, "ep", e, hd, d, wave32(e*hd*d, 3), wave32(e*hd, 4), wave32(e*d*hd, 5), wave32(e*d, 6))
			if err != nil {
				t.Fatal(err)
			}
			layer := &moe.Layer{Router: router, Experts: ex}
			return params([]*autograd.Value{wr}, []*autograd.Value{ex.W1, ex.B1, ex.W2, ex.B2}), func(ctx context.Context, x *autograd.Value) (*autograd.Value, error) {
				out, err := layer.Forward(ctx, x)
				if err != nil {
					return nil, err
				}
				return out.Y, nil
			}
		}},
		{"Add", []int{b, s, d}, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			// Add computes both gradients at once: the weight's is kept
			// from the input half for the weight half.
			w, err := tape.Param("w", replicated(t, m, []int{b, s, d}, wave32(b*s*d, 6)))
			if err != nil {
				t.Fatal(err)
			}
			return []*autograd.Value{w}, func(_ context.Context, x *autograd.Value) (*autograd.Value, error) {
				y, err := autograd.Mul(x, x)
				if err != nil {
					return nil, err
				}
				return autograd.Add(y, w)
			}
		}},
		{"GPTBlock", []int{b, s, d}, false, func(t *testing.T, tape *autograd.Tape, m *mesh.Mesh) ([]*autograd.Value, func(context.Context, *autograd.Value) (*autograd.Value, error)) {
			cfg := gpt.Config{Vocab: 16, Width: d, Heads: 2, Layers: 1, MLPWidth: 2 * d, SeqLen: s, InitStd: 0.3, LNEps: 1e-5}
			md, err := gpt.New(tape, m, cfg, gpt.WithSeed(7))
			if err != nil {
				t.Fatal(err)
			}
			blk := md.Blocks[0]
			var ps []*autograd.Value
			for _, p := range md.Params() {
				if len(p.Name()) > 2 && p.Name()[:2] == "h." {
					ps = append(ps, p)
				}
			}
			return ps, blk.Forward
		}},
	}
}

// stageGrads runs one case's forward from a fresh tape and the backward
// given by how, and returns the gradients of the parameters then of the
// input (by name), and the number of ops the input half deferred.
func stageGrads(t *testing.T, st stage, how string) (map[string][]float32, int) {
	t.Helper()
	ctx := context.Background()
	m := mesh1(t, "ep")
	tape := autograd.NewTape()
	ps, fwd := st.build(t, tape, m)
	var x *autograd.Value
	if st.in != nil {
		n := 1
		for _, s := range st.in {
			n *= s
		}
		var err error
		xd := replicated(t, m, st.in, wave32(n, 9))
		if st.shard {
			s, err := xd.Spec().With([]placement.Placement{placement.Shard(0)})
			if err != nil {
				t.Fatal(err)
			}
			if xd, err = placement.NewLocal(s, wave32(n, 9)); err != nil {
				t.Fatal(err)
			}
		}
		if x, err = tape.Param("input", xd); err != nil {
			t.Fatal(err)
		}
	}
	y, err := fwd(ctx, x)
	if err != nil {
		t.Fatal(err)
	}
	n := 1
	for _, s := range y.Spec().Shape() {
		n *= s
	}
	g, err := placement.NewLocal(y.Spec(), wave32(n, 11)) // one rank: the local block is whole
	if err != nil {
		t.Fatal(err)
	}
	deferred := 0
	switch how {
	case "unsplit":
		err = tape.BackwardFrom(ctx, []*autograd.Value{y}, []*placement.DTensor{g})
	case "split":
		var inputs []*autograd.Value
		if x != nil {
			inputs = append(inputs, x)
		}
		var w *autograd.WeightGrads
		w, err = tape.BackwardInput(ctx, []*autograd.Value{y}, []*placement.DTensor{g}, inputs)
		if err != nil {
			break
		}
		deferred = w.Ops()
		if x != nil && x.Grad() == nil {
			t.Fatalf("%s: the input half left the input's gradient nil", st.name)
		}
		for _, p := range ps {
			if p.Grad() != nil {
				t.Fatalf("%s: the input half computed %q's gradient", st.name, p.Name())
			}
		}
		err = tape.BackwardWeight(ctx, w)
	}
	if err != nil {
		t.Fatalf("%s %s: %v", st.name, how, err)
	}
	out := map[string][]float32{}
	if x != nil {
		ps = append(ps, x)
	}
	for _, p := range ps {
		if p.Grad() == nil {
			t.Fatalf("%s %s: %q has no gradient", st.name, how, p.Name())
		}
		full, err := p.Grad().Full(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		out[p.Name()] = slices.Clone(full.([]float32))
	}
	return out, deferred
}

// TestSplitBackwardBitwise: BackwardInput then BackwardWeight give every
// parameter and the stage input the gradient BackwardFrom gives, bit for
// bit, on each op with parameters and on a GPT block; the input half
// leaves the weights to the weight half.
func TestSplitBackwardBitwise(t *testing.T) {
	for _, st := range splitStages() {
		t.Run(st.name, func(t *testing.T) {
			want, _ := stageGrads(t, st, "unsplit")
			got, deferred := stageGrads(t, st, "split")
			if deferred == 0 {
				t.Errorf("the input half deferred no op")
			}
			for name, w := range want {
				g := got[name]
				for i := range w {
					if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
						t.Fatalf("%s[%d]: split %v, unsplit %v", name, i, g[i], w[i])
					}
				}
			}
		})
	}
}

// tinyLoss records the tiny test GPT's loss for batch seed s on the
// current scope of tape.
func tinyLoss(ctx context.Context, md *gpt.Model, tape *autograd.Tape, m *mesh.Mesh, s int) (*autograd.Value, error) {
	const b, T = 2, 4
	v, w := make([]int64, b*T), make([]int64, b*T)
	for i := range v {
		v[i], w[i] = int64((i*3+s)%16), int64((i*5+2*s)%16)
	}
	r := []placement.Placement{placement.Replicate()}
	x, err := autograd.IndicesFromFull(m, []int{b, T}, r, v)
	if err != nil {
		return nil, err
	}
	y, err := autograd.IndicesFromFull(m, []int{b, T}, r, w)
	if err != nil {
		return nil, err
	}
	return md.Forward(ctx, tape, x, y)
}

// TestGraphsInFlight: the forwards of two micro-batches recorded in two
// Graphs of one tape, their backwards run later in reverse order (one
// split), give the gradients of running them one after the other, bit for
// bit, and the activation count is the two graphs' sum while both are in
// flight.
func TestGraphsInFlight(t *testing.T) {
	ctx := context.Background()
	cfg := gpt.Config{Vocab: 16, Width: 8, Heads: 2, Layers: 2, MLPWidth: 16, SeqLen: 4, InitStd: 0.3, LNEps: 1e-5}
	run := func(inFlight bool) (map[string][]float32, [3]int64) {
		m := mesh1(t, "dp")
		tape := autograd.NewTape()
		md, err := gpt.New(tape, m, cfg, gpt.WithSeed(3))
		if err != nil {
			t.Fatal(err)
		}
		var acts [3]int64
		if !inFlight {
			for _, s := range []int{1, 0} {
				loss, err := tinyLoss(ctx, md, tape, m, s)
				if err != nil {
					t.Fatal(err)
				}
				if err := tape.Backward(ctx, loss); err != nil {
					t.Fatal(err)
				}
			}
		} else {
			var gs [2]*autograd.Graph
			var losses [2]*autograd.Value
			for s := range gs {
				if gs[s], err = tape.NewGraph(); err != nil {
					t.Fatal(err)
				}
				if err := gs[s].Do(func() (err error) {
					losses[s], err = tinyLoss(ctx, md, tape, m, s)
					return err
				}); err != nil {
					t.Fatal(err)
				}
				acts[s] = tape.ActivationBytes()
			}
			if err := gs[1].Do(func() error {
				w, err := tape.BackwardInput(ctx, []*autograd.Value{losses[1]}, nil, nil)
				if err != nil {
					return err
				}
				// The weight half runs from the default scope: it
				// switches to graph 1 itself.
				return errors.Join(gs[0].Do(func() error { return nil }), tape.BackwardWeight(ctx, w))
			}); err != nil {
				t.Fatal(err)
			}
			acts[2] = tape.ActivationBytes()
			if err := gs[0].Do(func() error { return tape.Backward(ctx, losses[0]) }); err != nil {
				t.Fatal(err)
			}
			if a := tape.ActivationBytes(); a != 0 {
				t.Errorf("activations after both backwards: %d bytes, want 0", a)
			}
		}
		out := map[string][]float32{}
		for _, p := range md.Params() {
			full, err := p.Grad().Full(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			out[p.Name()] = slices.Clone(full.([]float32))
		}
		return out, acts
	}
	want, _ := run(false)
	got, acts := run(true)
	if acts[0] <= 0 || acts[1] != 2*acts[0] || acts[2] != acts[0] {
		t.Errorf("activation bytes: %d after graph 0's forward, %d after graph 1's (want twice), %d after graph 1's backward (want the first)", acts[0], acts[1], acts[2])
	}
	for name, w := range want {
		for i := range w {
			if math.Float32bits(got[name][i]) != math.Float32bits(w[i]) {
				t.Fatalf("%s[%d]: in flight %v, one after the other %v", name, i, got[name][i], w[i])
			}
		}
	}
}

// TestSplitErrors: the split backward's misuses are refused with
// ErrInvalid.
func TestSplitErrors(t *testing.T) {
	ctx := context.Background()
	m := mesh1(t, "x")
	tape := autograd.NewTape()
	w, err := tape.Param("w", replicated(t, m, []int{3, 2}, wave32(6, 1)))
	if err != nil {
		t.Fatal(err)
	}
	x, err := tape.Param("x", replicated(t, m, []int{2, 3}, wave32(6, 2)))
	if err != nil {
		t.Fatal(err)
	}
	y, err := autograd.MatMul(x, w)
	if err != nil {
		t.Fatal(err)
	}
	other := autograd.NewTape()
	cases := []struct {
		name string
		fn   func() error
		want string
	}{
		{"wrong gradient shape", func() error {
			return tape.BackwardFrom(ctx, []*autograd.Value{y}, []*placement.DTensor{replicated(t, m, []int{2, 3}, wave32(6, 3))})
		}, "gradient of output 0"},
		{"non-scalar without gradient", func() error {
			return tape.BackwardFrom(ctx, []*autograd.Value{y}, nil)
		}, "want a scalar"},
		{"input not a leaf", func() error {
			_, err := tape.BackwardInput(ctx, []*autograd.Value{y}, nil, []*autograd.Value{y})
			return err
		}, "not a leaf"},
		{"weight half of another tape", func() error {
			return other.BackwardWeight(ctx, &autograd.WeightGrads{})
		}, "another tape"},
	}
	for _, c := range cases {
		err := c.fn()
		if !errors.Is(err, autograd.ErrInvalid) || !contains(err, c.want) {
			t.Errorf("%s: got %v, want ErrInvalid containing %q", c.name, err, c.want)
		}
	}
	// A pending weight half blocks recording in its scope and a second
	// backward; it runs once.
	y, err = autograd.MatMul(x, w)
	if err != nil {
		t.Fatal(err)
	}
	g := replicated(t, m, []int{2, 2}, wave32(4, 4))
	wg, err := tape.BackwardInput(ctx, []*autograd.Value{y}, []*placement.DTensor{g}, []*autograd.Value{x})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := autograd.MatMul(x, w); !errors.Is(err, autograd.ErrInvalid) {
		t.Errorf("recording with a weight half pending: %v, want ErrInvalid", err)
	}
	if err := tape.BackwardWeight(ctx, wg); err != nil {
		t.Fatal(err)
	}
	if err := tape.BackwardWeight(ctx, wg); !errors.Is(err, autograd.ErrInvalid) {
		t.Errorf("second BackwardWeight: %v, want ErrInvalid", err)
	}
}

func contains(err error, s string) bool { return err != nil && strings.Contains(err.Error(), s) }
