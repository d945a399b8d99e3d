package topology

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// build makes a topology of n devices: every pair gets base, then the
// listed pairs get their own link.
func build(t *testing.T, n int, base Link, pairs map[[2]int]Link) *Topology {
	t.Helper()
	links := make([][]Link, n)
	for i := range links {
		links[i] = make([]Link, n)
		for j := range links[i] {
			links[i][j] = base
		}
	}
	for p, l := range pairs {
		links[p[0]][p[1]], links[p[1]][p[0]] = l, l
	}
	top, err := FromLinks(links, "test")
	if err != nil {
		t.Fatal(err)
	}
	return top
}

var (
	nv1 = Link{NVLinks: 1}
	nv2 = Link{NVLinks: 2}
	sys = Link{Path: PathSystem}
	phb = Link{Path: PathHostBridge}
	pix = Link{Path: PathSingle}
	nod = Link{Path: PathNode}
)

// dgx1 is the hybrid cube-mesh of an 8-GPU DGX-1 (V100): two fully
// connected quads, {0..3} and {4..7}, with i linked to i+4; the other
// pairs cross the CPU sockets.
func dgx1(t *testing.T) *Topology {
	return build(t, 8, sys, map[[2]int]Link{
		{0, 1}: nv1, {0, 2}: nv1, {0, 3}: nv2, {1, 2}: nv2, {1, 3}: nv1, {2, 3}: nv1,
		{4, 5}: nv1, {4, 6}: nv1, {4, 7}: nv2, {5, 6}: nv2, {5, 7}: nv1, {6, 7}: nv1,
		{0, 4}: nv2, {1, 5}: nv2, {2, 6}: nv2, {3, 7}: nv2,
	})
}

// twoSocket has even devices on socket 0 and odd ones on socket 1, with
// PCIe switch pairs (0,2), (4,6), (1,3), (5,7).
func twoSocket(t *testing.T) *Topology {
	pairs := map[[2]int]Link{}
	for i := range 8 {
		for j := i + 1; j < 8; j++ {
			if i%2 == j%2 {
				pairs[[2]int{i, j}] = nod
			}
		}
	}
	for _, p := range [][2]int{{0, 2}, {4, 6}, {1, 3}, {5, 7}} {
		pairs[p] = pix
	}
	return build(t, 8, sys, pairs)
}

func TestOrderExact(t *testing.T) {
	identity := func(n int) []int {
		out := make([]int, n)
		for i := range out {
			out[i] = i
		}
		return out
	}
	bridges := build(t, 4, phb, map[[2]int]Link{{0, 2}: nv2, {1, 3}: nv2})
	nvswitch := build(t, 8, Link{NVLinks: 18}, nil)
	cases := []struct {
		name  string
		top   *Topology
		shape []int
		want  []int
	}{
		{"uniform 8", Uniform(8, "no nvml"), []int{8}, identity(8)},
		{"uniform 2x4", Uniform(8, ""), []int{2, 4}, identity(8)},
		{"uniform 2x2x2", Uniform(8, ""), []int{2, 2, 2}, identity(8)},
		{"uniform 1x8x1", Uniform(8, ""), []int{1, 8, 1}, identity(8)},
		{"nvswitch 4x2", nvswitch, []int{4, 2}, identity(8)},
		{"nvswitch 8", nvswitch, []int{8}, identity(8)},
		{"bridges 2x2", bridges, []int{2, 2}, []int{0, 2, 1, 3}},
		{"bridges ring", bridges, []int{4}, []int{0, 1, 3, 2}},
		{"bridges 4x1", bridges, []int{4, 1}, []int{0, 1, 3, 2}},
		{"bridges 1x4", bridges, []int{1, 4}, []int{0, 1, 3, 2}},
		{"two sockets 2x2x2", twoSocket(t), []int{2, 2, 2}, []int{0, 2, 4, 6, 1, 3, 5, 7}},
		{"two sockets 2x4", twoSocket(t), []int{2, 4}, []int{0, 2, 4, 6, 1, 3, 5, 7}},
		{"one device", Uniform(1, ""), []int{1, 1}, []int{0}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tc.top.Order(tc.shape)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) == 0 && len(tc.want) == 0 {
				return
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("Order(%v) = %v, want %v\n%v", tc.shape, got, tc.want, tc.top)
			}
		})
	}
}

// minInner returns the slowest link between neighbours inside the groups
// of size s of order.
func minInner(top *Topology, order []int, s int) int {
	lo := 1 << 30
	for g := 0; g < len(order); g += s {
		for i := g; i < g+s; i++ {
			for j := i + 1; j < g+s; j++ {
				lo = min(lo, top.Links[order[i]][order[j]].Score())
			}
		}
	}
	return lo
}

