package moe_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Meshes for the synthetic cases: E = 12 experts divide over each.
var (
	epMesh1   = epMesh{"ep=1", []int{1}, []string{"ep"}}
	epMesh2   = epMesh{"ep=2", []int{2}, []string{"ep"}}
	epMesh3   = epMesh{"ep=3", []int{3}, []string{"ep"}}
	epMesh4   = epMesh{"ep=4", []int{4}, []string{"ep"}}
	epMeshDP  = epMesh{"dp=2,ep=2", []int{2, 2}, []string{"dp", "ep"}}
	epMeshTP  = epMesh{"ep=2,tp=2", []int{2, 2}, []string{"ep", "tp"}}
	epMeshAll = []epMesh{epMesh1, epMesh2, epMesh3, epMesh4, epMeshDP, epMeshTP}
)

// Routings of N tokens over E experts with K slots each.
func routeRandom(n, e, k int, seed uint64, unrouted float64) []int32 {
	s := seed*2654435761 + 7
	next := func() uint64 { s ^= s << 13; s ^= s >> 7; s ^= s << 17; return s }
	out := make([]int32, n*k)
	for t := range n {
		perm := make([]int32, e)
		for i := range perm {
			perm[i] = int32(i)
		}
		for i := e - 1; i > 0; i-- {
			j := int(next() % uint64(i+1))
			perm[i], perm[j] = perm[j], perm[i]
		}
		for j := range k {
			out[t*k+j] = perm[j]
			if float64(next()%1000)/1000 < unrouted {
				out[t*k+j] = -1
			}
		}
	}
	return out
}

// routeAvoiding routes every slot to experts below limit (so the ranks
// owning experts limit..E−1 receive nothing).
func routeAvoiding(n, limit, k int, seed uint64) []int32 {
	return routeRandom(n, limit, k, seed, 0)
}

func routeAllTo(n, k int, expert int32) []int32 {
	out := make([]int32, n*k)
	for i := range out {
		out[i] = expert
	}
	return out
}

// routeSkewed routes slot j of every token to expert (t·j) mod 3 + j·4: a
// few experts get most slots, so a small capacity drops many.
func routeSkewed(n, k int) []int32 {
	out := make([]int32, n*k)
	for t := range n {
		for j := range k {
			out[t*k+j] = int32(((t*(j+1))%3)*4 + j)
		}
	}
	return out
}

// epKept applies a static capacity to the global routing as every rank
// does to its own token shard: per shard and expert the first capacity
// slots in slot order stay, the rest become −1. It also returns the
// number dropped.
func epKept(c epCase, xs *placement.Spec, m *mesh.Mesh, capacity int) ([]int32, int) {
	out := slices.Clone(c.experts)
	if capacity == 0 {
		return out, 0
	}
	seen := map[int]bool{}
	dropped := 0
	for r := range m.Size() {
		off, size, _ := xs.Box(r)
		if seen[off[0]] || size[0] == 0 {
			continue
		}
		seen[off[0]] = true
		used := make([]int, c.e)
		for s := off[0] * c.k; s < (off[0]+size[0])*c.k; s++ {
			if ex := out[s]; ex >= 0 {
				if used[ex] == capacity {
					out[s] = -1
					dropped++
					continue
				}
				used[ex]++
			}
		}
	}
	return out, dropped
}

