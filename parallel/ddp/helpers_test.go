package ddp

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/parallel/internal/ptest"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// A small float64 MLP: logits = W2·GELU(W1·x + b1) + b2, loss = mean
// cross entropy. Optionally one extra parameter the loss never uses.
const (
	mlpIn  = 5
	mlpHid = 7
	mlpOut = 4
)

type mlp struct {
	tape   *autograd.Tape
	params []*autograd.Value
}

func newMLP(m *mesh.Mesh, unused bool, opts ...autograd.Option) (*mlp, error) {
	n := &mlp{tape: autograd.NewTape(opts...)}
	shapes := []struct {
		name  string
		shape []int
	}{{"w1", []int{mlpHid, mlpIn}}, {"b1", []int{mlpHid}}, {"w2", []int{mlpOut, mlpHid}}, {"b2", []int{mlpOut}}}
	if unused {
		shapes = append(shapes, struct {
			name  string
			shape []int
		}{"unused", []int{3}})
	}
	for k, s := range shapes {
		dt, err := ptest.Replicated(m, s.shape, uint64(100+k))
		if err != nil {
			return nil, err
		}
		p, err := n.tape.Param(s.name, dt)
		if err != nil {
			return nil, err
		}
		n.params = append(n.params, p)
	}
	return n, nil
}

// data returns rows lo..hi of the global data set (inputs and targets),
// laid out with rows sharded on dp.
func data(m *mesh.Mesh, lo, hi int) (*placement.DTensor, *autograd.Indices, error) {
	const total = 64
	all := placementtest.Random([]int{total, mlpIn}, comm.Float64, 7).([]float64)
	rng := rand.New(rand.NewPCG(3, 4))
	targets := make([]int64, total)
	for i := range targets {
		targets[i] = int64(rng.IntN(mlpOut))
	}
	rows := hi - lo
	spec, err := placement.NewSpec(m, []int{rows, mlpIn}, comm.Float64, ptest.BatchPlaces(m))
	if err != nil {
		return nil, nil, err
	}
	x, err := placement.FromFull(spec, all[lo*mlpIn:hi*mlpIn])
	if err != nil {
		return nil, nil, err
	}
	y, err := autograd.IndicesFromFull(m, []int{rows}, ptest.BatchPlaces(m), targets[lo:hi])
	return x, y, err
}

// loss records the MLP's loss on rows lo..hi.
func (n *mlp) loss(m *mesh.Mesh, lo, hi int) (*autograd.Value, error) {
	xd, y, err := data(m, lo, hi)
	if err != nil {
		return nil, err
	}
	x, err := n.tape.Constant(xd)
	if err != nil {
		return nil, err
	}
	h, err := autograd.Linear(x, n.params[0], n.params[1])
	if err != nil {
		return nil, err
	}
	if h, err = autograd.GELU(h); err != nil {
		return nil, err
	}
	logits, err := autograd.Linear(h, n.params[2], n.params[3])
	if err != nil {
		return nil, err
	}
	return autograd.CrossEntropy(logits, y)
}

// step runs forward and backward on rows lo..hi.
func (n *mlp) step(ctx context.Context, m *mesh.Mesh, lo, hi int) error {
	l, err := n.loss(m, lo, hi)
	if err != nil {
		return err
	}
	return n.tape.Backward(ctx, l)
}

// serialMLPGrads returns the gradients of the MLP's loss on rows lo..hi
// computed on one rank, by parameter name.
func serialMLPGrads(lo, hi int) (map[string][]float64, error) {
	out := map[string][]float64{}
	err := placementtest.Simulate(context.Background(), []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		n, err := newMLP(m, false)
		if err != nil {
			return err
		}
		if err := n.step(ctx, m, lo, hi); err != nil {
			return err
		}
		for _, p := range n.params {
			out[p.Name()] = p.Grad().LocalData().([]float64)
		}
		return nil
	})
	return out, err
}

// checkReduced checks that every parameter's gradient is Replicate on
// every axis (the MLP's parameters are replicated) and equals want; a
// parameter that want lacks must have no gradient (no rank used it).
func checkReduced[T float32 | float64](params []*autograd.Value, want map[string][]T, tol float64) error {
	for _, p := range params {
		g := p.Grad()
		if _, used := want[p.Name()]; !used {
			if g != nil {
				return fmt.Errorf("%s: no rank used it, yet it has a gradient %v", p.Name(), g.Spec())
			}
			continue
		}
		if g == nil {
			return fmt.Errorf("%s: no gradient", p.Name())
		}
		for a, pl := range g.Spec().Placements() {
			if !pl.IsReplicate() {
				return fmt.Errorf("%s: gradient is %v on axis %d, want Replicate", p.Name(), pl, a)
			}
		}
		got, ok := g.LocalData().([]T)
		w := want[p.Name()]
		if !ok || len(got) != len(w) {
			return fmt.Errorf("%s: gradient has %d elements, want %d", p.Name(), len(got), len(w))
		}
		for k := range w {
			if d := math.Abs(float64(got[k] - w[k])); d > tol*math.Max(1, math.Abs(float64(w[k]))) {
				return fmt.Errorf("%s[%d] = %g, want %g", p.Name(), k, got[k], w[k])
			}
		}
	}
	return nil
}
