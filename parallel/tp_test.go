package parallel

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// block is a pre-LN transformer block built from this package's modules:
// h = x + attn(ln1(x)); y = h + mlp(ln2(h)).
type block struct {
	Hooks
	ln1, ln2 *LayerNorm
	attn     *Attention
	mlp      *MLP
}

func (b *block) Children() []Child {
	return []Child{{"ln1", b.ln1}, {"attn", b.attn}, {"ln2", b.ln2}, {"mlp", b.mlp}}
}

const (
	blkB, blkT, blkD, blkH, blkF = 2, 5, 12, 6, 10 // T and F split unevenly over 2 and 3 ranks
)

func newBlock(m *mesh.Mesh) (*block, *autograd.Tape, error) {
	tape := autograd.NewTape()
	seed := uint64(1)
	param := func(name string, shape ...int) *autograd.Value {
		seed++
		dt, err := replicated(m, shape, seed)
		if err != nil {
			panic(err)
		}
		p, err := tape.Param(name, dt)
		if err != nil {
			panic(err)
		}
		return p
	}
	lin := func(name string, out, in int) *Linear {
		return &Linear{Weight: param(name+".weight", out, in), Bias: param(name+".bias", out)}
	}
	ln := func(name string) *LayerNorm {
		return &LayerNorm{Weight: param(name+".weight", blkD), Bias: param(name+".bias", blkD), Eps: 1e-5}
	}
	qkv := lin("attn.qkv", 3*blkD, blkD)
	qkv.Chunks = 3
	b := &block{
		ln1:  ln("ln1"),
		attn: &Attention{QKV: qkv, Proj: lin("attn.proj", blkD, blkD), Heads: blkH},
		ln2:  ln("ln2"),
		mlp:  &MLP{FC: lin("mlp.fc", blkF, blkD), Proj: lin("mlp.proj", blkD, blkF)},
	}
	return b, tape, nil
}

func blockPlan(sp bool) Plan {
	if !sp {
		return Plan{
			{"attn.qkv", ColwiseParallel{}},
			{"attn.proj", RowwiseParallel{}},
			{"mlp.fc", ColwiseParallel{}},
			{"mlp.proj", RowwiseParallel{}},
		}
	}
	seq := placement.Shard(1)
	return Plan{
		{"ln1", SequenceParallel{}},
		{"attn.qkv", ColwiseParallel{}},
		{"attn.proj", RowwiseParallel{Output: seq}},
		{"ln2", SequenceParallel{}},
		{"mlp.fc", ColwiseParallel{}},
		{"mlp.proj", RowwiseParallel{Output: seq}},
	}
}

// loss = Σ y² for the block's output y on input x (Shard(0) on dp; with
// sp, Shard(1) on tp so that the residual stream is sequence-sharded).
func (b *block) loss(ctx context.Context, tape *autograd.Tape, m *mesh.Mesh, sp bool) (*autograd.Value, error) {
	places := batchPlaces(m)
	if sp {
		places[1] = placement.Shard(1)
	}
	spec, err := placement.NewSpec(m, []int{blkB, blkT, blkD}, comm.Float64, places)
	if err != nil {
		return nil, err
	}
	xd, err := placement.FromFull(spec, placementtest.Random([]int{blkB, blkT, blkD}, comm.Float64, 99))
	if err != nil {
		return nil, err
	}
	x, err := tape.Constant(xd)
	if err != nil {
		return nil, err
	}
	a, err := b.ln1.Forward(ctx, x)
	if err != nil {
		return nil, err
	}
	if a, err = b.attn.Forward(ctx, a); err != nil {
		return nil, err
	}
	h, err := autograd.Add(x, a)
	if err != nil {
		return nil, err
	}
	u, err := b.ln2.Forward(ctx, h)
	if err != nil {
		return nil, err
	}
	if u, err = b.mlp.Forward(ctx, u); err != nil {
		return nil, err
	}
	y, err := autograd.Add(h, u)
	if err != nil {
		return nil, err
	}
	sq, err := autograd.Mul(y, y)
	if err != nil {
		return nil, err
	}
	return autograd.Sum(sq)
}