// TestDispatchCombine runs Dispatch → Experts → Combine with the loss Σ y·G
// on simulated meshes and compares the output and every gradient with a
// serial float64 reference: ragged and static-capacity layouts, empty
// ranks, empty token shards, one expert taking every token, K = E, tokens
// the router left unrouted, and capacity drops.
func TestDispatchCombine(t *testing.T) {
	const e = 12
	cases := []struct {
		name     string
		meshes   []epMesh
		n, k     int
		experts  func(n, k int) []int32
		capacity int
		f32      bool
	}{
		{name: "random", meshes: epMeshAll, n: 13, k: 2, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 1, 0) }},
		{name: "random float32", meshes: []epMesh{epMesh1, epMesh4, epMeshDP}, n: 13, k: 3, f32: true, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 2, 0) }},
		{name: "unrouted slots", meshes: epMeshAll, n: 11, k: 3, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 3, 0.3) }},
		{name: "last ranks receive nothing", meshes: epMeshAll, n: 10, k: 2, experts: func(n, k int) []int32 { return routeAvoiding(n, 3, k, 4) }},
		{name: "all tokens to one expert", meshes: epMeshAll, n: 9, k: 1, experts: func(n, k int) []int32 { return routeAllTo(n, k, 7) }},
		{name: "k = E", meshes: []epMesh{epMesh1, epMesh3, epMeshDP}, n: 5, k: e, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 5, 0) }},
		{name: "fewer tokens than ranks", meshes: []epMesh{epMesh3, epMesh4, epMeshDP}, n: 2, k: 2, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 6, 0) }},
		{name: "static capacity without drops", meshes: epMeshAll, n: 12, k: 2, capacity: 12, experts: func(n, k int) []int32 { return routeRandom(n, e, k, 7, 0.1) }},
		{name: "static capacity drops", meshes: epMeshAll, n: 16, k: 2, capacity: 1, experts: routeSkewed},
		{name: "static capacity float32", meshes: []epMesh{epMesh2, epMeshTP}, n: 16, k: 2, capacity: 2, f32: true, experts: routeSkewed},
	}
	for _, tc := range cases {
		for _, mc := range tc.meshes {
			// Both payload paths: fused over shared memory (comm/local's
			// default) and the all-to-all-v's that MPI and NCCL take.
			for _, collectives := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%s/collectives=%v", tc.name, mc.name, collectives), func(t *testing.T) {
					c := epRandom(tc.n, 4, e, tc.k, 5, tc.experts(tc.n, tc.k), uint64(len(tc.name)))
					placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
						xs, err := placement.NewSpec(m, []int{c.n, c.d}, comm.Float64, mc.tokenPlaces())
						if err != nil {
							return err
						}
						kept, dropped := epKept(c, xs, m, tc.capacity)
						want := epReference(c.n, c.d, c.e, c.k, c.hd, c.x, kept, c.gates, c.w1, c.b1, c.w2, c.b2, c.g)
						cfg := moe.DispatchConfig{Capacity: tc.capacity, Diagnostics: true, Collectives: collectives}
						var run *epRun
						tol := 1e-12
						if tc.f32 {
							run, err = epPass[float32](ctx, m, mc.tokenPlaces(), c, cfg)
							tol = 2e-5
						} else {
							run, err = epPass[float64](ctx, m, mc.tokenPlaces(), c, cfg)
						}
						if err != nil {
							return err
						}
						if err := run.compare(want, tol); err != nil {
							return err
						}
						// Dropped slots: the stats summed over the token shards
						// (every rank's local count, once per shard).
						gotDropped, err := sumOverShards(ctx, m, xs, run.stats.Dropped)
						if err != nil {
							return err
						}
						if gotDropped != int64(dropped) {
							return fmt.Errorf("dropped %d slots over the shards, want %d", gotDropped, dropped)
						}
						return checkStats(run, c, kept, xs, m, tc.capacity)
					})
				})
			}
		}
	}
}

// sumOverShards sums v over the distinct token shards (ranks that differ
// only on a replicating axis count once).
func sumOverShards(ctx context.Context, m *mesh.Mesh, xs *placement.Spec, v int64) (int64, error) {
	c, err := m.Group(ctx)
	if err != nil {
		return 0, err
	}
	all := make([]int64, m.Size())
	if err := comm.AllGather(ctx, c, comm.Host([]int64{v}), comm.Host(all)); err != nil {
		return 0, err
	}
	seen := map[int]bool{}
	var s int64
	for r := range m.Size() {
		off, _, _ := xs.Box(r)
		if !seen[off[0]] {
			seen[off[0]] = true
			s += all[r]
		}
	}
	return s, nil
}

