package placement_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// testModel is a fixed cost model so that printed estimates are stable.
var testModel = &comm.CostModel{Alpha: 2e-6, Beta: 1e-10, Gamma: 2e-10, Bandwidth: 2e10, Cores: 2}

// rank0Mesh builds rank 0's view of a mesh (planning needs no collective).
func rank0Mesh(t testing.TB, shape []int, nm []string) *mesh.Mesh {
	t.Helper()
	p := 1
	for _, s := range shape {
		p *= s
	}
	w, err := local.NewWorld(p)
	if err != nil {
		t.Fatal(err)
	}
	m, err := mesh.New(w.Comm(0), shape, nm)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func mustSpec(t testing.TB, m *mesh.Mesh, shape []int, ps []placement.Placement, opts ...placement.SpecOption) *placement.Spec {
	t.Helper()
	s, err := placement.NewSpec(m, shape, comm.Float32, ps, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

type wantStep struct {
	kind  placement.StepKind
	axis  string
	bytes int64 // -1: don't check
}

// TestPlanClassic asserts the exact step sequence and bytes per rank of the
// classic transitions (float32, so 4 bytes an element).
func TestPlanClassic(t *testing.T) {
	m4 := rank0Mesh(t, []int{4}, []string{"x"})
	m22 := rank0Mesh(t, []int{2, 2}, []string{"a", "b"})
	m24 := rank0Mesh(t, []int{2, 4}, []string{"dp", "tp"})
	m14 := rank0Mesh(t, []int{1, 4}, []string{"pp", "tp"})
	const full = 8 * 4 * 4 // bytes of an [8 4] float32 tensor
	fsdpTP := placement.WithOrder(0, "tp", "dp")
	cases := []struct {
		name     string
		src, dst *placement.Spec
		want     []wantStep
	}{
		{"S->R is one all-gather of (p-1)/p", mustSpec(t, m4, []int{8, 4}, []placement.Placement{S0}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{R}),
			[]wantStep{{placement.StepAllGather, "x", full * 3 / 4}}},
		{"uneven S->R", mustSpec(t, m4, []int{5}, []placement.Placement{S0}), mustSpec(t, m4, []int{5}, []placement.Placement{R}),
			// shards of 2,2,1,0 rows: the empty rank receives all 5.
			[]wantStep{{placement.StepAllGather, "x", 5 * 4}}},
		{"P->R is one all-reduce", mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{R}),
			[]wantStep{{placement.StepAllReduce, "x", 2 * full * 3 / 4}}},
		{"P->S is one reduce-scatter", mustSpec(t, m4, []int{8, 4}, []placement.Placement{Pavg}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{S1}),
			[]wantStep{{placement.StepReduceScatter, "x", full * 3 / 4}}},
		{"S(i)->S(j) is one all-to-all", mustSpec(t, m4, []int{8, 4}, []placement.Placement{S0}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{S1}),
			[]wantStep{{placement.StepAllToAll, "x", full / 4 * 3 / 4}}},
		{"R->S is a local chunk", mustSpec(t, m4, []int{8, 4}, []placement.Placement{R}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{S0}),
			[]wantStep{{placement.StepChunk, "x", 0}}},
		{"R->P(sum) is local", mustSpec(t, m4, []int{8, 4}, []placement.Placement{R}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}),
			[]wantStep{{placement.StepToPartial, "x", 0}}},
		{"S->P(sum) is local", mustSpec(t, m4, []int{8, 4}, []placement.Placement{S1}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}),
			[]wantStep{{placement.StepShardToPartial, "x", 0}}},
		{"S->P(max) gathers first", mustSpec(t, m4, []int{8, 4}, []placement.Placement{S1}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{Pmax}),
			[]wantStep{{placement.StepAllGather, "x", full * 3 / 4}, {placement.StepToPartial, "x", 0}}},
		{"P(sum)->P(sum) is a no-op", mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}), nil},
		{"P(sum)->P(max) goes through R", mustSpec(t, m4, []int{8, 4}, []placement.Placement{Psum}), mustSpec(t, m4, []int{8, 4}, []placement.Placement{Pmax}),
			[]wantStep{{placement.StepAllReduce, "x", -1}, {placement.StepToPartial, "x", 0}}},
		{"size-1 axes are skipped", mustSpec(t, m14, []int{8, 4}, []placement.Placement{S0, R}), mustSpec(t, m14, []int{8, 4}, []placement.Placement{Psum, R}), nil},
		{"(S0,S0)->(R,S0) on 2-D", mustSpec(t, m22, []int{8, 4}, []placement.Placement{S0, S0}), mustSpec(t, m22, []int{8, 4}, []placement.Placement{R, S0}),
			[]wantStep{{placement.StepAllGather, "b", full / 4}, {placement.StepAllGather, "a", full / 2}, {placement.StepChunk, "b", 0}}},
		{"(S0,S1)->(S1,S0) misaligned", mustSpec(t, m22, []int{8, 4}, []placement.Placement{S0, S1}), mustSpec(t, m22, []int{8, 4}, []placement.Placement{S1, S0}),
			[]wantStep{{placement.StepAllGather, "b", full / 4}, {placement.StepAllToAll, "a", full / 4}, {placement.StepChunk, "b", 0}}},
		{"(P,S0)->(R,R) reduces while small", mustSpec(t, m22, []int{8, 4}, []placement.Placement{Psum, S0}), mustSpec(t, m22, []int{8, 4}, []placement.Placement{R, R}),
			[]wantStep{{placement.StepAllReduce, "a", full / 2 * 2 / 2}, {placement.StepAllGather, "b", full / 2}}},
		{"FSDP over TP: unshard dp keeps the TP shard", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, fsdpTP), mustSpec(t, m24, []int{8, 4}, []placement.Placement{R, S0}),
			[]wantStep{{placement.StepAllGather, "dp", full / 8}}},
		{"FSDP over TP to replicate", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, fsdpTP), mustSpec(t, m24, []int{8, 4}, []placement.Placement{R, R}),
			[]wantStep{{placement.StepAllGather, "dp", full / 8}, {placement.StepAllGather, "tp", full * 3 / 4}}},
		{"default order to FSDP-over-TP order", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}), mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, fsdpTP),
			[]wantStep{{placement.StepAllGather, "tp", -1}, {placement.StepAllGather, "dp", -1}, {placement.StepChunk, "tp", 0}, {placement.StepChunk, "dp", 0}}},
		{"TP shard to FSDP-over-TP is a local chunk", mustSpec(t, m24, []int{8, 4}, []placement.Placement{R, S0}), mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, fsdpTP),
			[]wantStep{{placement.StepChunk, "dp", 0}}},
	}
	planner := placement.NewPlanner(testModel)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := planner.Plan(tc.src, tc.dst)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%v", pl)
			steps := pl.Steps()
			if len(steps) != len(tc.want) {
				t.Fatalf("%d steps, want %d:\n%v", len(steps), len(tc.want), pl)
			}
			for i, w := range tc.want {
				s := steps[i]
				if s.Kind != w.kind || s.AxisName != w.axis || (w.bytes >= 0 && s.Bytes != w.bytes) {
					t.Errorf("step %d is %v on %q with %d B/rank, want %v on %q with %d B/rank\n%v", i+1, s.Kind, s.AxisName, s.Bytes, w.kind, w.axis, w.bytes, pl)
				}
				if (s.Collective != 0) != (s.Time > 0) {
					t.Errorf("step %d: collective %v but estimate %v", i+1, s.Collective, s.Time)
				}
			}
		})
	}
}

