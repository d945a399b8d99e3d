package launch

import (
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm/nccl/topology"
)

func TestLocalShape(t *testing.T) {
	for _, c := range []struct {
		shape []int
		n     int
		want  []int
	}{
		{[]int{2, 2}, 4, []int{2, 2}}, // one host holds the mesh
		{[]int{4, 2}, 4, []int{2, 2}}, // two hosts: tp=2 and half of dp each
		{[]int{2, 4}, 4, []int{4}},    // two hosts: one tp group each
		{[]int{2, 8}, 4, []int{4}},    // tp spans hosts: half a tp group each
		{[]int{3, 2}, 4, nil},         // 4 ranks per host do not tile dp=3 × tp=2
		{[]int{1, 3}, 2, nil},         // tp=3 does not split in 2
		{nil, 4, nil},                 // no mesh given
		{[]int{2, 2, 2}, 8, []int{2, 2, 2}},
	} {
		if got := localShape(c.shape, c.n); !slices.Equal(got, c.want) {
			t.Errorf("localShape(%v, %d) = %v, want %v", c.shape, c.n, got, c.want)
		}
	}
}

// TestGPUOf: on four GPUs where NVLink joins 0-2 and 1-3, dp=2 × tp=2
// puts each tp pair on an NVLink pair; the uniform topology, an unknown
// mesh or a host whose GPU count differs keep GPU LOCAL_RANK.
func TestGPUOf(t *testing.T) {
	nv, pcie := topology.Link{NVLinks: 4}, topology.Link{Path: topology.PathHostBridge}
	links := [][]topology.Link{
		{{}, pcie, nv, pcie},
		{pcie, {}, pcie, nv},
		{nv, pcie, {}, pcie},
		{pcie, nv, pcie, {}},
	}
	paired, err := topology.FromLinks(links, "test")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		topo   *topology.Topology
		shape  []int
		local  int
		want   []int // GPU of local ranks 0..3
		layout string
	}{
		{"NVLink pairs", paired, []int{2, 2}, 4, []int{0, 2, 1, 3}, "GPU [0 2 1 3][i]"},
		{"uniform", topology.Uniform(4, "no NVML"), []int{2, 2}, 4, []int{0, 1, 2, 3}, "topology from uniform (no NVML)"},
		{"no mesh", paired, nil, 4, []int{0, 1, 2, 3}, "rank LOCAL_RANK on GPU LOCAL_RANK"},
		{"other GPU count", topology.Uniform(8, ""), []int{2, 2}, 4, []int{0, 1, 2, 3}, "8 GPUs known"},
	} {
		for r := range c.local {
			j := &Job{Backend: NCCL, WorldSize: 4, Processes: 4, Rank: r, LocalRank: r, LocalRanks: c.local}
			gpu, layout, err := gpuOf(j, c.shape, c.topo)
			if err != nil {
				t.Fatalf("%s: %v", c.name, err)
			}
			if gpu != c.want[r] || !strings.Contains(layout, c.layout) {
				t.Errorf("%s: local rank %d on GPU %d (%q), want %d (%q)", c.name, r, gpu, layout, c.want[r], c.layout)
			}
		}
	}
}