// checkStats compares a run's diagnostics with counts from the global
// routing.
func checkStats(run *epRun, c epCase, kept []int32, xs *placement.Spec, m *mesh.Mesh, capacity int) error {
	s := run.stats
	p, _ := m.AxisSize("ep")
	l := c.e / p
	epc, _ := m.Local("ep")
	// The ep group: ranks sharing this rank's other coordinates.
	coord := m.Coord()
	matrix := make([][]int64, p)
	perExpert := make([]int64, c.e)
	var slots, unrouted int64
	for q := range p {
		matrix[q] = make([]int64, p)
		cq := slices.Clone(coord)
		cq[slices.Index(m.Names(), "ep")] = q
		mr, _ := m.RankOf(cq)
		off, size, _ := xs.Box(mr)
		for s := off[0] * c.k; s < (off[0]+size[0])*c.k; s++ {
			if q == epc {
				slots++
				if c.experts[s] < 0 {
					unrouted++
				}
			}
			if ex := kept[s]; ex >= 0 {
				matrix[q][int(ex)/l]++
				perExpert[ex]++
			}
		}
	}
	if !slices.EqualFunc(s.SendMatrix, matrix, slices.Equal) {
		return fmt.Errorf("send matrix %v, want %v", s.SendMatrix, matrix)
	}
	if !slices.Equal(s.TokensPerExpert, perExpert) {
		return fmt.Errorf("tokens per expert %v, want %v", s.TokensPerExpert, perExpert)
	}
	var maxSend, maxRecv int64
	for i := range p {
		var row, col int64
		for j := range p {
			row += matrix[i][j]
			col += matrix[j][i]
		}
		maxSend, maxRecv = max(maxSend, row), max(maxRecv, col)
	}
	if s.MaxSend != maxSend || s.MaxRecv != maxRecv {
		return fmt.Errorf("max send/receive %d/%d, want %d/%d", s.MaxSend, s.MaxRecv, maxSend, maxRecv)
	}
	var wantSent int64
	for _, v := range matrix[epc] {
		wantSent += v
	}
	var wantRecv int64
	for q := range p {
		wantRecv += matrix[q][epc]
	}
	if capacity > 0 {
		wantSent, wantRecv = int64(c.e*capacity), int64(p*l*capacity)
		var real int64
		for _, v := range matrix[epc] {
			real += v
		}
		if s.Padded != wantSent-real {
			return fmt.Errorf("padded %d rows, want %d", s.Padded, wantSent-real)
		}
	}
	if s.Sent != wantSent || s.Received != wantRecv || s.Slots != slots || s.Unrouted != unrouted {
		return fmt.Errorf("sent %d, received %d, slots %d, unrouted %d; want %d, %d, %d, %d", s.Sent, s.Received, s.Slots, s.Unrouted, wantSent, wantRecv, slots, unrouted)
	}
	if rows := run.handle.ExpertRows(); sumInts(rows) != int(wantRecv) || len(rows) != l {
		return fmt.Errorf("expert rows %v for %d received", rows, wantRecv)
	}
	if s.Forward.PayloadExchange < 0 || s.Backward.Experts <= 0 && wantRecv > 0 {
		return fmt.Errorf("timings not recorded: %+v", s)
	}
	return nil
}

func sumInts(v []int) int {
	s := 0
	for _, x := range v {
		s += x
	}
	return s
}

// dotRows is a test op: Σ rows ⊙ w over a Routed value, a scalar that is
// Partial(sum) on the routed axes. Its backward returns g·w laid out like
// the rows. It lets autograd differentiate through Dispatch alone.
func dotRows(rows *autograd.Value, w *placement.DTensor) (*autograd.Value, error) {
	rs := rows.Spec()
	places := make([]placement.Placement, len(rs.Placements()))
	for a, p := range rs.Placements() {
		places[a] = placement.Replicate()
		if p.IsRouted() {
			places[a] = placement.Partial(comm.Sum)
		}
	}
	spec, err := placement.NewSpec(rs.Mesh(), []int{}, comm.Float64, places)
	if err != nil {
		return nil, err
	}
	return autograd.Custom("dotRows", []*autograd.Value{rows},
		func() (*placement.DTensor, error) {
			a, b := rows.Data().LocalData().([]float64), w.LocalData().([]float64)
			s := 0.0
			for i := range a {
				s += a[i] * b[i]
			}
			return placement.NewLocal(spec, []float64{s})
		},
		func(_ context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			gv := g.LocalData().([]float64)[0]
			b := w.LocalData().([]float64)
			out := make([]float64, len(b))
			for i, v := range b {
				out[i] = gv * v
			}
			dt, err := placement.NewLocal(rs, out)
			return []*placement.DTensor{dt}, err
		})
}