func isPerm(order []int, n int) bool {
	s := slices.Clone(order)
	slices.Sort(s)
	for i := range s {
		if s[i] != i {
			return false
		}
	}
	return len(s) == n
}

func TestOrderProperties(t *testing.T) {
	d := dgx1(t)
	// Tensor parallel over a quad, data parallel across: each quad is
	// fully NVLinked, and the data-parallel partners (same position in
	// the two quads) are NVLinked too.
	o, err := d.Order([]int{2, 4})
	if err != nil {
		t.Fatal(err)
	}
	if !isPerm(o, 8) || minInner(d, o, 4) < nv1.Score() {
		t.Errorf("2x4 on DGX-1: %v", o)
	}
	for k := range 4 {
		if d.Links[o[k]][o[k+4]].NVLinks == 0 {
			t.Errorf("2x4 on DGX-1: %v: dp partners %d and %d are not NVLinked", o, o[k], o[k+4])
		}
	}
	// Pairs: every tensor-parallel pair on a double link.
	o, err = d.Order([]int{4, 2})
	if err != nil {
		t.Fatal(err)
	}
	if !isPerm(o, 8) || minInner(d, o, 2) < nv2.Score() {
		t.Errorf("4x2 on DGX-1: %v, want every pair on NV2", o)
	}
	// Relabelled two-socket box: the same structure under a permutation.
	perm := []int{5, 2, 7, 0, 3, 6, 1, 4}
	base := twoSocket(t)
	links := make([][]Link, 8)
	for i := range links {
		links[i] = make([]Link, 8)
	}
	for i := range 8 {
		for j := range 8 {
			links[perm[i]][perm[j]] = base.Links[i][j]
		}
	}
	shuffled, err := FromLinks(links, "shuffled")
	if err != nil {
		t.Fatal(err)
	}
	o, err = shuffled.Order([]int{2, 2, 2})
	if err != nil {
		t.Fatal(err)
	}
	if !isPerm(o, 8) || minInner(shuffled, o, 2) < pix.Score() || minInner(shuffled, o, 4) < nod.Score() {
		t.Errorf("2x2x2 on the shuffled box: %v", o)
	}
	// Greedy search (too many partitions to enumerate): 16 GPUs whose
	// NVLink pairs are (i, i+8), and quads (i, i+4, i+8, i+12).
	pairs := map[[2]int]Link{}
	for i := range 8 {
		pairs[[2]int{i, i + 8}] = nv2
	}
	big := build(t, 16, sys, pairs)
	if countPartitions(16, 2) <= partitionLimit {
		t.Fatal("the 16-GPU case does not exercise the greedy search")
	}
	o, err = big.Order([]int{8, 2})
	if err != nil {
		t.Fatal(err)
	}
	if !isPerm(o, 16) || minInner(big, o, 2) < nv2.Score() {
		t.Errorf("8x2 on 16 GPUs: %v", o)
	}
	quads := map[[2]int]Link{}
	for i := range 4 {
		for _, a := range []int{i, i + 4, i + 8, i + 12} {
			for _, b := range []int{i, i + 4, i + 8, i + 12} {
				if a < b {
					quads[[2]int{a, b}] = nv1
				}
			}
		}
	}
	big = build(t, 16, phb, quads)
	o, err = big.Order([]int{4, 4})
	if err != nil {
		t.Fatal(err)
	}
	if !isPerm(o, 16) || minInner(big, o, 4) < nv1.Score() {
		t.Errorf("4x4 on 16 GPUs: %v", o)
	}
}

func TestOrderErrors(t *testing.T) {
	top := Uniform(4, "")
	for _, shape := range [][]int{{3}, {2, 3}, {0, 4}, {-1, -4}, {}} {
		if _, err := top.Order(shape); !errors.Is(err, ErrInvalid) {
			t.Errorf("Order(%v): %v, want ErrInvalid", shape, err)
		}
	}
	if _, err := FromLinks([][]Link{{{}, nv1}, {{}, {}}}, "asym"); !errors.Is(err, ErrInvalid) {
		t.Errorf("asymmetric: %v", err)
	}
	if _, err := FromLinks([][]Link{{{}}, {{}, {}}}, "ragged"); !errors.Is(err, ErrInvalid) {
		t.Errorf("ragged: %v", err)
	}
}

