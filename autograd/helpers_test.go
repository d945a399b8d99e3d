package autograd

import (
	"context"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

var (
	R    = placement.Replicate()
	S0   = placement.Shard(0)
	S1   = placement.Shard(1)
	Psum = placement.Partial(comm.Sum)
	Pavg = placement.Partial(comm.Avg)
	Pmax = placement.Partial(comm.Max)
	Pmin = placement.Partial(comm.Min)
)

type pl = []placement.Placement

// names returns the axis names used for a mesh shape.
func names(shape []int) []string {
	if len(shape) == 1 {
		return []string{"x"}
	}
	return []string{"dp", "tp"}
}

// simulate runs fn on every rank of a simulated mesh and fails t on error.
func simulate(t *testing.T, shape []int, fn func(ctx context.Context, m *mesh.Mesh) error) {
	t.Helper()
	placementtest.Run(t, shape, names(shape), fn)
}

// rank0Mesh is rank 0's view of a mesh of an unused world: enough for
// sharding rules, which never communicate.
func rank0Mesh(t *testing.T, shape []int) *mesh.Mesh {
	t.Helper()
	p := 1
	for _, s := range shape {
		p *= s
	}
	w, err := local.NewWorld(p)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mesh.New(w.Comm(0), shape, names(shape))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// random returns a float64 tensor laid out by places, with genuinely
// partial pieces on Partial axes, from seed.
func random(m *mesh.Mesh, shape []int, places pl, seed uint64, opts ...placement.SpecOption) (*placement.DTensor, error) {
	spec, err := placement.NewSpec(m, shape, comm.Float64, places, opts...)
	if err != nil {
		return nil, err
	}
	return placementtest.Distribute(spec, placementtest.Random(shape, comm.Float64, seed), seed+1)
}

// allR returns s with every axis Replicate.
func allR(s *placement.Spec) (*placement.Spec, error) {
	places := s.Placements()
	for i := range places {
		places[i] = R
	}
	return s.With(places)
}

// probe turns any value into a scalar loss with a non-uniform gradient:
// Sum(Redistribute(v, R...) ⊙ C) for a fixed random replicated C.
func probe(ctx context.Context, v *Value) (*Value, error) {
	rs, err := allR(v.Spec())
	if err != nil {
		return nil, err
	}
	r, err := Redistribute(ctx, v, rs)
	if err != nil {
		return nil, err
	}
	c, err := placement.FromFull(rs, placementtest.Random(rs.Shape(), rs.DType(), 1234))
	if err != nil {
		return nil, err
	}
	cv, err := v.tape.Constant(c)
	if err != nil {
		return nil, err
	}
	p, err := Mul(r, cv)
	if err != nil {
		return nil, err
	}
	return Sum(p)
}