// TestDispatchAdjoint is the dot-product test of docs/design.md §3 for both
// moves: ⟨Dispatch(x), y⟩ = ⟨x, Dispatchᵀ(y)⟩ with Dispatchᵀ from
// autograd's backward, which must also equal the unweighted Combine of y;
// and ⟨Combine(y, g), G⟩ = ⟨y, Combineᵀ(G)⟩. Pairings of Routed values use
// placement.Inner, which pairs equal row layouts.
func TestDispatchAdjoint(t *testing.T) {
	const e = 12
	for _, capacity := range []int{0, 2} {
		for _, mc := range epMeshAll {
			for _, collectives := range []bool{false, true} {
				t.Run(fmt.Sprintf("capacity=%d/%s/collectives=%v", capacity, mc.name, collectives), func(t *testing.T) {
					c := epRandom(11, 3, e, 3, 2, routeRandom(11, e, 3, 9, 0.2), 11)
					placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
						tape := autograd.NewTape()
						x, gates, r, err := epInputs(tape, m, c, mc.tokenPlaces(), false)
						if err != nil {
							return err
						}
						rows, h, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Capacity: capacity, Collectives: collectives})
						if err != nil {
							return err
						}
						// y: random rows in the dispatched layout, the same on
						// every replica of a routed group.
						n := len(rows.Data().LocalData().([]float64))
						off, _, _ := h.Spec().Box(m.Rank())
						yl := make([]float64, n)
						for i := range yl {
							yl[i] = math.Sin(float64(off[0]*c.d+i) * 0.7)
						}
						y, err := placement.NewLocal(h.Spec(), yl)
						if err != nil {
							return err
						}
						loss, err := dotRows(rows, y)
						if err != nil {
							return err
						}
						if err := tape.Backward(ctx, loss); err != nil {
							return err
						}
						lhs, err := placement.Inner(ctx, rows.Data(), y)
						if err != nil {
							return err
						}
						rhs, err := placement.Inner(ctx, x.Data(), x.Grad())
						if err != nil {
							return err
						}
						if math.Abs(lhs-rhs) > 1e-12*max(1, math.Abs(lhs)) {
							return fmt.Errorf("dispatch: <Dx, y> = %v, <x, D*y> = %v", lhs, rhs)
						}
						// The unweighted combine is the same map as the backward.
						yv, err := tape.Param("y", y)
						if err != nil {
							return err
						}
						back, err := moe.Combine(ctx, yv, h, nil)
						if err != nil {
							return err
						}
						if d := maxAbs(back.Data().LocalData().([]float64), x.Grad().LocalData().([]float64)); d > 1e-12 {
							return fmt.Errorf("unweighted combine differs from dispatch's backward by %g", d)
						}
						// Combine with gates, and its backward.
						tape.Reset()
						yv, _ = tape.Param("y", y)
						out, err := moe.Combine(ctx, yv, h, gates)
						if err != nil {
							return err
						}
						gc, err := epValue(tape, m, "G", []int{c.n, c.d}, mc.tokenPlaces(), c.g, false)
						if err != nil {
							return err
						}
						prod, err := autograd.Mul(out, gc)
						if err != nil {
							return err
						}
						s, err := autograd.Sum(prod)
						if err != nil {
							return err
						}
						if err := tape.Backward(ctx, s); err != nil {
							return err
						}
						lhs, err = placement.Inner(ctx, out.Data(), gc.Data())
						if err != nil {
							return err
						}
						rhs, err = placement.Inner(ctx, y, yv.Grad())
						if err != nil {
							return err
						}
						if math.Abs(lhs-rhs) > 1e-12*max(1, math.Abs(lhs)) {
							return fmt.Errorf("combine: <Cy, G> = %v, <y, C*G> = %v", lhs, rhs)
						}
						return nil
					})
				})
			}
		}
	}
}

