// Package topology reads the GPUs of this machine and how they are
// connected (PCI bus ids, NVLink peers, the PCIe hierarchy between them)
// through NVML, and lays mesh axes onto them: Order returns the device of
// every mesh position so that the innermost axis sits on the fastest
// links, as DESIGN §6 asks (tensor parallelism on NVLink, data parallelism
// across).
//
// NVML (libnvidia-ml.so.1, or NVMLEnv) is loaded at run time through
// purego like every other GPU library of loom, so the package builds
// without cgo or a C compiler and reads the topology in every build,
// CGO_ENABLED=0 included. It lives beside the NCCL backend, not in mesh,
// because it is hardware discovery that only the GPU backend needs. It
// does not import mesh either (comm/* must not import upward); a launcher
// calls Order with the mesh's shape and gives world rank r the device
// Order returned at position r, since mesh lays world ranks out row-major.
//
// Without NVML (no libnvidia-ml.so.1, NVMLEnv=off, or a platform where
// libraries cannot be loaded at run time) Discover fails with
// ErrUnavailable and Detect falls back to Uniform: n devices with unknown
// links, for which Order is the identity, i.e. the usual rank-to-device
// mapping.
package topology

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom"
)

// ErrUnavailable is matched by Discover's error when NVML cannot be used.
var ErrUnavailable = errors.New("topology: NVML not available")

// ErrInvalid is matched by errors about bad arguments (shapes, bus ids,
// matrices).
var ErrInvalid = loom.NewSentinel("topology: invalid argument", loom.ErrInvalid)

// Path is how two GPUs reach each other over PCIe, from NVML's
// nvmlGpuTopologyLevel_t (the PIX/PXB/PHB/NODE/SYS of nvidia-smi topo),
// ordered from the slowest to the fastest.
type Path int

// The PCIe paths, slowest first. PathUnknown is what Uniform and a failed
// NVML query give.
const (
	PathUnknown    Path = iota
	PathSystem          // SYS: across CPU sockets (the SMP interconnect)
	PathNode            // NODE: host bridges of one NUMA node
	PathHostBridge      // PHB: through one CPU host bridge
	PathMultiple        // PXB: several PCIe switches, no host bridge
	PathSingle          // PIX: one PCIe switch
	PathSame            // the same device
)

var pathNames = []string{"?", "SYS", "NODE", "PHB", "PXB", "PIX", "X"}

// String returns nvidia-smi's abbreviation ("PIX"), or "?" when unknown.
func (p Path) String() string {
	if p >= 0 && int(p) < len(pathNames) {
		return pathNames[p]
	}
	return fmt.Sprintf("Path(%d)", int(p))
}

// Link is the connection between two GPUs.
type Link struct {
	// NVLinks is the number of active NVLink links between them, directly
	// or through NVSwitch (the smaller of the two GPUs' switch links).
	NVLinks int
	// Path is their PCIe path.
	Path Path
}

// Score ranks links by expected bandwidth: any NVLink beats any PCIe path,
// more NVLinks beat fewer, and PCIe paths rank as Path does. Only the
// order of scores matters.
func (l Link) Score() int {
	if l.NVLinks > 0 {
		return 1000 + 100*min(l.NVLinks, 64)
	}
	return 10 * int(l.Path)
}

// String formats the link as nvidia-smi topo -m does: "NV4", "PIX", ...
func (l Link) String() string {
	if l.NVLinks > 0 {
		return "NV" + strconv.Itoa(l.NVLinks)
	}
	return l.Path.String()
}

// Device is one GPU.
type Device struct {
	// Index is NVML's index (PCI bus order). CUDA numbers devices the same
	// way only with CUDA_DEVICE_ORDER=PCI_BUS_ID and no
	// CUDA_VISIBLE_DEVICES; use ForBusIDs to match CUDA ordinals.
	Index int
	Name  string
	UUID  string
	// BusID is the PCI address, normalised to "dddd:bb:dd.f" (lower-case
	// hex), as NormalizeBusID writes it.
	BusID string
	// NVLinkPeers counts this GPU's active NVLink links by the bus id of
	// what is at their other end (a GPU or an NVSwitch).
	NVLinkPeers map[string]int
	// SwitchLinks counts the active links that end at an NVSwitch.
	SwitchLinks int
}

// Topology is a set of GPUs and the links between every pair.
type Topology struct {
	Devices []Device
	// Links[i][j] connects Devices[i] and Devices[j]; Links[i][i] has
	// Path PathSame.
	Links [][]Link
	// Source says where the topology came from: "nvml", "uniform (...)",
	// or what the caller built it from.
	Source string
}

