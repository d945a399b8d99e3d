package placement

import (
	"context"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
)

// xfer is one box of the global tensor that world rank from sends to world
// rank to in a cross-mesh step (from == to: a local copy).
type xfer struct {
	from, to  int
	off, size []int
}

// crossData is the rank-independent schedule of a cross-mesh step.
type crossData struct {
	xfers []xfer // in canonical order: by destination, then source box
}

// unpartial returns the state of l with every Partial axis replaced by
// Replicate.
func unpartial(l *layout) *state {
	s := newState(l)
	for a, p := range s.places {
		if p.IsPartial() {
			s.places[a] = Replicate()
		}
	}
	return s
}

// planDirect plans a redistribution with one all-to-all-v over every
// rank: reduce the source's Partial axes on the source mesh, move exactly
// the boxes whose owner changes, then re-create the destination's Partial
// axes locally. The two meshes (possibly the same) must hold the same world
// ranks.
func planDirect(src, dst *layout, model *comm.CostModel) (*Plan, error) {
	const op = "Plan"
	a, b := slices.Clone(src.ranks), slices.Clone(dst.ranks)
	slices.Sort(a)
	slices.Sort(b)
	if !slices.Equal(a, b) {
		return nil, invalidf(op, "the source mesh (%s) and the destination mesh (%s) hold different world ranks; cross-mesh redistribute needs the same ranks", src.meshKey(), dst.meshKey())
	}
	pl := &Plan{src: src, dst: dst}
	pre, err := planAxes(newState(src), unpartial(src), src, model)
	if err != nil {
		return nil, err
	}
	pl.steps = append(pl.steps, pre...)

	cd := &crossData{}
	es := src.dtype.Size()
	// Bytes by world rank. A rank receives disjoint pieces of its own
	// block, but may send its block to many ranks: these sums are
	// checked, and bound every count crossExec forms.
	recvBytes := map[int]int{}
	sendBytes := map[int]int{}
	overflow := false
	add := func(m map[int]int, w, n int) {
		var ok bool
		m[w], ok = checked.Add(m[w], n)
		overflow = overflow || !ok
	}
	// Distinct source boxes and their holders (world ranks).
	type group struct {
		off, size []int
		holders   []int
	}
	var groups []*group
	for pos, w := range src.ranks {
		off, sz := boxOf(src.shape, src.mshape, src.order, unravel(pos, src.mshape))
		if prod(sz) == 0 {
			continue
		}
		i := slices.IndexFunc(groups, func(g *group) bool { return slices.Equal(g.off, off) && slices.Equal(g.size, sz) })
		if i < 0 {
			groups = append(groups, &group{off: off, size: sz})
			i = len(groups) - 1
		}
		groups[i].holders = append(groups[i].holders, w)
	}
	for _, g := range groups {
		slices.Sort(g.holders)
	}
	order := slices.Clone(dst.ranks)
	slices.Sort(order)
	dstPos := map[int]int{}
	for pos, w := range dst.ranks {
		dstPos[w] = pos
	}
	moved := false
	for _, v := range order {
		off, sz := boxOf(dst.shape, dst.mshape, dst.order, unravel(dstPos[v], dst.mshape))
		if prod(sz) == 0 {
			continue
		}
		for _, g := range groups {
			io, is, ok := intersect(off, sz, g.off, g.size)
			if !ok {
				continue
			}
			from := v
			if !slices.Contains(g.holders, v) {
				from = g.holders[v%len(g.holders)]
				moved = true
				n := prod(is) * es // a piece of a block: fits
				add(recvBytes, v, n)
				add(sendBytes, from, n)
			}
			cd.xfers = append(cd.xfers, xfer{from: from, to: v, off: io, size: is})
		}
	}
	name := "world"
	if src.sameMesh(dst) {
		name = "mesh"
	}
	st := Step{Kind: StepDirect, Axis: -1, AxisName: name, AxisSize: len(src.ranks), Dim: -1, ToDim: -1,
		From: Replicate(), To: Replicate()}
	if overflow {
		return nil, invalidf(op, "the direct step for %v %v: a rank's byte count overflows int", src.shape, src.dtype)
	}
	if moved {
		st.Collective = comm.OpAllToAllV
		for _, n := range recvBytes {
			st.Bytes = max(st.Bytes, int64(n))
		}
		for _, n := range sendBytes {
			st.Payload = max(st.Payload, int64(n))
		}
		if model != nil {
			st.Time = model.Estimate(comm.OpAllToAllV, len(src.ranks), st.Payload)
		}
	}
	st.cross = cd
	pl.cross = len(pl.steps)
	pl.steps = append(pl.steps, st)

	post, err := planAxes(unpartial(dst), newState(dst), dst, model)
	if err != nil {
		return nil, err
	}
	pl.steps = append(pl.steps, post...)
	if err := pl.checkBytes(); err != nil {
		return nil, err
	}
	return pl, nil
}

