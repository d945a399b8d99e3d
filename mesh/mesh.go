// Package mesh is loom's DeviceMesh: world ranks laid out row-major over
// named axes ("pp", "dp", "cp", "tp", "ep"), with sub-meshes by axis name,
// flattened axes ("dp","cp" -> "dp_cp") and one communicator per (axis,
// group).
//
// A Mesh is this rank's view: it knows the world rank at every position of
// the view, this rank's position and its coordinate. New builds the root
// mesh over a world communicator; Sub and Flatten derive further views. Every
// view derived from the same root shares one communicator registry, so any
// two views whose groups hold the same world ranks in the same order share
// one communicator.
//
// # Communicators and SPMD
//
// Comm and Group create a group's communicator on first use by calling Split
// on the root world communicator. Split is collective over the whole world:
// every world rank must make the same sequence of first-use calls (the same
// methods with the same axis names on corresponding views), in the same
// order, as in PyTorch's DeviceMesh. A rank that skips or reorders one makes
// the world's collectives mismatch. Later calls for a group that already has
// a communicator are local and need no agreement.
//
// The first of those calls on a root mesh or any view of it, even one that
// returns the world itself, is collective over the world: it checks with
// comm.Agree (one all-gather of 8 bytes per rank) that every world rank
// built the root mesh with the same axis names and sizes, in the same
// order, since ranks whose meshes differ would compute different groups.
// On a difference every rank gets the same error (a *comm.DisagreementError,
// matching loom.ErrMismatch) naming the ranks and the first axis that
// differs, before any communicator is split.
//
// A Mesh is safe for concurrent use by one rank's goroutines. Creating a
// communicator holds the registry's lock for the duration of the Split, so
// concurrent first uses are serialized; their order across goroutines must
// still be the same on every rank, which in practice means first uses come
// from one goroutine.
package mesh

import (
	"fmt"
	"slices"
	"strings"

	"github.com/b7ea7098/loom/comm"
)

// Mesh is one rank's view of an N-dimensional layout of world ranks over
// named axes. It is immutable; derived views share its communicator
// registry.
type Mesh struct {
	reg   *registry
	names []string
	shape []int
	ranks []int // world rank at every position, row-major over shape
	pos   int   // this rank's position in ranks
	coord []int // this rank's coordinate
}

// New lays the ranks of world out row-major over the named axes: names[i]
// has shape[i] positions, the last axis varies fastest, and world rank r sits
// at the coordinate whose row-major index is r. The product of shape must be
// world.Size(); sizes must be positive and names non-empty and distinct.
//
// New is local: it calls no collective, since it takes no context. Every
// world rank must pass the same shape and names; the first Comm or Group
// call on the mesh or a view of it checks that, with one all-gather of 8
// bytes over the world (comm.Agree), and fails on every rank with the same
// error, matching loom.ErrMismatch, that names the ranks that differ and
// their first differing axis ("rank 1 has "tp=2" at position 0 where ranks
// 0, 2, 3 have "dp=2"").
func New(world comm.Communicator, shape []int, names []string) (*Mesh, error) {
	const op = "New"
	if world == nil {
		return nil, invalidf(op, "nil world communicator")
	}
	if len(shape) != len(names) {
		return nil, invalidf(op, "%d sizes %v but %d names %q", len(shape), shape, len(names), names)
	}
	if len(shape) == 0 {
		return nil, invalidf(op, "a mesh needs at least one axis")
	}
	if err := checkNames(op, names); err != nil {
		return nil, err
	}
	n := 1
	for i, s := range shape {
		if s <= 0 {
			return nil, invalidf(op, "axis %q has size %d; sizes must be positive", names[i], s)
		}
		if s > world.Size()/n { // also keeps the product from overflowing
			return nil, invalidf(op, "shape %v covers more ranks than the world's %d", shape, world.Size())
		}
		n *= s
	}
	if n != world.Size() {
		return nil, invalidf(op, "shape %v covers %d ranks but the world has %d", shape, n, world.Size())
	}
	ranks := make([]int, n)
	for i := range ranks {
		ranks[i] = i
	}
	axes := make([]string, len(names))
	for i, name := range names {
		axes[i] = fmt.Sprintf("%s=%d", name, shape[i])
	}
	reg := &registry{world: world, axes: axes, comms: make(map[string]comm.Communicator)}
	return newView(reg, slices.Clone(names), slices.Clone(shape), ranks, world.Rank()), nil
}

// newView assembles a view. The slices are kept, not copied, and must not be
// modified afterwards (views are immutable and may share them).
func newView(reg *registry, names []string, shape []int, ranks []int, pos int) *Mesh {
	m := &Mesh{reg: reg, names: names, shape: shape, ranks: ranks, pos: pos}
	m.coord = m.unravel(pos)
	return m
}

// checkNames rejects empty and duplicate axis names.
func checkNames(op string, names []string) error {
	for i, n := range names {
		if n == "" {
			return invalidf(op, "axis %d has an empty name", i)
		}
		if j := slices.Index(names[:i], n); j >= 0 {
			return invalidf(op, "axis name %q appears twice (axes %d and %d)", n, j, i)
		}
	}
	return nil
}

// Names returns the axis names, outermost first.
func (m *Mesh) Names() []string { return slices.Clone(m.names) }