// Uniform returns n devices whose links are all unknown: the fallback when
// NVML is absent. Order on it is the identity.
func Uniform(n int, reason string) *Topology {
	t := &Topology{Devices: make([]Device, n), Links: make([][]Link, n), Source: "uniform"}
	if reason != "" {
		t.Source = "uniform (" + reason + ")"
	}
	for i := range n {
		t.Devices[i] = Device{Index: i}
		t.Links[i] = make([]Link, n)
		t.Links[i][i] = Link{Path: PathSame}
	}
	return t
}

// FromLinks builds a topology from a symmetric n×n matrix of links (the
// diagonal is ignored), for tests and for callers that know their
// machine. Devices get indices 0..n-1.
func FromLinks(links [][]Link, source string) (*Topology, error) {
	n := len(links)
	t := Uniform(n, "")
	t.Source = source
	for i := range n {
		if len(links[i]) != n {
			return nil, fmt.Errorf("%w: row %d of the link matrix has %d entries, want %d", ErrInvalid, i, len(links[i]), n)
		}
		for j := range n {
			if i == j {
				continue
			}
			if links[i][j] != links[j][i] {
				return nil, fmt.Errorf("%w: links %d-%d (%v) and %d-%d (%v) differ", ErrInvalid, i, j, links[i][j], j, i, links[j][i])
			}
			t.Links[i][j] = links[i][j]
		}
	}
	return t, nil
}

// Detect returns Discover's topology, or Uniform(n) when NVML is not
// available, with the reason in Source. n is the number of devices to
// assume then (for instance the CUDA device count).
func Detect(n int) *Topology {
	t, err := Discover()
	if err != nil {
		return Uniform(n, err.Error())
	}
	return t
}

// NormalizeBusID rewrites a PCI address ("00000000:07:00.0" from NVML,
// "0000:07:00.0" from CUDA, any case) as "dddd:bb:dd.f" in lower-case hex.
func NormalizeBusID(s string) (string, error) {
	s = strings.TrimSpace(strings.TrimRight(s, "\x00"))
	dom, rest, ok := strings.Cut(s, ":")
	if !ok {
		return "", fmt.Errorf("%w: PCI bus id %q", ErrInvalid, s)
	}
	if !strings.Contains(rest, ":") { // no domain: "07:00.0"
		dom, rest = "0", s
	}
	bus, rest, ok1 := strings.Cut(rest, ":")
	dev, fn, ok2 := strings.Cut(rest, ".")
	if !ok1 || !ok2 {
		return "", fmt.Errorf("%w: PCI bus id %q", ErrInvalid, s)
	}
	var v [4]uint64
	for i, part := range []string{dom, bus, dev, fn} {
		x, err := strconv.ParseUint(part, 16, 32)
		if err != nil {
			return "", fmt.Errorf("%w: PCI bus id %q: %v", ErrInvalid, s, err)
		}
		v[i] = x
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", v[0], v[1], v[2], v[3]), nil
}

// ForBusIDs returns the topology restricted to the devices with the given
// PCI bus ids, in that order, so that its indices are CUDA ordinals when
// busIDs[i] is CUDA device i's id (cuda.Context.PCIBusID, from device/cuda).
func (t *Topology) ForBusIDs(busIDs []string) (*Topology, error) {
	pos := make(map[string]int, len(t.Devices))
	for i, d := range t.Devices {
		pos[d.BusID] = i
	}
	idx := make([]int, len(busIDs))
	for k, b := range busIDs {
		nb, err := NormalizeBusID(b)
		if err != nil {
			return nil, err
		}
		i, ok := pos[nb]
		if !ok {
			return nil, fmt.Errorf("%w: no device at PCI %s (topology from %s)", ErrInvalid, nb, t.Source)
		}
		idx[k] = i
	}
	out := &Topology{Devices: make([]Device, len(idx)), Links: make([][]Link, len(idx)), Source: t.Source}
	for a, i := range idx {
		out.Devices[a] = t.Devices[i]
		out.Devices[a].Index = a
		out.Links[a] = make([]Link, len(idx))
		for b, j := range idx {
			out.Links[a][b] = t.Links[i][j]
		}
	}
	return out, nil
}

// String formats the link matrix like nvidia-smi topo -m.
func (t *Topology) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "topology from %s\n", t.Source)
	b.WriteString("      ")
	for j := range t.Devices {
		fmt.Fprintf(&b, " GPU%-3d", j)
	}
	b.WriteString("  PCI\n")
	for i, d := range t.Devices {
		fmt.Fprintf(&b, "GPU%-3d", i)
		for j := range t.Devices {
			fmt.Fprintf(&b, " %-6s", t.Links[i][j])
		}
		fmt.Fprintf(&b, "  %s\n", d.BusID)
	}
	return b.String()
}

