package checkpoint

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// tdef is a test tensor: its global shape, dtype and seed.
type tdef struct {
	shape []int
	dtype comm.DType
	seed  uint64
}

func (d tdef) full() any { return placementtest.Random(d.shape, d.dtype, d.seed) }

// layoutFn gives a tensor's placements (and spec options) on a mesh.
type layoutFn func(m *mesh.Mesh, name string, d tdef) ([]placement.Placement, []placement.SpecOption)

// specsOn builds every tensor's spec on m by lay.
func specsOn(m *mesh.Mesh, defs map[string]tdef, lay layoutFn) (map[string]*placement.Spec, error) {
	out := map[string]*placement.Spec{}
	for n, d := range defs {
		p, o := lay(m, n, d)
		s, err := placement.NewSpec(m, d.shape, d.dtype, p, o...)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", n, err)
		}
		out[n] = s
	}
	return out, nil
}

// stateOn distributes every tensor's full value by its spec.
func stateOn(specs map[string]*placement.Spec, defs map[string]tdef) (State, error) {
	st := State{Tensors: map[string]*placement.DTensor{}}
	for n, s := range specs {
		t, err := placement.FromFull(s, defs[n].full())
		if err != nil {
			return st, fmt.Errorf("%s: %w", n, err)
		}
		st.Tensors[n] = t
	}
	return st, nil
}

// bitsEqual compares two []float32 or []float64 bit for bit.
func bitsEqual(got, want any) error {
	switch w := want.(type) {
	case []float32:
		g, ok := got.([]float32)
		if !ok || len(g) != len(w) {
			return fmt.Errorf("got %T of %d, want []float32 of %d", got, lenOf(got), len(w))
		}
		for i := range w {
			if math.Float32bits(g[i]) != math.Float32bits(w[i]) {
				return fmt.Errorf("element %d is %v, want %v", i, g[i], w[i])
			}
		}
	case []float64:
		g, ok := got.([]float64)
		if !ok || len(g) != len(w) {
			return fmt.Errorf("got %T of %d, want []float64 of %d", got, lenOf(got), len(w))
		}
		for i := range w {
			if math.Float64bits(g[i]) != math.Float64bits(w[i]) {
				return fmt.Errorf("element %d is %v, want %v", i, g[i], w[i])
			}
		}
	default:
		return fmt.Errorf("want %T", want)
	}
	return nil
}

func lenOf(v any) int {
	switch v := v.(type) {
	case []float32:
		return len(v)
	case []float64:
		return len(v)
	}
	return -1
}

// recorder collects the hook's events of every rank.
type recorder struct {
	mu     sync.Mutex
	events []event
}

func (r *recorder) hook(ev event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, ev)
}

// ranges returns, per rank, the merged byte ranges of op on each file
// (by base name).
func (r *recorder) ranges(op string) map[int]map[string][][2]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[int]map[string][][2]int64{}
	for _, ev := range r.events {
		if ev.Op != op || ev.N == 0 {
			continue
		}
		if out[ev.Rank] == nil {
			out[ev.Rank] = map[string][][2]int64{}
		}
		f := baseName(ev.Path)
		out[ev.Rank][f] = append(out[ev.Rank][f], [2]int64{ev.Off, ev.Off + ev.N})
	}
	for _, m := range out {
		for f, rs := range m {
			m[f] = mergeRanges(rs)
		}
	}
	return out
}

func baseName(p string) string {
	for i := len(p) - 1; i >= 0; i-- {
		if p[i] == '/' {
			return p[i+1:]
		}
	}
	return p
}

// mergeRanges sorts half-open ranges and joins those that touch.
func mergeRanges(rs [][2]int64) [][2]int64 {
	rs = slices.Clone(rs)
	sort.Slice(rs, func(i, j int) bool { return rs[i][0] < rs[j][0] })
	var out [][2]int64
	for _, r := range rs {
		if n := len(out); n > 0 && r[0] <= out[n-1][1] {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	return out
}

// neededRanges computes, element by element and independently of the
// reader's run planning, the file bytes that block (off, size) of tensor
// t needs: for every element, the chunk that holds it and its bytes there.
func neededRanges(t *tensor, off, size []int) map[string][][2]int64 {
	es := int64(dtypeSize(t.DType))
	out := map[string][][2]int64{}
	n := prod(size)
	if n == 0 {
		return out
	}
	idx := make([]int, len(size))
	for p := range n {
		q := p
		for d := len(size) - 1; d >= 0; d-- {
			idx[d] = off[d] + q%size[d]
			q /= size[d]
		}
		for _, c := range t.Chunks {
			in := true
			lin := 0
			for d := range idx {
				if idx[d] < c.Offset[d] || idx[d] >= c.Offset[d]+c.Size[d] {
					in = false
					break
				}
				lin = lin*c.Size[d] + idx[d] - c.Offset[d]
			}
			if in {
				b := c.Begin + int64(lin)*es
				out[c.File] = append(out[c.File], [2]int64{b, b + es})
				break
			}
		}
	}
	for f, rs := range out {
		out[f] = mergeRanges(rs)
	}
	return out
}

// simulate runs fn on an in-process mesh and fails t on error.
func simulate(t *testing.T, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error, opts ...placementtest.Option) {
	t.Helper()
	if err := placementtest.Simulate(context.Background(), shape, names, fn, opts...); err != nil {
		t.Fatal(err)
	}
}

// simulateErr runs fn on an in-process mesh and returns its error.
func simulateErr(shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error) error {
	return placementtest.Simulate(context.Background(), shape, names, fn)
}
