package autograd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// embIDs is the global [2, 3] id tensor of the embedding tests, reduced
// modulo the vocabulary size v.
func embIDs(v int) []int64 {
	out := []int64{0, 3, 1, 3, 4, 0}
	for i := range out {
		out[i] %= int64(v)
	}
	return out
}

// TestGradEmbeddingParallelTable checks vocab-parallel (Shard(0)) and
// embedding-dim-parallel (Shard(1)) tables by finite differences, on 2-
// and 3-rank meshes with uneven and empty shards and on 2x2 meshes mixed
// with ids sharded over the other axis.
func TestGradEmbeddingParallelTable(t *testing.T) {
	S2 := placement.Shard(2)
	lookup := func(ids pl, v int, reshard pl) func(context.Context, []*Value) (*Value, error) {
		return func(ctx context.Context, ps []*Value) (*Value, error) {
			ix, err := IndicesFromFull(ps[0].Spec().Mesh(), []int{2, 3}, ids, embIDs(v))
			if err != nil {
				return nil, err
			}
			e, err := Embedding(ps[0], ix)
			if err != nil || reshard == nil {
				return e, err
			}
			// The caller's explicit reduction of the Partial(sum) result,
			// here a reduce-scatter to a sequence-sharded layout.
			s, err := e.Spec().With(reshard)
			if err != nil {
				return nil, err
			}
			return Redistribute(ctx, e, s)
		}
	}
	var cases []fdCase
	for _, c := range []struct {
		mesh    []int
		table   []int
		p, ids  pl
		reshard pl
	}{
		{mesh: []int{2}, table: []int{6, 3}, p: pl{S0}, ids: pl{R}},
		{mesh: []int{2}, table: []int{7, 3}, p: pl{S0}, ids: pl{R}}, // 4 + 3 rows
		{mesh: []int{2}, table: []int{6, 3}, p: pl{S0}, ids: pl{R}, reshard: pl{S1}},
		{mesh: []int{2}, table: []int{6, 3}, p: pl{S1}, ids: pl{R}}, // 2 + 1 columns
		{mesh: []int{3}, table: []int{5, 3}, p: pl{S0}, ids: pl{R}}, // 2 + 2 + 1 rows
		{mesh: []int{3}, table: []int{4, 3}, p: pl{S0}, ids: pl{R}}, // 2 + 2 + 0: an empty vocab range
		{mesh: []int{3}, table: []int{5, 2}, p: pl{S1}, ids: pl{R}}, // 1 + 1 + 0 columns
		{mesh: []int{3}, table: []int{5, 3}, p: pl{S0}, ids: pl{R}, reshard: pl{S1}},
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{R, S0}, ids: pl{S0, R}}, // dp + vocab-parallel tp
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{R, S0}, ids: pl{S1, R}, reshard: pl{S1, S1}},
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{S0, S0}, ids: pl{R, R}},
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{S0, S1}, ids: pl{R, R}},
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{S1, S0}, ids: pl{R, R}, reshard: pl{S2, R}},
		{mesh: []int{2, 2}, table: []int{5, 3}, p: pl{R, S1}, ids: pl{S0, R}},
	} {
		cases = append(cases, fdCase{mesh: c.mesh, shapes: [][]int{c.table}, places: []pl{c.p}, op: lookup(c.ids, c.table[0], c.reshard)})
	}
	runFD(t, cases)
}

// TestEmbeddingVocabParallelValues compares a vocab-parallel lookup and
// its table gradient with a replicated table's, and checks the layouts:
// the result is Partial(sum), the gradient Shard(0) with exact zeros in
// the rows no id selects, including on the rank with an empty range.
func TestEmbeddingVocabParallelValues(t *testing.T) {
	const v, d = 4, 3 // over 3 ranks: rows 0-1, 2-3 and none
	simulate(t, []int{3}, func(ctx context.Context, m *mesh.Mesh) error {
		ix, err := IndicesFromFull(m, []int{2, 3}, pl{R}, []int64{0, 3, 1, 3, 1, 0})
		if err != nil {
			return err
		}
		var outs, grads [][]float64
		for _, p := range []pl{{R}, {S0}} {
			tab, err := random(m, []int{v, d}, p, 5)
			if err != nil {
				return err
			}
			tp := NewTape()
			w, _ := tp.Param("wte", tab)
			e, err := Embedding(w, ix)
			if err != nil {
				return err
			}
			want := "[R]"
			if p[0].IsShard() {
				want = "[P(sum)]"
			}
			if got := fmt.Sprint(e.Spec().Placements()); got != want {
				t.Errorf("table %v: result %s, want %s", p, got, want)
			}
			out, err := fullData(ctx, e.Data())
			if err != nil {
				return err
			}
			loss, err := probe(ctx, e)
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, loss); err != nil {
				return err
			}
			if got := fmt.Sprint(w.Grad().Spec().Placements()); got != fmt.Sprint(p) {
				t.Errorf("table %v: gradient %s", p, got)
			}
			g, err := fullData(ctx, w.Grad())
			if err != nil {
				return err
			}
			outs, grads = append(outs, out), append(grads, g)
		}
		for i := range outs[0] {
			if outs[1][i] != outs[0][i] {
				t.Errorf("lookup element %d: vocab parallel %v, replicated %v", i, outs[1][i], outs[0][i])
			}
		}
		for i := range grads[0] {
			if grads[1][i] != grads[0][i] {
				t.Errorf("gradient element %d: vocab parallel %v, replicated %v", i, grads[1][i], grads[0][i])
			}
		}
		for k := range d { // row 2 is never selected
			if g := grads[1][2*d+k]; g != 0 {
				t.Errorf("unused row 2: gradient %v, want exactly 0", g)
			}
		}
		return nil
	})
}