// TestDispatchGradCheck compares the gradients of the whole chain
// (Dispatch, Experts, Combine with differentiable gates) with central
// finite differences in float64, ragged and static, on 2 ranks and on a
// dp × ep mesh.
func TestDispatchGradCheck(t *testing.T) {
	const e = 4
	for _, tc := range []struct {
		mc       epMesh
		capacity int
	}{{epMesh2, 0}, {epMesh2, 1}, {epMeshDP, 0}} {
		t.Run(fmt.Sprintf("%s/capacity=%d", tc.mc.name, tc.capacity), func(t *testing.T) {
			c := epRandom(5, 3, e, 2, 3, routeRandom(5, e, 2, 12, 0.1), 13)
			placementtest.Run(t, tc.mc.shape, tc.mc.names, func(ctx context.Context, m *mesh.Mesh) error {
				tok := tc.mc.tokenPlaces()
				ep := []placement.Placement{placement.Shard(0)}
				if len(tc.mc.names) == 2 {
					ep = []placement.Placement{placement.Replicate(), placement.Shard(0)}
				}
				spec := func(shape []int, places []placement.Placement, data []float64) *placement.DTensor {
					s, _ := placement.NewSpec(m, shape, comm.Float64, places)
					dt, _ := placement.FromFull(s, data)
					return dt
				}
				params := []*placement.DTensor{
					spec([]int{c.n, c.d}, tok, c.x), spec([]int{c.n, c.k}, tok, c.gates),
					spec([]int{e, c.hd, c.d}, ep, c.w1), spec([]int{e, c.hd}, ep, c.b1),
					spec([]int{e, c.d, c.hd}, ep, c.w2), spec([]int{e, c.d}, ep, c.b2),
				}
				gd := spec([]int{c.n, c.d}, tok, c.g)
				return autograd.Checker{Tol: 1e-6}.Check(ctx, func(tape *autograd.Tape, ps []*autograd.Value) (*autograd.Value, error) {
					experts, err := moe.NewExperts("ep", ps[2], ps[3], ps[4], ps[5])
					if err != nil {
						return nil, err
					}
					r, err := epLocalRouting(c, ps[0].Spec(), m, ps[1])
					if err != nil {
						return nil, err
					}
					rows, h, err := moe.Dispatch(ctx, ps[0], r, moe.DispatchConfig{Axis: "ep", Capacity: tc.capacity})
					if err != nil {
						return nil, err
					}
					out, err := experts.Forward(ctx, rows, h)
					if err != nil {
						return nil, err
					}
					y, err := moe.Combine(ctx, out, h, ps[1])
					if err != nil {
						return nil, err
					}
					// A nonlinear loss, Σ (y·G)², so that a wrong gradient
					// layout cannot hide behind linearity.
					g, err := tape.Constant(gd)
					if err != nil {
						return nil, err
					}
					yg, err := autograd.Mul(y, g)
					if err != nil {
						return nil, err
					}
					sq, err := autograd.Mul(yg, yg)
					if err != nil {
						return nil, err
					}
					return autograd.Sum(sq)
				}, params...)
			})
		})
	}
}