// Order lays a mesh of the given shape (sizes of its axes, outermost
// first, as package mesh takes them) onto the devices, and returns the
// device index for every mesh position in row-major order: world rank r of
// a mesh over one machine should use device order[r]. The product of the
// shape must equal the number of devices.
//
// It works from the innermost axis out. The devices are split into groups
// of the innermost axis's size so as to maximise, over the groups, first
// the sum of each group's slowest link, then the sum of all links inside
// groups; each group is ordered as a ring (maximising its slowest, then
// its total, neighbour link), which ring collectives follow. The groups are
// then split and ordered the same way for the next axis, scoring two groups
// by the links between their members at the same position (the pairs that
// talk along that axis). Ties keep devices in index order, so a uniform
// topology gives the identity. The search is exhaustive for the partitions
// of up to about 20000 candidates (eight GPUs in any shape), greedy with
// pairwise swaps beyond.
func (t *Topology) Order(shape []int) ([]int, error) {
	n := len(t.Devices)
	prod := 1
	for i, s := range shape {
		if s < 1 {
			return nil, fmt.Errorf("%w: axis %d has size %d", ErrInvalid, i, s)
		}
		if prod > math.MaxInt/s {
			return nil, fmt.Errorf("%w: shape %v overflows", ErrInvalid, shape)
		}
		prod *= s
	}
	if prod != n {
		return nil, fmt.Errorf("%w: shape %v has %d positions for %d devices", ErrInvalid, shape, prod, n)
	}
	if n == 0 {
		return []int{}, nil
	}
	score := func(a, b int) int { return t.Links[a][b].Score() }
	units := make([][]int, n)
	for i := range units {
		units[i] = []int{i}
	}
	for k := len(shape) - 1; k >= 0; k-- {
		us := units
		// Two units talk along this axis between members at the same
		// position: their bottleneck and total over those pairs.
		unitScore := func(a, b int) (int, int) {
			lo, sum := math.MaxInt, 0
			for p := range us[a] {
				s := score(us[a][p], us[b][p])
				lo = min(lo, s)
				sum += s
			}
			return lo, sum
		}
		groups := partition(len(us), shape[k], unitScore)
		next := make([][]int, 0, len(groups))
		for _, g := range groups {
			var merged []int
			for _, u := range ring(g, unitScore) {
				merged = append(merged, us[u]...)
			}
			next = append(next, merged)
		}
		units = next
	}
	// Order the top-level units (one when the shape covers every device).
	var out []int
	for _, u := range units {
		out = append(out, u...)
	}
	return out, nil
}

// pairScore is a (bottleneck, total) score of a pair of units.
type pairScore func(a, b int) (lo, sum int)

// groupScore returns a group's slowest link and total over its pairs.
func groupScore(g []int, s pairScore) (int, int) {
	if len(g) < 2 {
		return 0, 0
	}
	lo, sum := math.MaxInt, 0
	for i := range g {
		for j := i + 1; j < len(g); j++ {
			l, t := s(g[i], g[j])
			lo = min(lo, l)
			sum += t
		}
	}
	return lo, sum
}

// better reports whether (a1, a2) beats (b1, b2) lexicographically.
func better(a1, a2, b1, b2 int) bool { return a1 > b1 || (a1 == b1 && a2 > b2) }

// partitionLimit bounds the exhaustive search.
const partitionLimit = 20000

// countPartitions is the number of ways to split m items into groups of
// size s, capped above partitionLimit.
func countPartitions(m, s int) float64 {
	// m! / ((s!)^(m/s) (m/s)!) = prod over groups of C(remaining-1, s-1).
	total := 1.0
	for rem := m; rem > 0; rem -= s {
		c := 1.0
		for i := 0; i < s-1; i++ {
			c = c * float64(rem-1-i) / float64(i+1)
		}
		total *= c
		if total > partitionLimit {
			return total
		}
	}
	return total
}

// partition splits units 0..m-1 into groups of size s maximising the sum
// of the groups' bottlenecks, then of their totals.
func partition(m, s int, score pairScore) [][]int {
	if s == 1 || s == m {
		var out [][]int
		if s == m {
			g := make([]int, m)
			for i := range g {
				g[i] = i
			}
			return [][]int{g}
		}
		for i := range m {
			out = append(out, []int{i})
		}
		return out
	}
	if countPartitions(m, s) <= partitionLimit {
		return exhaustive(m, s, score)
	}
	return greedy(m, s, score)
}

func evaluate(groups [][]int, score pairScore) (int, int) {
	a, b := 0, 0
	for _, g := range groups {
		lo, sum := groupScore(g, score)
		a += lo
		b += sum
	}
	return a, b
}