// TestEmbeddingShardOrder: a table dim 1 sharded over (tp, dp) gives a
// result whose last dim is sharded in that order, and its gradient
// checks out.
func TestEmbeddingShardOrder(t *testing.T) {
	simulate(t, []int{2, 2}, func(ctx context.Context, m *mesh.Mesh) error {
		tab, err := random(m, []int{5, 6}, pl{S1, S1}, 3, placement.WithOrder(1, "tp", "dp"))
		if err != nil {
			return err
		}
		ix, err := IndicesFromFull(m, []int{2, 3}, pl{R, R}, embIDs(5))
		if err != nil {
			return err
		}
		spec, err := EmbeddingRule(tab.Spec(), ix)
		if err != nil {
			return err
		}
		if got := fmt.Sprint(spec.Placements(), spec.Order(2)); got != "[S(2) S(2)] [tp dp]" {
			t.Errorf("result %s, want [S(2) S(2)] [tp dp]", got)
		}
		return CheckGrad(ctx, func(tp *Tape, ps []*Value) (*Value, error) {
			e, err := Embedding(ps[0], ix)
			if err != nil {
				return nil, err
			}
			return probe(ctx, e)
		}, tab)
	})
}

// TestEmbeddingVocabParallelGradMustBeReplicate: a gradient arriving
// Partial(sum) on the vocab-parallel axis would need an all-reduce, which
// autograd never inserts.
func TestEmbeddingVocabParallelGradMustBeReplicate(t *testing.T) {
	simulate(t, []int{2}, func(ctx context.Context, m *mesh.Mesh) error {
		tab, err := random(m, []int{6, 3}, pl{S0}, 3)
		if err != nil {
			return err
		}
		ix, err := IndicesFromFull(m, []int{2, 3}, pl{R}, embIDs(6))
		if err != nil {
			return err
		}
		tp := NewTape()
		w, _ := tp.Param("wte", tab)
		e, err := Embedding(w, ix)
		if err != nil {
			return err
		}
		// An identity whose input gradient is a Partial(sum) contribution.
		id := LocalFunc[float64]{
			Name: "partial-grad", In: [][]placement.Placement{{Psum}}, GradIn: [][]placement.Placement{{Psum}},
			Out: pl{Psum}, GradOut: pl{R},
			Forward: func(in []Block[float64]) (Block[float64], error) {
				return Block[float64]{Shape: in[0].Shape, Data: slices.Clone(in[0].Data)}, nil
			},
			Backward: func(g Block[float64], _ []Block[float64], _ Block[float64]) ([]Block[float64], error) {
				return []Block[float64]{g}, nil
			},
		}
		y, err := id.Apply(e)
		if err != nil {
			return err
		}
		loss, err := Sum(y)
		if err != nil {
			return err
		}
		err = tp.Backward(ctx, loss)
		if !errors.Is(err, ErrGradPlacement) || !strings.Contains(err.Error(), `arrives as P(sum) on mesh axis "x", where the table is vocab parallel (S(0)); it must be R there`) {
			t.Errorf("Backward with a Partial gradient on the vocab axis: %v", err)
		}
		return nil
	})
}

// TestEmbeddingVocabParallelFloat32 runs the float32 kernel with an empty
// vocab range and compares it with float64.
func TestEmbeddingVocabParallelFloat32(t *testing.T) {
	simulate(t, []int{3}, func(ctx context.Context, m *mesh.Mesh) error {
		ix, err := IndicesFromFull(m, []int{2, 3}, pl{R}, embIDs(4))
		if err != nil {
			return err
		}
		var res [][]float64
		for _, dt := range []comm.DType{comm.Float64, comm.Float32} {
			s, err := placement.NewSpec(m, []int{4, 3}, dt, pl{S0})
			if err != nil {
				return err
			}
			tab, err := placement.FromFull(s, placementtest.Random([]int{4, 3}, dt, 8))
			if err != nil {
				return err
			}
			tp := NewTape()
			w, _ := tp.Param("wte", tab)
			e, err := Embedding(w, ix)
			if err != nil {
				return err
			}
			out, err := fullData(ctx, e.Data())
			if err != nil {
				return err
			}
			res = append(res, out)
		}
		for i := range res[0] {
			if d := res[1][i] - res[0][i]; d > 1e-6 || d < -1e-6 {
				t.Errorf("element %d: float32 %v, float64 %v", i, res[1][i], res[0][i])
			}
		}
		return nil
	})
}