// gradsOf runs the block on a dp × tp mesh with the plan applied and
// returns the global loss and every parameter's full gradient.
func gradsOf(t *testing.T, dp, tp int, sp, parallelize bool) (float64, map[string][]float64) {
	t.Helper()
	var (
		mu    sync.Mutex
		loss  float64
		grads = map[string][]float64{}
	)
	err := placementtest.Simulate(context.Background(), []int{dp, tp}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, tape, err := newBlock(m)
		if err != nil {
			return err
		}
		if parallelize {
			if err := Parallelize(ctx, b, "tp", blockPlan(sp)); err != nil {
				return err
			}
		}
		params, err := Params(b)
		if err != nil {
			return err
		}
		l, err := b.loss(ctx, tape, m, sp)
		if err != nil {
			return err
		}
		full, err := l.Data().Full(ctx)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return err
		}
		if err := ReduceGrads(ctx, params); err != nil {
			return err
		}
		for _, p := range params {
			// Every gradient must now be laid out like its parameter.
			if !p.Grad().Spec().Equal(p.Spec()) {
				return fmt.Errorf("gradient of %q is %v, parameter %v", p.Name(), p.Grad().Spec(), p.Spec())
			}
			g, err := p.Grad().Full(ctx)
			if err != nil {
				return err
			}
			if m.Rank() == 0 {
				mu.Lock()
				grads[p.Name()] = g.([]float64)
				mu.Unlock()
			}
		}
		if m.Rank() == 0 {
			loss = fullScalar(full)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("dp=%d tp=%d sp=%v: %v", dp, tp, sp, err)
	}
	return loss, grads
}

func fullScalar(d any) float64 {
	if v, ok := d.([]float64); ok && len(v) == 1 {
		return v[0]
	}
	return math.NaN()
}

// Tensor parallelism (and sequence parallelism) of a transformer block
// computes the serial loss and gradients, on odd and even tp with uneven
// sequence and hidden shards, with and without dp.
func TestTensorParallelBlockMatchesSerial(t *testing.T) {
	wantLoss, want := gradsOf(t, 1, 1, false, false)
	for _, c := range []struct {
		dp, tp int
		sp     bool
	}{{1, 2, false}, {1, 3, false}, {2, 2, false}, {1, 2, true}, {1, 3, true}, {2, 3, true}} {
		t.Run(fmt.Sprintf("dp=%d,tp=%d,sp=%v", c.dp, c.tp, c.sp), func(t *testing.T) {
			loss, got := gradsOf(t, c.dp, c.tp, c.sp, true)
			if math.Abs(loss-wantLoss) > 1e-9*math.Abs(wantLoss) {
				t.Errorf("loss %v, serial %v", loss, wantLoss)
			}
			for name, w := range want {
				g := got[name]
				if len(g) != len(w) {
					t.Errorf("%s: %d values, want %d", name, len(g), len(w))
					continue
				}
				for i := range w {
					if math.Abs(g[i]-w[i]) > 1e-9*(1+math.Abs(w[i])) {
						t.Errorf("%s[%d] = %v, serial %v", name, i, g[i], w[i])
						break
					}
				}
			}
		})
	}
}

// Colwise sharding of a fused q|k|v projection gives each rank matching
// slices of q, k and v (its heads), not a slice of the fused dim.
func TestColwiseFusedShardsEachChunk(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := newBlock(m)
		if err != nil {
			return err
		}
		if err := Parallelize(ctx, b, "tp", Plan{{"attn.qkv", ColwiseParallel{}}}); err != nil {
			return err
		}
		w := b.attn.QKV.Weight
		if got := fmt.Sprint(w.Spec().Shape(), w.Data().LocalShape()); got != fmt.Sprint([]int{3, blkD, blkD}, []int{3, blkD / 2, blkD}) {
			return fmt.Errorf("fused weight global/local shapes %s", got)
		}
		return nil
	})
}

func TestParallelizeErrors(t *testing.T) {
	cases := []struct {
		name string
		plan Plan
		want string
	}{
		{"no match", Plan{{"attn.qvk", ColwiseParallel{}}}, "matches no module"},
		{"wrong module", Plan{{"ln1", ColwiseParallel{}}}, "applies to *Linear"},
		{"twice", Plan{{"mlp.fc", ColwiseParallel{}}, {"mlp.fc", RowwiseParallel{}}}, "already"},
		{"rowwise fused", Plan{{"attn.qkv", RowwiseParallel{}}}, "fused"},
		{"no axis", nil, "no axis"},
		{"nil style", Plan{{"ln1", nil}}, "no style"},
		{"empty layout", Plan{{"ln1", PrepareInput{}}}, "without a layout"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
				b, _, err := newBlock(m)
				if err != nil {
					return err
				}
				axis, plan := "tp", c.plan
				if plan == nil {
					axis, plan = "model", Plan{{"mlp.fc", ColwiseParallel{}}}
				}
				err = Parallelize(ctx, b, axis, plan)
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), c.want) {
					return fmt.Errorf("got %v, want ErrInvalid mentioning %q", err, c.want)
				}
				return nil
			})
		})
	}
}