// TestPlanDirect checks that without a cost model, misaligned nested
// shards take one all-to-all-v over the mesh when it moves no more bytes
// than the per-axis plan.
func TestPlanDirect(t *testing.T) {
	m22 := rank0Mesh(t, []int{2, 2}, []string{"a", "b"})
	m24 := rank0Mesh(t, []int{2, 4}, []string{"dp", "tp"})
	p := placement.NewPlanner(nil)
	cases := []struct {
		name     string
		src, dst *placement.Spec
		bytes    int64
	}{
		// Rank (a,b) holds row-quarter 2a+b and needs half b: at most 2 quarters of 32 B arrive.
		{"(S0,S0)->(R,S0)", mustSpec(t, m22, []int{8, 4}, []placement.Placement{S0, S0}), mustSpec(t, m22, []int{8, 4}, []placement.Placement{R, S0}), 64},
		// Row 4dp+tp moves to row 2tp+dp: one 16-byte row per rank.
		{"default order to FSDP-over-TP order", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}), mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, placement.WithOrder(0, "tp", "dp")), 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := p.Plan(tc.src, tc.dst)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%v", pl)
			if !slices.Equal(pl.Collectives(), []comm.Op{comm.OpAllToAllV}) || pl.Bytes() != tc.bytes || pl.CrossMesh() {
				t.Errorf("want one direct all-to-all-v of %d B/rank, got\n%v", tc.bytes, pl)
			}
		})
	}
}

