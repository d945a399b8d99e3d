package moe_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/parallel"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// seqMoE is Sequential(Linear "0", MoE layer "1") with the layer's
// parameters named by its path.
func seqMoE(tape *autograd.Tape, m *mesh.Mesh) (*parallel.Sequential, *moe.SeqLayer, error) {
	l0, err := parallel.NewLinear(tape, m, 3, 4, parallel.WithName("0"))
	if err != nil {
		return nil, nil, err
	}
	gate, err := parallel.NewLinear(tape, m, 4, 2, parallel.WithName("1.router"), parallel.WithBias(false))
	if err != nil {
		return nil, nil, err
	}
	router, err := moe.NewRouter(gate.Weight, moe.RouterConfig{K: 1, AuxCoef: 0.5, ZCoef: 0.25})
	if err != nil {
		return nil, nil, err
	}
	ones := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = 0.1 * float32(i%7)
		}
		return v
	}
	ex, err := moe.ShardExperts(tape, m, "ep", 2, 5, 4, ones(40), ones(10), ones(40), ones(8), moe.WithPrefix("1"))
	if err != nil {
		return nil, nil, err
	}
	mo := &moe.SeqLayer{Layer: &moe.Layer{Router: router, Experts: ex}}
	seq, err := parallel.NewSequential(l0, mo)
	return seq, mo, err
}

// TestLayerIsModule: a Layer is a leaf of the module tree whose
// parameters parallel.Params collects under names given by WithPrefix,
// whose hooks run (an output hook sees y), and whose SeqLayer adds the
// routing losses of training forwards only.
func TestLayerIsModule(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		seq, mo, err := seqMoE(tape, m)
		if err != nil {
			return err
		}
		ps, err := parallel.Params(seq)
		if err != nil {
			return err
		}
		var names []string
		for _, p := range ps {
			names = append(names, p.Name())
		}
		if want := []string{"0.weight", "0.bias", "1.router.weight", "1.W1", "1.b1", "1.W2", "1.b2"}; !slices.Equal(names, want) {
			return fmt.Errorf("Params: %v, want %v", names, want)
		}
		var paths []string
		if err := parallel.Walk(seq, func(p string, _ parallel.Module) error { paths = append(paths, p); return nil }); err != nil {
			return err
		}
		if !slices.Equal(paths, []string{"", "0", "1"}) {
			return fmt.Errorf("Walk paths %v", paths)
		}
		hooked := 0
		mo.OnOutput(func(_ context.Context, v *autograd.Value) (*autograd.Value, error) { hooked++; return v, nil })
		spec, err := placement.NewSpec(m, []int{6, 3}, comm.Float32, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		dt, err := placement.FromFull(spec, make([]float32, 18))
		if err != nil {
			return err
		}
		x, err := tape.Constant(dt)
		if err != nil {
			return err
		}
		task, err := autograd.Sum(x)
		if err != nil {
			return err
		}
		for range 2 {
			if _, err := seq.Forward(ctx, x); err != nil {
				return err
			}
		}
		if hooked != 2 {
			return fmt.Errorf("output hook ran %d times in 2 forwards", hooked)
		}
		loss, err := mo.AddLosses(task)
		if err != nil {
			return err
		}
		if loss == task { // two forwards' Aux and Z were to be added
			return fmt.Errorf("AddLosses added nothing")
		}
		if again, err := mo.AddLosses(task); err != nil || again != task {
			return fmt.Errorf("a second AddLosses added %v (err %v); want the task alone", again, err)
		}
		if err := parallel.Eval(seq); err != nil {
			return err
		}
		if _, err := seq.Forward(ctx, x); err != nil {
			return err
		}
		if l, err := mo.AddLosses(task); err != nil || l != task {
			return fmt.Errorf("after an eval forward AddLosses gave %v (err %v); want the task alone", l, err)
		}
		cur := mo.OwnParams()
		if err := mo.SetOwnParams(cur[:4]); !errors.Is(err, moe.ErrInvalid) {
			return fmt.Errorf("SetOwnParams of 4: %v", err)
		}
		if err := mo.SetOwnParams(append(cur[:4:4], nil)); !errors.Is(err, moe.ErrInvalid) {
			return fmt.Errorf("SetOwnParams with nil: %v", err)
		}
		rev := slices.Clone(cur)
		if err := mo.SetOwnParams(rev); err != nil || !slices.Equal(mo.OwnParams(), cur) {
			return fmt.Errorf("SetOwnParams of the same: %v", err)
		}
		if _, err := moe.ShardExperts(tape, m, "ep", 2, 5, 4, make([]float32, 40), make([]float32, 10), make([]float32, 40), make([]float32, 8), moe.WithPrefix("")); !errors.Is(err, moe.ErrInvalid) {
			return fmt.Errorf("WithPrefix(\"\"): %v", err)
		}
		return nil
	})
}
