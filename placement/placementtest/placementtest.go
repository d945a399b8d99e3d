// Package placementtest runs placement code on a simulated mesh inside an
// ordinary go test and compares distributed tensors with serial references.
// It is how a user unit-tests placement transitions on a laptop: every rank
// is a goroutine, collectives move data through shared memory (comm/local).
package placementtest

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"gorgonia.org/tensor"
)

// Simulate runs fn on every rank of an in-process mesh with the given axis
// sizes and names (one goroutine per rank) and returns the ranks' errors
// joined, each prefixed with its rank. When one rank fails, the others'
// pending collectives fail at once instead of hanging.
func Simulate(ctx context.Context, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error) error {
	p := 1
	for _, s := range shape {
		if s <= 0 {
			return fmt.Errorf("placementtest: mesh shape %v: sizes must be positive", shape)
		}
		p *= s
	}
	return local.Run(ctx, p, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, shape, names)
		if err != nil {
			return err
		}
		return fn(ctx, m)
	})
}

// Run is Simulate inside a test: an error from any rank fails t.
func Run(t testing.TB, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error) {
	t.Helper()
	if err := Simulate(context.Background(), shape, names, fn); err != nil {
		t.Errorf("mesh %v %v: %v", names, shape, err)
	}
}

// CheckFull materialises dt's global tensor (a collective: every rank of
// the mesh must call it) and compares it element-wise with want. Elements
// match when |got-want| <= tol*max(1, |want|). The error names the first
// differing index.
func CheckFull(ctx context.Context, dt *placement.DTensor, want *tensor.Dense, tol float64) error {
	got, err := dt.Full(ctx)
	if err != nil {
		return err
	}
	return Compare(got, want, tol)
}

// AssertFull is CheckFull reporting through t.Errorf (safe from rank
// goroutines); it returns whether the tensors matched.
func AssertFull(t testing.TB, ctx context.Context, dt *placement.DTensor, want *tensor.Dense, tol float64) bool {
	t.Helper()
	if err := CheckFull(ctx, dt, want, tol); err != nil {
		t.Errorf("%v: %v", dt.Spec(), err)
		return false
	}
	return true
}

// Compare compares two dense tensors element-wise within tol (see
// CheckFull).
func Compare(got, want *tensor.Dense, tol float64) error {
	if got == nil || want == nil {
		return fmt.Errorf("placementtest: nil tensor")
	}
	if !slices.Equal([]int(got.Shape()), []int(want.Shape())) {
		return fmt.Errorf("placementtest: shape %v, want %v", got.Shape(), want.Shape())
	}
	g, w := values(got), values(want)
	if len(g) != len(w) {
		return fmt.Errorf("placementtest: %d elements, want %d", len(g), len(w))
	}
	for i := range g {
		if math.Abs(g[i]-w[i]) > tol*math.Max(1, math.Abs(w[i])) || math.IsNaN(g[i]) != math.IsNaN(w[i]) {
			return fmt.Errorf("placementtest: element %d (index %v of %v) is %g, want %g", i, unravel(i, want.Shape()), []int(want.Shape()), g[i], w[i])
		}
	}
	return nil
}

// values returns a tensor's elements as float64.
func values(t *tensor.Dense) []float64 {
	switch d := t.Data().(type) {
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out
	case []float64:
		return slices.Clone(d)
	case float32:
		return []float64{float64(d)}
	case float64:
		return []float64{d}
	}
	return nil
}

func unravel(p int, shape []int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		c[i] = p % shape[i]
		p /= shape[i]
	}
	return c
}

// Random returns a tensor of the given shape and dtype (Float32 or
// Float64) filled with deterministic values in [-1, 1) from seed; every
// rank calling it with the same arguments gets the same tensor.
func Random(shape []int, dtype comm.DType, seed uint64) *tensor.Dense {
	n := 1
	for _, s := range shape {
		n *= s
	}
	if dtype == comm.Float32 {
		d := make([]float32, n)
		for i := range d {
			d[i] = float32(uniform(seed, uint64(i)))
		}
		return dense(shape, d)
	}
	d := make([]float64, n)
	for i := range d {
		d[i] = uniform(seed, uint64(i))
	}
	return dense(shape, d)
}

