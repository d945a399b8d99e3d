// Package ptest holds test helpers that the tests of package parallel and
// of parallel/tp, parallel/ddp and parallel/fsdp share: seeded replicated
// tensors and the batch layout (rows sharded on "dp").
package ptest

import (
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Replicated lays out a seeded random float64 tensor of shape on every axis
// of m as Replicate (placementtest.Random(shape, Float64, seed)).
func Replicated(m *mesh.Mesh, shape []int, seed uint64) (*placement.DTensor, error) {
	places := make([]placement.Placement, m.NDim())
	for i := range places {
		places[i] = placement.Replicate()
	}
	spec, err := placement.NewSpec(m, shape, comm.Float64, places)
	if err != nil {
		return nil, err
	}
	return placement.FromFull(spec, placementtest.Random(shape, comm.Float64, seed))
}

// BatchPlaces is Shard(0) on dp and Replicate elsewhere.
func BatchPlaces(m *mesh.Mesh) []placement.Placement {
	places := make([]placement.Placement, m.NDim())
	for i, name := range m.Names() {
		if name == "dp" {
			places[i] = placement.Shard(0)
		} else {
			places[i] = placement.Replicate()
		}
	}
	return places
}

// DataPlaces shards the batch on every data axis (dp, fsdp).
func DataPlaces(m *mesh.Mesh) []placement.Placement {
	places := make([]placement.Placement, m.NDim())
	for i, name := range m.Names() {
		places[i] = placement.Replicate()
		if name == "dp" || name == "fsdp" {
			places[i] = placement.Shard(0)
		}
	}
	return places
}