// TestPlanFSDPOverTPLayout checks the boxes of the FSDP-over-TP order: TP
// shards rows first, then dp splits each TP shard.
func TestPlanFSDPOverTPLayout(t *testing.T) {
	m := rank0Mesh(t, []int{2, 4}, []string{"dp", "tp"})
	s := mustSpec(t, m, []int{8, 4}, []placement.Placement{S0, S0}, placement.WithOrder(0, "tp", "dp"))
	d := mustSpec(t, m, []int{8, 4}, []placement.Placement{S0, S0})
	for r := range 8 {
		dp, tp := r/4, r%4
		off, size, err := s.Box(r)
		if err != nil {
			t.Fatal(err)
		}
		if off[0] != 2*tp+dp || size[0] != 1 {
			t.Errorf("rank %d (dp %d, tp %d): rows [%d, %d), want row %d", r, dp, tp, off[0], off[0]+size[0], 2*tp+dp)
		}
		off, _, _ = d.Box(r)
		if off[0] != 4*dp+tp {
			t.Errorf("default order: rank %d holds row %d, want %d", r, off[0], 4*dp+tp)
		}
	}
	if got := s.Order(0); !slices.Equal(got, []string{"tp", "dp"}) {
		t.Errorf("Order(0) = %v", got)
	}
	if !strings.Contains(s.String(), "order 0:[tp dp]") {
		t.Errorf("String() = %q lacks the order", s)
	}
}

// TestPlanCache checks that plans are cached by (source, destination).
func TestPlanCache(t *testing.T) {
	m := rank0Mesh(t, []int{2, 3}, []string{"a", "b"})
	p := placement.NewPlanner(nil)
	src := mustSpec(t, m, []int{5, 7}, []placement.Placement{S0, S1})
	dst := mustSpec(t, m, []int{5, 7}, []placement.Placement{R, S0})
	p1, err := p.Plan(src, dst)
	if err != nil {
		t.Fatal(err)
	}
	p2, _ := p.Plan(mustSpec(t, m, []int{5, 7}, []placement.Placement{S0, S1}), mustSpec(t, m, []int{5, 7}, []placement.Placement{R, S0}))
	if p1 != p2 {
		t.Error("equal specs planned twice")
	}
	p3, _ := p.Plan(dst, src)
	if p3 == p1 || p.CacheLen() != 2 {
		t.Errorf("cache has %d plans, want 2", p.CacheLen())
	}
	for _, s := range p1.Steps() {
		if s.Time != 0 {
			t.Error("a planner without a model estimated time")
		}
	}
}

// TestPlanCrossMesh plans between a 2x4 and an 8 mesh over the same world.
func TestPlanCrossMesh(t *testing.T) {
	w, _ := local.NewWorld(8)
	m24, _ := mesh.New(w.Comm(0), []int{2, 4}, []string{"dp", "tp"})
	m8, _ := mesh.New(w.Comm(0), []int{8}, []string{"world"})
	p := placement.NewPlanner(testModel)
	cases := []struct {
		name   string
		src    *placement.Spec
		dst    *placement.Spec
		colls  []comm.Op
		bytes  int64
		nsteps int
	}{
		// (S0,S0) default order on 2x4 is row r on world rank r, as S0 on 8: nothing moves.
		{"same rows", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}), mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}), nil, 0, 1},
		// (S0,R) on 2x4: rank r holds rows [4*(r/4), +4); S0 on 8 wants row r: local.
		{"dp shard to world shard", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, R}), mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}), nil, 0, 1},
		// FSDP-over-TP order: rank (dp,tp) holds row 2tp+dp; S0 on 8 wants row r: only ranks whose row differs move one row.
		{"strided to world shard", mustSpec(t, m24, []int{8, 4}, []placement.Placement{S0, S0}, placement.WithOrder(0, "tp", "dp")), mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}),
			[]comm.Op{comm.OpAllToAllV}, 16, 1},
		// S0 on 8 to (R, S0) on 2x4: every rank needs 2 rows and holds at most 1 of them.
		{"world shard to tp shard", mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}), mustSpec(t, m24, []int{8, 4}, []placement.Placement{R, S0}),
			[]comm.Op{comm.OpAllToAllV}, 32, 1},
		// Partial source: reduce on the source mesh first, then move.
		{"partial source", mustSpec(t, m24, []int{8, 4}, []placement.Placement{Psum, S1}), mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}),
			[]comm.Op{comm.OpAllReduce, comm.OpAllToAllV}, -1, 2},
		// Partial destination: move, then zero locally.
		{"partial destination", mustSpec(t, m8, []int{8, 4}, []placement.Placement{S0}), mustSpec(t, m24, []int{8, 4}, []placement.Placement{Psum, S0}),
			[]comm.Op{comm.OpAllToAllV}, -1, 2},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			pl, err := p.Plan(tc.src, tc.dst)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%v", pl)
			if !pl.CrossMesh() || len(pl.Steps()) != tc.nsteps || !slices.Equal(pl.Collectives(), tc.colls) {
				t.Errorf("got collectives %v in %d steps, want %v in %d\n%v", pl.Collectives(), len(pl.Steps()), tc.colls, tc.nsteps, pl)
			}
			if tc.bytes >= 0 && pl.Bytes() != tc.bytes {
				t.Errorf("plan moves %d B/rank, want %d\n%v", pl.Bytes(), tc.bytes, pl)
			}
		})
	}
}
