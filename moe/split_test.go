package moe_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestDispatchCombineSplit: with payloads large enough, dispatch and
// combine move the rows in one all-to-all-v per local expert, straight
// into the routed layout, instead of one all-to-all-v and a regrouping
// pass; the results and every gradient still match the serial reference,
// in the ragged and static layouts and with ranks that receive nothing.
// The number of all-to-all-v's in the flight recorder shows which path
// ran: L per direction split, 1 otherwise (the small case). The
// diagnostics count the same rows either way.
func TestDispatchCombineSplit(t *testing.T) {
	const e, hd = 12, 3
	cases := []struct {
		name     string
		meshes   []epMesh
		n, k, d  int
		experts  func(n, k int) []int32
		capacity int
		f32      bool
		split    bool
		force    bool // split whatever the payload (SetSplitMinBytes)
	}{
		// The split pays from 64 KiB per rank and call on average, that is
		// group rows × D × 8 bytes ≥ 64 KiB × E = 768 KiB: 64 tokens × K=2
		// (10% unrouted) × 1024 float64 are about 920 KiB on one group;
		// on dp=2,ep=2 each group has half the tokens and stays unsplit.
		{name: "ragged", meshes: []epMesh{epMesh2, epMesh3}, n: 64, k: 2, d: 1024, split: true,
			experts: func(n, k int) []int32 { return routeRandom(n, e, k, 11, 0.1) }},
		{name: "ragged, no split", meshes: []epMesh{epMeshDP}, n: 64, k: 2, d: 1024,
			experts: func(n, k int) []int32 { return routeRandom(n, e, k, 11, 0.1) }},
		{name: "empty ranks", meshes: []epMesh{epMesh2, epMesh3}, n: 64, k: 2, d: 1024, split: true,
			experts: func(n, k int) []int32 { return routeAvoiding(n, 3, k, 12) }},
		{name: "static capacity", meshes: []epMesh{epMesh2, epMesh3}, n: 48, k: 2, d: 1024, capacity: 5, split: true, experts: routeSkewed},
		{name: "forced, small", meshes: []epMesh{epMesh2, epMesh3, epMesh4, epMeshDP, epMeshTP}, n: 13, k: 3, d: 4, split: true, force: true,
			experts: func(n, k int) []int32 { return routeRandom(n, e, k, 14, 0.2) }},
		{name: "forced, empty token shards", meshes: []epMesh{epMesh3, epMesh4, epMeshDP}, n: 2, k: 2, d: 4, split: true, force: true,
			experts: func(n, k int) []int32 { return routeRandom(n, e, k, 15, 0) }},
		{name: "forced, static capacity", meshes: []epMesh{epMesh2, epMesh4, epMeshTP}, n: 16, k: 2, d: 4, capacity: 1, split: true, force: true, experts: routeSkewed},
		{name: "float32", meshes: []epMesh{epMesh2}, n: 64, k: 2, d: 2048, f32: true, split: true,
			experts: func(n, k int) []int32 { return routeRandom(n, e, k, 13, 0) }},
	}
	for _, tc := range cases {
		for _, mc := range tc.meshes {
			t.Run(tc.name+"/"+mc.name, func(t *testing.T) {
				c := epRandom(tc.n, tc.d, e, tc.k, hd, tc.experts(tc.n, tc.k), 21)
				placementtest.Run(t, mc.shape, mc.names, func(ctx context.Context, m *mesh.Mesh) error {
					xs, err := placement.NewSpec(m, []int{c.n, c.d}, comm.Float64, mc.tokenPlaces())
					if err != nil {
						return err
					}
					kept, _ := epKept(c, xs, m, tc.capacity)
					want := epReference(c.n, c.d, c.e, c.k, c.hd, c.x, kept, c.gates, c.w1, c.b1, c.w2, c.b2, c.g)
					ep, err := m.Comm(ctx, "ep")
					if err != nil {
						return err
					}
					before := countOps(ep, comm.OpAllToAllV)
					cfg := moe.DispatchConfig{Capacity: tc.capacity, Diagnostics: true, Workspace: new(moe.Workspace), Collectives: true}
					if tc.force {
						moe.SetSplitMinBytes(cfg.Workspace, 1)
					}
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
					// Forward dispatch and combine, and their backward.
					p, _ := m.AxisSize("ep")
					calls := 4
					if tc.split {
						calls *= e / p
					}
					if got := countOps(ep, comm.OpAllToAllV) - before; got != calls {
						return fmt.Errorf("%d all-to-all-v's, want %d (split %v)", got, calls, tc.split)
					}
					return checkStats(run, c, kept, xs, m, tc.capacity)
				})
			})
		}
	}
}

// countOps counts the operations op in c's flight recorder.
func countOps(c comm.Communicator, op comm.Op) int {
	n := 0
	for _, e := range c.Recorder().Entries() {
		if e.Op == op.String() {
			n++
		}
	}
	return n
}