// exhaustive tries every partition: the lowest free unit always opens the
// next group, whose other members are chosen in increasing order, so the
// first best partition found is the lexicographically smallest.
func exhaustive(m, s int, score pairScore) [][]int {
	used := make([]bool, m)
	var cur, best [][]int
	bestA, bestB := math.MinInt, math.MinInt
	var rec func()
	rec = func() {
		first := -1
		for i := range m {
			if !used[i] {
				first = i
				break
			}
		}
		if first < 0 {
			a, b := evaluate(cur, score)
			if better(a, b, bestA, bestB) {
				bestA, bestB = a, b
				best = make([][]int, len(cur))
				for i, g := range cur {
					best[i] = append([]int(nil), g...)
				}
			}
			return
		}
		used[first] = true
		g := []int{first}
		var pick func(from int)
		pick = func(from int) {
			if len(g) == s {
				cur = append(cur, append([]int(nil), g...))
				rec()
				cur = cur[:len(cur)-1]
				return
			}
			for j := from; j < m; j++ {
				if used[j] {
					continue
				}
				used[j] = true
				g = append(g, j)
				pick(j + 1)
				g = g[:len(g)-1]
				used[j] = false
			}
		}
		pick(first + 1)
		used[first] = false
	}
	rec()
	return best
}

// greedy grows each group from the lowest free unit by adding the unit
// that keeps the group's bottleneck (then total) highest, then swaps
// members between groups while that improves the partition.
func greedy(m, s int, score pairScore) [][]int {
	used := make([]bool, m)
	var groups [][]int
	for {
		first := -1
		for i := range m {
			if !used[i] {
				first = i
				break
			}
		}
		if first < 0 {
			break
		}
		used[first] = true
		g := []int{first}
		for len(g) < s {
			bestJ, bestA, bestB := -1, math.MinInt, math.MinInt
			for j := range m {
				if used[j] {
					continue
				}
				a, b := groupScore(append(append([]int(nil), g...), j), score)
				if better(a, b, bestA, bestB) {
					bestJ, bestA, bestB = j, a, b
				}
			}
			used[bestJ] = true
			g = append(g, bestJ)
		}
		groups = append(groups, g)
	}
	curA, curB := evaluate(groups, score)
	for improved := true; improved; {
		improved = false
		for x := range groups {
			for y := x + 1; y < len(groups); y++ {
				for i := range groups[x] {
					for j := range groups[y] {
						groups[x][i], groups[y][j] = groups[y][j], groups[x][i]
						a, b := evaluate(groups, score)
						if better(a, b, curA, curB) {
							curA, curB, improved = a, b, true
							continue
						}
						groups[x][i], groups[y][j] = groups[y][j], groups[x][i]
					}
				}
			}
		}
	}
	return groups
}

// ring orders a group as a ring maximising its slowest neighbour link,
// then the total over neighbours; the first unit stays first, and among
// equal rings the earliest in lexicographic order (of positions in g)
// wins, the given order first. Groups of more than eight are ordered greedily
// (nearest neighbour).
func ring(g []int, score pairScore) []int {
	if len(g) <= 2 {
		return g
	}
	eval := func(o []int) (int, int) {
		lo, sum := math.MaxInt, 0
		for i := range o {
			l, t := score(o[i], o[(i+1)%len(o)])
			lo = min(lo, l)
			sum += t
		}
		return lo, sum
	}
	if len(g) > 8 {
		out := []int{g[0]}
		left := append([]int(nil), g[1:]...)
		for len(left) > 0 {
			bi, ba, bb := 0, math.MinInt, math.MinInt
			for i, u := range left {
				a, b := score(out[len(out)-1], u)
				if better(a, b, ba, bb) {
					bi, ba, bb = i, a, b
				}
			}
			out = append(out, left[bi])
			left = append(left[:bi], left[bi+1:]...)
		}
		return out
	}
	// Every ring that starts with g[0], in lexicographic order of the
	// positions of its members in g, so the first best one found is the
	// smallest: the given order itself when it is among the best.
	n := len(g)
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	best := append([]int(nil), g...)
	bestA, bestB := eval(best)
	cur := make([]int, n)
	for nextPermutation(idx[1:]) {
		for i, k := range idx {
			cur[i] = g[k]
		}
		if a, b := eval(cur); better(a, b, bestA, bestB) {
			bestA, bestB = a, b
			copy(best, cur)
		}
	}
	return best
}

// nextPermutation advances p to its lexicographic successor and reports
// whether there was one.
func nextPermutation(p []int) bool {
	i := len(p) - 2
	for i >= 0 && p[i] >= p[i+1] {
		i--
	}
	if i < 0 {
		return false
	}
	j := len(p) - 1
	for p[j] <= p[i] {
		j--
	}
	p[i], p[j] = p[j], p[i]
	slices.Reverse(p[i+1:])
	return true
}