// Shape returns the axis sizes, outermost first.
func (m *Mesh) Shape() []int { return slices.Clone(m.shape) }

// Size is the number of ranks in the view.
func (m *Mesh) Size() int { return len(m.ranks) }

// NDim is the number of axes.
func (m *Mesh) NDim() int { return len(m.names) }

// AxisSize returns the size of the named axis.
func (m *Mesh) AxisSize(name string) (int, error) {
	i, err := m.axis("AxisSize", name)
	if err != nil {
		return 0, err
	}
	return m.shape[i], nil
}

// Rank is this rank's position in the view: the row-major index of Coord.
func (m *Mesh) Rank() int { return m.pos }

// WorldRank is this rank's rank in the root world communicator.
func (m *Mesh) WorldRank() int { return m.ranks[m.pos] }

// World returns the root world communicator the mesh was built on.
func (m *Mesh) World() comm.Communicator { return m.reg.world }

// Coord returns this rank's coordinate, one index per axis.
func (m *Mesh) Coord() []int { return slices.Clone(m.coord) }

// CoordOf returns the coordinate of the given mesh rank (a position in this
// view, not a world rank).
func (m *Mesh) CoordOf(meshRank int) ([]int, error) {
	if meshRank < 0 || meshRank >= len(m.ranks) {
		return nil, invalidf("CoordOf", "mesh rank %d out of range [0, %d)", meshRank, len(m.ranks))
	}
	return m.unravel(meshRank), nil
}

// RankOf returns the mesh rank (a position in this view, not a world rank)
// at coord.
func (m *Mesh) RankOf(coord []int) (int, error) {
	const op = "RankOf"
	if len(coord) != len(m.shape) {
		return 0, invalidf(op, "coordinate %v has %d entries; the mesh has %d axes %v", coord, len(coord), len(m.shape), m.names)
	}
	r := 0
	for i, c := range coord {
		if c < 0 || c >= m.shape[i] {
			return 0, invalidf(op, "coordinate %v: index %d on axis %q out of range [0, %d)", coord, c, m.names[i], m.shape[i])
		}
		r = r*m.shape[i] + c
	}
	return r, nil
}

// WorldRanks returns the world rank at every position of the view, in
// row-major order: WorldRanks()[Rank()] == WorldRank().
func (m *Mesh) WorldRanks() []int { return slices.Clone(m.ranks) }

// Local returns this rank's index on the named axis.
func (m *Mesh) Local(name string) (int, error) {
	i, err := m.axis("Local", name)
	if err != nil {
		return 0, err
	}
	return m.coord[i], nil
}

// String describes the view and this rank's place in it, e.g.
// "Mesh(dp=2, tp=4) rank 5 (world 5) at [1 1]".
func (m *Mesh) String() string {
	var b strings.Builder
	b.WriteString("Mesh(")
	for i, n := range m.names {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%d", n, m.shape[i])
	}
	fmt.Fprintf(&b, ") rank %d (world %d) at %v", m.pos, m.WorldRank(), m.coord)
	return b.String()
}

// axis returns the index of the named axis.
func (m *Mesh) axis(op, name string) (int, error) {
	if i := slices.Index(m.names, name); i >= 0 {
		return i, nil
	}
	return 0, &unknownAxisError{op: op, name: name, known: slices.Clone(m.names)}
}

// axes resolves distinct axis names to indices.
func (m *Mesh) axes(op string, names []string) ([]int, error) {
	idx := make([]int, len(names))
	for k, n := range names {
		i, err := m.axis(op, n)
		if err != nil {
			return nil, err
		}
		if j := slices.Index(names[:k], n); j >= 0 {
			return nil, invalidf(op, "axis %q named twice in %q", n, names)
		}
		idx[k] = i
	}
	return idx, nil
}

// unravel returns the coordinate of position p.
func (m *Mesh) unravel(p int) []int {
	c := make([]int, len(m.shape))
	for i := len(m.shape) - 1; i >= 0; i-- {
		c[i] = p % m.shape[i]
		p /= m.shape[i]
	}
	return c
}

// group returns the world ranks of this rank's group over the given axes:
// every position that agrees with this rank's coordinate off those axes,
// enumerated row-major over the axes in the order given.
func (m *Mesh) group(axes []int) []int {
	strides := make([]int, len(m.shape))
	s := 1
	for i := len(m.shape) - 1; i >= 0; i-- {
		strides[i] = s
		s *= m.shape[i]
	}
	// The position of this rank with the group axes zeroed.
	base := m.pos
	for _, a := range axes {
		base -= m.coord[a] * strides[a]
	}
	n := 1
	for _, a := range axes {
		n *= m.shape[a]
	}
	out := make([]int, n)
	idx := make([]int, len(axes)) // odometer over the group axes
	for k := range out {
		p := base
		for j, a := range axes {
			p += idx[j] * strides[a]
		}
		out[k] = m.ranks[p]
		for j := len(idx) - 1; j >= 0; j-- {
			idx[j]++
			if idx[j] < m.shape[axes[j]] {
				break
			}
			idx[j] = 0
		}
	}
	return out
}

// groupPos returns this rank's position in its group over axes (row-major
// over the axes in the order given).
func (m *Mesh) groupPos(axes []int) int {
	p := 0
	for _, a := range axes {
		p = p*m.shape[a] + m.coord[a]
	}
	return p
}