// TestDispatchMismatch: ranks that disagree give a clear error on every
// rank, naming the rank, the op and its sequence number, and never hang
// (each case runs under a deadline far below comm's default timeout).
func TestDispatchMismatch(t *testing.T) {
	const e = 4
	// collectives selects the payload path of the dispatches below: the
	// all-to-all-v's, or the fused path over shared memory.
	var collectives bool
	c := epRandom(8, 2, e, 2, 2, routeRandom(8, e, 2, 21, 0), 22)
	cases := []struct {
		name string
		// run is one rank's part; it returns the rank's error.
		run  func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error
		want []string // substrings every rank's error holds
		is   error    // what every rank's error matches, or nil
		// fusedWant and fusedIs replace want and is on the fused path,
		// when set: it checks the counts itself, before any row moves.
		fusedWant []string
		fusedIs   error
	}{
		{
			name: "static capacity differs across ranks",
			run: func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error {
				r, err := epLocalRouting(c, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				_, _, err = moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Capacity: 2 + m.Rank(), Collectives: collectives})
				return err
			},
			want:      []string{"alltoallv #", "rank", "counts disagree", "payload all-to-all-v"},
			is:        comm.ErrInvalid,
			fusedWant: []string{"dispatch over axis \"ep\" (fused)", "rank 0 sends 2 rows for expert 2, rank 1 expects 3", "no row moved"},
			fusedIs:   moe.ErrMismatch,
		},
		{
			name: "handles of different dispatches combined",
			run: func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error {
				r1, err := epLocalRouting(c, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				c2 := c
				c2.experts = routeAllTo(c.n, c.k, 0)
				r2, err := epLocalRouting(c2, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				rows1, h1, err := moe.Dispatch(ctx, x, r1, moe.DispatchConfig{Axis: "ep", Collectives: collectives})
				if err != nil {
					return err
				}
				rows2, h2, err := moe.Dispatch(ctx, x, r2, moe.DispatchConfig{Axis: "ep", Collectives: collectives})
				if err != nil {
					return err
				}
				if m.Rank() == 0 {
					_, err = moe.Combine(ctx, rows1, h1, gates)
				} else {
					_, err = moe.Combine(ctx, rows2, h2, gates)
				}
				return err
			},
			want:      []string{"alltoallv #", "sends", "expects"},
			is:        comm.ErrInvalid,
			fusedWant: []string{"combine over axis \"ep\" (fused)", "sends", "expects", "no row moved"},
			fusedIs:   moe.ErrMismatch,
		},
		{
			name: "one rank's routing is invalid",
			run: func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error {
				r, err := epLocalRouting(c, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				if m.Rank() == 1 {
					r.Experts[0] = int32(e) // out of range
				}
				_, _, err = moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep"})
				return err
			},
			want: []string{"moe: Dispatch"},
		},
		{
			name: "ranks disagree on K",
			run: func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error {
				r, err := epLocalRouting(c, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				if m.Rank() == 1 {
					r.K = 1
					r.Experts = r.Experts[:len(r.Experts)/2]
				}
				_, _, err = moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep"})
				return err
			},
			want: []string{"K=1", "no token row moved"},
			is:   moe.ErrMismatch,
		},
		{
			// Diagnostics adds barriers to later passes, so ranks must
			// agree on it before any of them runs.
			name: "ranks disagree on Diagnostics",
			run: func(ctx context.Context, m *mesh.Mesh, tape *autograd.Tape, x, gates *autograd.Value) error {
				r, err := epLocalRouting(c, x.Spec(), m, gates)
				if err != nil {
					return err
				}
				_, _, err = moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Diagnostics: m.Rank() == 1, Collectives: collectives})
				return err
			},
			want: []string{"diagnostics=0", "diagnostics=1", "no token row moved"},
			is:   moe.ErrMismatch,
		},
	}
	for _, tc := range cases {
		for _, collectives = range []bool{true, false} {
			want, is := tc.want, tc.is
			if !collectives && tc.fusedWant != nil {
				want, is = tc.fusedWant, tc.fusedIs
			}
			t.Run(fmt.Sprintf("%s/collectives=%v", tc.name, collectives), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				errs := make([]error, 2)
				_ = placementtest.Simulate(ctx, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
					tape := autograd.NewTape()
					x, err := epValue(tape, m, "x", []int{c.n, c.d}, []placement.Placement{placement.Shard(0)}, c.x, true)
					if err != nil {
						return err
					}
					gates, err := epValue(tape, m, "gates", []int{c.n, c.k}, []placement.Placement{placement.Shard(0)}, c.gates, true)
					if err != nil {
						return err
					}
					errs[m.Rank()] = tc.run(ctx, m, tape, x, gates)
					return nil
				})
				if ctx.Err() != nil {
					t.Fatalf("the case ran into its deadline: %v", ctx.Err())
				}
				for r, err := range errs {
					if err == nil {
						t.Errorf("rank %d: no error", r)
						continue
					}
					for _, w := range want {
						if !strings.Contains(err.Error(), w) {
							t.Errorf("rank %d: error %q does not mention %q", r, err, w)
						}
					}
					if is != nil && !errors.Is(err, is) {
						t.Errorf("rank %d: error %v does not match %v", r, err, is)
					}
				}
				if tc.name == "one rank's routing is invalid" && errs[0] != nil && errs[1] != nil {
					if !errors.Is(errs[0], moe.ErrMismatch) || !strings.Contains(errs[0].Error(), "rank(s) 1") {
						t.Errorf("rank 0: %v, want ErrMismatch naming rank 1", errs[0])
					}
					if !errors.Is(errs[1], moe.ErrInvalid) || !strings.Contains(errs[1].Error(), "expert 4") {
						t.Errorf("rank 1: %v, want ErrInvalid naming expert 4", errs[1])
					}
				}
			})
		}
	}
}