func TestNormalizeBusID(t *testing.T) {
	cases := []struct{ in, want string }{
		{"00000000:07:00.0", "0000:07:00.0"},
		{"0000:B3:00.0", "0000:b3:00.0"},
		{"07:00.0", "0000:07:00.0"},
		{"0001:1a:1f.7\x00\x00", "0001:1a:1f.7"},
		{"bad", ""},
		{"0000:zz:00.0", ""},
		{"0000:07:00", ""},
	}
	for _, tc := range cases {
		got, err := NormalizeBusID(tc.in)
		if tc.want == "" {
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("%q: %q, %v, want ErrInvalid", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%q: %q, %v, want %q", tc.in, got, err, tc.want)
		}
	}
}

func TestForBusIDs(t *testing.T) {
	top := build(t, 3, phb, map[[2]int]Link{{0, 1}: nv2})
	for i := range top.Devices {
		top.Devices[i].BusID = []string{"0000:07:00.0", "0000:0a:00.0", "0000:b3:00.0"}[i]
	}
	sub, err := top.ForBusIDs([]string{"0000:B3:00.0", "00000000:0A:00.0"})
	if err != nil {
		t.Fatal(err)
	}
	if len(sub.Devices) != 2 || sub.Devices[0].BusID != "0000:b3:00.0" || sub.Devices[1].Index != 1 ||
		sub.Links[0][1] != phb || sub.Links[1][0] != phb || sub.Links[0][0].Path != PathSame {
		t.Errorf("ForBusIDs:\n%v", sub)
	}
	sub, err = top.ForBusIDs([]string{"0000:0a:00.0", "0000:07:00.0"})
	if err != nil || sub.Links[0][1] != nv2 {
		t.Errorf("ForBusIDs keeps the NVLink pair: %v %v", sub, err)
	}
	if _, err := top.ForBusIDs([]string{"0000:99:00.0"}); !errors.Is(err, ErrInvalid) {
		t.Errorf("unknown bus id: %v", err)
	}
}

func TestNVLinksBetween(t *testing.T) {
	a := &Device{BusID: "0000:07:00.0", NVLinkPeers: map[string]int{"0000:0a:00.0": 4}}
	b := &Device{BusID: "0000:0a:00.0", NVLinkPeers: map[string]int{"0000:07:00.0": 4}}
	s1 := &Device{BusID: "0000:1a:00.0", NVLinkPeers: map[string]int{"0000:c1:00.0": 18}, SwitchLinks: 18}
	s2 := &Device{BusID: "0000:1b:00.0", NVLinkPeers: map[string]int{"0000:c2:00.0": 12}, SwitchLinks: 12}
	cases := []struct {
		x, y *Device
		want int
	}{{a, b, 4}, {b, a, 4}, {s1, s2, 12}, {a, s1, 0}, {a, &Device{}, 0}}
	for i, tc := range cases {
		if got := nvlinksBetween(tc.x, tc.y); got != tc.want {
			t.Errorf("case %d: %d, want %d", i, got, tc.want)
		}
	}
	if s := (Link{NVLinks: 4}).String() + " " + (Link{Path: PathMultiple}).String() + " " + Path(42).String(); s != "NV4 PXB Path(42)" {
		t.Errorf("names: %q", s)
	}
	if !strings.Contains(dgx1(t).String(), "NV2") {
		t.Error("String lacks the link names")
	}
}

// TestDiscoverFallback: without NVML (as on machines with no NVIDIA
// driver) Discover fails with ErrUnavailable and Detect falls back to a
// uniform topology; with NVML it reports the GPUs.
func TestDiscoverFallback(t *testing.T) {
	top, derr := Discover()
	if derr != nil {
		if !errors.Is(derr, ErrUnavailable) {
			t.Fatalf("Discover: %v, want ErrUnavailable", derr)
		}
		d := Detect(4)
		if len(d.Devices) != 4 || !strings.HasPrefix(d.Source, "uniform (") {
			t.Errorf("Detect(4) = %v", d)
		}
		o, err := d.Order([]int{2, 2})
		if err != nil || !slices.Equal(o, []int{0, 1, 2, 3}) {
			t.Errorf("fallback order %v, %v", o, err)
		}
		t.Logf("no NVML: %v", derr)
		return
	}
	t.Logf("%v", top)
	for _, d := range top.Devices {
		if _, err := NormalizeBusID(d.BusID); err != nil {
			t.Errorf("GPU %d: bus id %q: %v", d.Index, d.BusID, err)
		}
	}
	if _, err := top.Order([]int{len(top.Devices)}); err != nil {
		t.Error(err)
	}
}
