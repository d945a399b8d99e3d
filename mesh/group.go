package mesh

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/b7ea7098/loom/comm"
)

// registry holds the communicators of every group created through a root
// mesh and the views derived from it, keyed by the group's ordered world
// ranks. It belongs to one rank.
type registry struct {
	world comm.Communicator
	// axes describes the root mesh ("dp=2", one entry per axis), which
	// every world rank must have built alike.
	axes []string

	// mu guards agreed and comms and is held across the agreement check
	// and Split, so that one rank's goroutines never issue two calls on
	// world at once and a group is split at most once.
	mu     sync.Mutex
	agreed bool
	comms  map[string]comm.Communicator
}

// Comm returns the communicator of this rank's group along the named axis:
// the ranks that share this rank's coordinate on every other axis, ordered
// by their index on the axis, so its Rank() is Local(name). It is
// Group(ctx, name).
//
// The communicator is created on first use by a Split over the whole root
// world, which every world rank must join, and the first Comm or Group call
// of the root mesh and its views checks that the ranks built it alike: see
// the package documentation.
func (m *Mesh) Comm(ctx context.Context, name string) (comm.Communicator, error) {
	axes, err := m.axes("Comm", []string{name})
	if err != nil {
		return nil, err
	}
	return m.reg.get(ctx, "Comm", m.group(axes), m.groupPos(axes))
}

// Group returns the communicator of this rank's group over the named axes:
// the ranks that share this rank's coordinate on every other axis, ordered
// row-major over the named axes in the order given. With no names it spans
// every axis in mesh order, so it is the communicator of the whole view,
// whose Rank() is Rank(). If the group is the whole root world in world
// order, the world communicator itself is returned.
//
// The communicator is created on first use by a Split over the whole root
// world, which every world rank must join, and the first Comm or Group call
// of the root mesh and its views checks that the ranks built it alike: see
// the package documentation. Views with the same group (the same world ranks in the same order) share
// one communicator, whichever view created it.
func (m *Mesh) Group(ctx context.Context, names ...string) (comm.Communicator, error) {
	var axes []int
	if len(names) == 0 {
		axes = make([]int, len(m.names))
		for i := range axes {
			axes[i] = i
		}
	} else {
		var err error
		if axes, err = m.axes("Group", names); err != nil {
			return nil, err
		}
	}
	return m.reg.get(ctx, "Group", m.group(axes), m.groupPos(axes))
}

// get returns the communicator of the group with the given world ranks, in
// which this rank sits at position pos, splitting the world on first use.
// The registry's first get, whatever the group, first checks that every
// world rank built the root mesh alike; op names the caller for its error.
func (r *registry) get(ctx context.Context, op string, ranks []int, pos int) (comm.Communicator, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.agreed {
		// Ranks whose meshes differ compute different groups, which at
		// best fail the Split obscurely and at worst pair the wrong ranks.
		// A failure is not remembered: every rank got it, so a retry is
		// again collective on every rank.
		if err := comm.Agree(ctx, r.world, "the mesh axes", r.axes); err != nil {
			return nil, fmt.Errorf("mesh: %s: %w", op, err)
		}
		r.agreed = true
	}
	if isIdentity(ranks, r.world.Size()) {
		return r.world, nil
	}
	key := groupKey(ranks)
	if c, ok := r.comms[key]; ok {
		return c, nil
	}
	// Groups of one call partition the world, so the smallest world rank
	// identifies this group among them; the key orders the members.
	color := ranks[0]
	for _, w := range ranks[1:] {
		color = min(color, w)
	}
	c, err := r.world.Split(ctx, color, pos)
	if err != nil {
		return nil, fmt.Errorf("mesh: creating the communicator of group [%s]: %w", key, err)
	}
	if c == nil || c.Size() != len(ranks) || c.Rank() != pos {
		got := "nil"
		if c != nil {
			got = fmt.Sprintf("size %d, rank %d", c.Size(), c.Rank())
		}
		return nil, fmt.Errorf("mesh: Split(color %d, key %d) for group [%s] returned %s; want size %d, rank %d (are all world ranks making the same calls?)",
			color, pos, key, got, len(ranks), pos)
	}
	r.comms[key] = c
	return c, nil
}

// isIdentity reports whether ranks is 0..n-1 in order.
func isIdentity(ranks []int, n int) bool {
	if len(ranks) != n {
		return false
	}
	for i, w := range ranks {
		if w != i {
			return false
		}
	}
	return true
}

// groupKey encodes an ordered list of world ranks, e.g. "0,4".
func groupKey(ranks []int) string {
	var b strings.Builder
	for i, w := range ranks {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(w))
	}
	return b.String()
}