// Parallelizing after training started is refused: the gradient would stay
// in the parameter's old layout.
func TestParallelizeAfterBackward(t *testing.T) {
	placementtest.Run(t, []int{1, 2}, []string{"dp", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, tape, err := newBlock(m)
		if err != nil {
			return err
		}
		l, err := b.loss(ctx, tape, m, false)
		if err != nil {
			return err
		}
		if err := tape.Backward(ctx, l); err != nil {
			return err
		}
		err = Parallelize(ctx, b, "tp", blockPlan(false))
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "already has a gradient") {
			return fmt.Errorf("got %v", err)
		}
		return nil
	})
}

// The plan is checked before any module changes: a later rule that matches
// nothing, an axis the mesh lacks (even for styles that only install
// hooks) and a nil child are errors that leave the model as it was.
func TestParallelizeChecksFirst(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := newBlock(m)
		if err != nil {
			return err
		}
		err = Parallelize(ctx, b, "tp", Plan{{"ln1", SequenceParallel{}}, {"mlp.fc", ColwiseParallel{}}, {"mlp.prj", RowwiseParallel{}}})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "matches no module") {
			return fmt.Errorf("misspelt rule: got %v", err)
		}
		if !b.mlp.FC.Weight.Spec().Placements()[0].IsReplicate() || len(b.ln1.in) != 0 {
			return fmt.Errorf("a failed plan changed the model: fc %v, %d ln1 hooks", b.mlp.FC.Weight.Spec(), len(b.ln1.in))
		}
		if err := Parallelize(ctx, b, "model", Plan{{"ln1", SequenceParallel{}}}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "no axis") || strings.Contains(err.Error(), "parallel: parallel:") {
			return fmt.Errorf("unknown axis: got %v", err)
		}
		b.attn.Proj = nil
		if err := Parallelize(ctx, b, "tp", Plan{{"attn", SequenceParallel{}}}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "nil") {
			return fmt.Errorf("nil child: got %v", err)
		}
		emb := &Embedding{Table: b.ln1.Weight}
		if err := Parallelize(ctx, &twin{a: emb, b: b.ln2}, "tp", Plan{{"a", SequenceParallel{}}}); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "Embedding") {
			return fmt.Errorf("SequenceParallel on an Embedding (no input hooks): got %v", err)
		}
		if _, err := (&Linear{}).Forward(ctx, nil); !errors.Is(err, ErrInvalid) {
			return fmt.Errorf("Linear without a weight: got %v", err)
		}
		return nil
	})
}

// twin holds two children that may be the same module.
type twin struct {
	Hooks
	a, b Module
}

func (w *twin) Children() []Child { return []Child{{"a", w.a}, {"b", w.b}} }

// A module reachable at two paths gets a style once; a parameter shared by
// two modules (tied weights) stays one leaf, the same Value, laid out once
// when both lay it out alike, and
// is an error when they do not or when one of them keeps it replicated.
func TestParallelizeSharedModulesAndTiedParams(t *testing.T) {
	placementtest.Run(t, []int{2}, []string{"tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		b, _, err := newBlock(m)
		if err != nil {
			return err
		}
		if err := Parallelize(ctx, &twin{a: b.ln1, b: b.ln1}, "tp", Plan{{"*", SequenceParallel{}}}); err != nil {
			return err
		}
		if len(b.ln1.in) != 1 {
			return fmt.Errorf("a module at two paths got %d input hooks, want 1", len(b.ln1.in))
		}

		w := b.attn.Proj.Weight
		tied := &Linear{Weight: w}
		if err := Parallelize(ctx, &twin{a: b.attn.Proj, b: tied}, "tp", Plan{{"*", RowwiseParallel{}}}); err != nil {
			return err
		}
		if b.attn.Proj.Weight != w || tied.Weight != w || !w.Spec().Placements()[0].IsShard() {
			return fmt.Errorf("tied weight: %p and %p after Parallelize (was %p), laid out %v", b.attn.Proj.Weight, tied.Weight, w, w.Spec())
		}

		w = b.mlp.FC.Weight
		err = Parallelize(ctx, &twin{a: b.mlp.FC, b: &Linear{Weight: w}}, "tp", Plan{{"a", ColwiseParallel{}}, {"b", RowwiseParallel{}}})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "tied") {
			return fmt.Errorf("tied weight laid out two ways: got %v", err)
		}
		w = b.mlp.Proj.Weight
		err = Parallelize(ctx, &twin{a: b.mlp.Proj, b: &Linear{Weight: w}}, "tp", Plan{{"a", RowwiseParallel{}}})
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "shared") {
			return fmt.Errorf("tied weight left replicated in one module: got %v", err)
		}
		return nil
	})
}