// TestDiagnosticsWait: with DispatchConfig.Diagnostics, the time a rank
// waits for a slower one before the combine and both backward passes is
// Timings.Wait, on both payload paths; without it Wait stays zero. Rank 1
// sleeps before each of those passes, standing in for experts with more
// rows.
func TestDiagnosticsWait(t *testing.T) {
	const e, delay = 4, 40 * time.Millisecond
	c := epRandom(8, 2, e, 2, 2, routeRandom(8, e, 2, 31, 0), 32)
	for _, collectives := range []bool{false, true} {
		for _, diag := range []bool{true, false} {
			t.Run(fmt.Sprintf("collectives=%v/diagnostics=%v", collectives, diag), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				stats := make([]moe.Stats, 2)
				err := placementtest.Simulate(ctx, []int{2}, []string{"ep"}, func(ctx context.Context, m *mesh.Mesh) error {
					tape := autograd.NewTape()
					x, gates, r, err := epInputs(tape, m, c, []placement.Placement{placement.Shard(0)}, true)
					if err != nil {
						return err
					}
					rows, h, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Diagnostics: diag, Collectives: collectives})
					if err != nil {
						return err
					}
					slow := func() {
						if m.Rank() == 1 {
							time.Sleep(delay)
						}
					}
					// The sleeps before the backward passes: in the sink's
					// backward (before the combine's) and in the rows'
					// (before the dispatch's).
					rows, err = autograd.Custom("slow", []*autograd.Value{rows},
						func() (*placement.DTensor, error) { return rows.Data(), nil },
						func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
							slow()
							return []*placement.DTensor{g}, nil
						})
					if err != nil {
						return err
					}
					slow()
					y, err := moe.Combine(ctx, rows, h, gates)
					if err != nil {
						return err
					}
					loss, err := autograd.Custom("slow-sink", []*autograd.Value{y},
						func() (*placement.DTensor, error) {
							spec, err := placement.NewSpec(m, []int{}, comm.Float64, []placement.Placement{placement.Partial(comm.Sum)})
							if err != nil {
								return nil, err
							}
							return placement.NewLocal(spec, []float64{0})
						},
						func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
							slow()
							ones := make([]float64, y.Data().Spec().LocalShape()[0]*c.d)
							for i := range ones {
								ones[i] = 1
							}
							dy, err := placement.NewLocal(y.Spec(), ones)
							return []*placement.DTensor{dy}, err
						})
					if err != nil {
						return err
					}
					if err := tape.Backward(ctx, loss); err != nil {
						return err
					}
					stats[m.Rank()] = h.Stats()
					return nil
				})
				if err != nil {
					t.Fatal(err)
				}
				fast := stats[0]
				if !diag {
					for r, s := range stats {
						if s.Forward.Wait != 0 || s.Backward.Wait != 0 {
							t.Errorf("rank %d: Wait %v forward, %v backward without diagnostics", r, s.Forward.Wait, s.Backward.Wait)
						}
					}
					return
				}
				// Rank 0 waits for rank 1 before the combine (forward) and
				// before both backward passes; rank 1 arrives last each time.
				if fast.Forward.Wait < delay/2 || fast.Backward.Wait < 3*delay/2 {
					t.Errorf("rank 0: Wait %v forward, %v backward; want about %v and %v", fast.Forward.Wait, fast.Backward.Wait, delay, 2*delay)
				}
				if slow := stats[1]; slow.Forward.Wait+slow.Backward.Wait > fast.Forward.Wait+fast.Backward.Wait/2 {
					t.Errorf("rank 1 arrives last, yet waited %v forward and %v backward (rank 0: %v, %v)", slow.Forward.Wait, slow.Backward.Wait, fast.Forward.Wait, fast.Backward.Wait)
				}
				if fast.Forward.Total() < fast.Forward.Wait {
					t.Errorf("Total %v leaves out Wait %v", fast.Forward.Total(), fast.Forward.Wait)
				}
			})
		}
	}
}