func dense[T float32 | float64](shape []int, d []T) *tensor.Dense {
	if len(shape) == 0 {
		return tensor.New(tensor.FromScalar(d[0]))
	}
	return tensor.New(tensor.WithShape(shape...), tensor.WithBacking(d))
}

// mix is splitmix64 over a sequence of words.
func mix(words ...uint64) uint64 {
	var h uint64 = 0x9e3779b97f4a7c15
	for _, w := range words {
		h ^= w + 0x9e3779b97f4a7c15 + (h << 6) + (h >> 2)
		z := h
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		h = z ^ (z >> 31)
	}
	return h
}

// uniform returns a deterministic value in [-1, 1).
func uniform(words ...uint64) float64 {
	return float64(mix(words...)>>11)/float64(1<<53)*2 - 1
}

// Distribute is FromFull with genuinely partial values: on every
// Partial axis of size k the ranks hold k different tensors whose reduction
// is the value (for sum, pieces plus noise that cancels; for avg, the value
// plus noise that cancels; for max and min, the value on one random rank
// per element and strictly smaller or larger values elsewhere). Every rank
// must pass the same full tensor and seed; no communication happens. It is
// the input of choice for testing transitions out of Partial.
func Distribute(spec *placement.Spec, full *tensor.Dense, seed uint64) (*placement.DTensor, error) {
	places := spec.Placements()
	rep := slices.Clone(places)
	for i, p := range rep {
		if p.IsPartial() {
			rep[i] = placement.Replicate()
		}
	}
	opts := make([]placement.SpecOption, 0)
	for d := range spec.Shape() {
		if o := spec.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	rspec, err := spec.With(rep, opts...)
	if err != nil {
		return nil, err
	}
	r, err := placement.FromFull(rspec, full)
	if err != nil {
		return nil, err
	}
	m := spec.Mesh()
	off, _, err := spec.Box(m.Rank())
	if err != nil {
		return nil, err
	}
	shape := r.LocalShape()
	gshape := spec.Shape()
	coord := m.Coord()
	msh := m.Shape()
	// Global flat index of every local element.
	gidx := func(i int) uint64 {
		c := unravel(i, shape)
		g := 0
		for d := range c {
			g = g*gshape[d] + off[d] + c[d]
		}
		return uint64(g)
	}
	split := func(v float64, i int) float64 {
		g := gidx(i)
		var prefix []uint64
		for a, p := range places {
			k := msh[a]
			if !p.IsPartial() || k == 1 {
				continue
			}
			words := append([]uint64{seed, uint64(a), g}, prefix...)
			me := coord[a]
			switch p.Op() {
			case comm.Sum, comm.Avg:
				noise := 0.0
				total := 0.0
				for c := 0; c < k-1; c++ {
					n := uniform(append(words, uint64(c))...)
					total += n
					if c == me {
						noise = n
					}
				}
				if me == k-1 {
					noise = -total
				}
				if p.Op() == comm.Sum {
					v = v/float64(k) + noise
				} else {
					v += noise
				}
			case comm.Max, comm.Min:
				win := int(mix(append(words, 1<<40)...) % uint64(k))
				if me != win {
					d := 0.25 + math.Abs(uniform(append(words, uint64(me))...))
					if p.Op() == comm.Max {
						v -= d
					} else {
						v += d
					}
				}
			}
			prefix = append(prefix, uint64(me))
		}
		return v
	}
	switch d := r.LocalData().(type) {
	case []float32:
		for i := range d {
			d[i] = float32(split(float64(d[i]), i))
		}
	case []float64:
		for i := range d {
			d[i] = split(d[i], i)
		}
	}
	var local *tensor.Dense
	if t := r.Local(); t != nil {
		local = t
	}
	if len(gshape) == 0 {
		switch d := r.LocalData().(type) {
		case []float32:
			local = tensor.New(tensor.FromScalar(d[0]))
		case []float64:
			local = tensor.New(tensor.FromScalar(d[0]))
		}
	}
	return placement.FromLocal(context.Background(), spec, local, false)
}