// intersect returns the intersection of two boxes.
func intersect(o1, s1, o2, s2 []int) (off, size []int, ok bool) {
	off = make([]int, len(o1))
	size = make([]int, len(o1))
	for d := range o1 {
		lo := max(o1[d], o2[d])
		hi := min(o1[d]+s1[d], o2[d]+s2[d])
		if hi <= lo {
			return nil, nil, false
		}
		off[d], size[d] = lo, hi-lo
	}
	return off, size, true
}

// sub returns a - b element-wise.
func sub(a, b []int) []int {
	c := make([]int, len(a))
	for i := range a {
		c[i] = a[i] - b[i]
	}
	return c
}

// crossExec runs a cross-mesh step on this rank: x is laid out by the
// source layout without Partial axes; the result by the destination layout
// without Partial axes.
func crossExec[T elem](ctx context.Context, pl *Plan, src, dst *mesh.Mesh, x block[T]) (block[T], error) {
	st := &pl.steps[pl.cross]
	cd := st.cross
	s, d := pl.src, pl.dst
	me := src.WorldRank()
	srcOff, _ := boxOf(s.shape, s.mshape, s.order, src.Coord())
	dstOff, dstSize := boxOf(d.shape, d.mshape, d.order, dst.Coord())
	out := block[T]{shape: dstSize, data: make([]T, prod(dstSize))}
	zero := make([]int, len(dstSize))
	// Local copies.
	for _, x2 := range cd.xfers {
		if x2.from == me && x2.to == me {
			kernels.CopyBox(out.data, out.shape, sub(x2.off, dstOff), x.data, x.shape, sub(x2.off, srcOff), x2.size)
		}
	}
	if st.Collective == 0 {
		return out, nil
	}
	// The communicator: the world when the mesh covers it in order, else the
	// source mesh's whole-view group (same ranks, ordered by source position).
	var c comm.Communicator
	pos := func(w int) int { return w }
	if len(s.ranks) == src.World().Size() {
		c = src.World()
	} else {
		var err error
		if c, err = src.Group(ctx); err != nil {
			return x, err
		}
		idx := map[int]int{}
		for p, w := range s.ranks {
			idx[w] = p
		}
		pos = func(w int) int { return idx[w] }
	}
	p := c.Size()
	sendCounts := make([]int, p)
	recvCounts := make([]int, p)
	for _, x2 := range cd.xfers {
		if x2.from == x2.to {
			continue
		}
		n := prod(x2.size)
		if x2.from == me {
			sendCounts[pos(x2.to)] += n
		}
		if x2.to == me {
			recvCounts[pos(x2.from)] += n
		}
	}
	sendOff := prefix(sendCounts)
	recvOff := prefix(recvCounts)
	send := make([]T, sum(sendCounts))
	recv := make([]T, sum(recvCounts))
	for _, x2 := range cd.xfers {
		if x2.from == me && x2.to != me {
			q := pos(x2.to)
			kernels.CopyBox(send[sendOff[q]:], x2.size, zero, x.data, x.shape, sub(x2.off, srcOff), x2.size)
			sendOff[q] += prod(x2.size)
		}
	}
	if err := comm.AllToAllV(ctx, c, comm.Host(send), comm.Host(recv), sendCounts, recvCounts); err != nil {
		return x, err
	}
	for _, x2 := range cd.xfers {
		if x2.to == me && x2.from != me {
			q := pos(x2.from)
			kernels.CopyBox(out.data, out.shape, sub(x2.off, dstOff), recv[recvOff[q]:], x2.size, zero, x2.size)
			recvOff[q] += prod(x2.size)
		}
	}
	return out, nil
}

// prefix returns the exclusive prefix sums of v.
func prefix(v []int) []int {
	out := make([]int, len(v))
	n := 0
	for i, x := range v {
		out[i] = n
		n += x
	}
	return out
}

// checkMeshes verifies that m is a mesh with layout l on the given world.
func checkMesh(op string, m *mesh.Mesh, l *layout, what string) error {
	if m == nil {
		return invalidf(op, "nil %s mesh", what)
	}
	if !slices.Equal(m.Names(), l.names) || !slices.Equal(m.Shape(), l.mshape) || !slices.Equal(m.WorldRanks(), l.ranks) {
		return invalidf(op, "the %s mesh %v is not the plan's %s mesh (%s)", what, m, what, l.meshKey())
	}
	return nil
}