// TestDispatchErrors: arguments that do not fit are rejected before
// anything is communicated.
func TestDispatchErrors(t *testing.T) {
	const e = 4
	c := epRandom(4, 2, e, 2, 2, routeRandom(4, e, 2, 31, 0), 32)
	placementtest.Run(t, []int{2, 2}, []string{"ep", "tp"}, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		tok := []placement.Placement{placement.Shard(0), placement.Replicate()}
		x, err := epValue(tape, m, "x", []int{c.n, c.d}, tok, c.x, true)
		if err != nil {
			return err
		}
		xr, err := epValue(tape, m, "xr", []int{c.n, c.d}, replicated(m), c.x, true)
		if err != nil {
			return err
		}
		x3, err := epValue(tape, m, "x3", []int{c.n, 1, c.d}, []placement.Placement{placement.Shard(0), placement.Replicate()}, c.x, true)
		if err != nil {
			return err
		}
		gates, err := epValue(tape, m, "gates", []int{c.n, c.k}, tok, c.gates, true)
		if err != nil {
			return err
		}
		r, err := epLocalRouting(c, x.Spec(), m, gates)
		if err != nil {
			return err
		}
		odd := *r
		odd.NumExperts = 3
		short := *r
		short.Experts = r.Experts[:1]
		cases := []struct {
			name string
			run  func() error
			text string
		}{
			{"nil tokens", func() error { _, _, err := moe.Dispatch(ctx, nil, r, moe.DispatchConfig{Axis: "ep"}); return err }, "nil tokens"},
			{"nil routing", func() error { _, _, err := moe.Dispatch(ctx, x, nil, moe.DispatchConfig{Axis: "ep"}); return err }, "nil routing"},
			{"3-d tokens", func() error { _, _, err := moe.Dispatch(ctx, x3, r, moe.DispatchConfig{Axis: "ep"}); return err }, "want [N, D]"},
			{"unknown axis", func() error { _, _, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "pp"}); return err }, `"pp" is not an axis`},
			{"tokens not sharded on ep", func() error { _, _, err := moe.Dispatch(ctx, xr, r, moe.DispatchConfig{Axis: "ep"}); return err }, "not sharded over the expert-parallel axis"},
			{"experts do not divide", func() error { _, _, err := moe.Dispatch(ctx, x, &odd, moe.DispatchConfig{Axis: "ep"}); return err }, "do not divide"},
			{"negative capacity", func() error {
				_, _, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep", Capacity: -1})
				return err
			}, "Capacity -1: must be zero or positive"},
			{"short routing", func() error {
				_, _, err := moe.Dispatch(ctx, x, &short, moe.DispatchConfig{Axis: "ep", Capacity: 2})
				return err
			}, "routing of 1 slots"},
		}
		for _, tc := range cases {
			if err := tc.run(); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), tc.text) {
				t.Errorf("%s: error %v, want ErrInvalid containing %q", tc.name, err, tc.text)
			}
		}
		// Combine and Experts check what they are given against the
		// handle.
		rows, h, err := moe.Dispatch(ctx, x, r, moe.DispatchConfig{Axis: "ep"})
		if err != nil {
			return err
		}
		if _, err := moe.Combine(ctx, x, h, gates); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), "use the rows of the same dispatch") {
			t.Errorf("combine of tokens: %v", err)
		}
		if _, err := moe.Combine(ctx, rows, h, xr); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), "gates are") {
			t.Errorf("combine with bad gates: %v", err)
		}
		if _, err := moe.Combine(ctx, rows, nil, gates); !errors.Is(err, moe.ErrInvalid) {
			t.Errorf("combine without handle: %v", err)
		}
		ep := []placement.Placement{placement.Shard(0), placement.Replicate()}
		w1, _ := epValue(tape, m, "W1", []int{e, 3, c.d}, ep, make([]float64, e*3*c.d), true)
		b1, _ := epValue(tape, m, "b1", []int{e, 3}, ep, make([]float64, e*3), true)
		w2, _ := epValue(tape, m, "W2", []int{e, c.d, 3}, ep, make([]float64, e*3*c.d), true)
		b2, _ := epValue(tape, m, "b2", []int{e, c.d}, ep, make([]float64, e*c.d), true)
		b2r, _ := epValue(tape, m, "b2", []int{e, c.d}, replicated(m), make([]float64, e*c.d), true)
		if _, err := moe.NewExperts("ep", w1, b1, w2, b2r); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), "b2 is laid out") {
			t.Errorf("replicated b2: %v", err)
		}
		if _, err := moe.NewExperts("ep", w1, b1, w1, b2); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), "W2 has shape") {
			t.Errorf("W2 of W1's shape: %v", err)
		}
		experts, err := moe.NewExperts("ep", w1, b1, w2, b2)
		if err != nil {
			return err
		}
		if _, err := experts.Forward(ctx, x, h); !errors.Is(err, moe.ErrInvalid) || !strings.Contains(err.Error(), "the rows are laid out") {
			t.Errorf("experts on tokens: %v", err)
		}
		return nil
	})
}
