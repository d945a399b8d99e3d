package placement

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/mesh"
)

// Spec describes one global tensor laid out over a mesh: the mesh, the
// global shape, the element type, one placement per mesh axis and, for
// every tensor dim sharded by several axes, the order of those axes (outer
// to inner). A Spec is immutable and belongs to the rank whose mesh it
// holds.
type Spec struct {
	m *mesh.Mesh
	l *layout
}

// layout is the rank-independent part of a Spec: everything planning needs.
// It is immutable once built.
type layout struct {
	names  []string
	mshape []int
	ranks  []int // world rank at every mesh position
	shape  []int
	dtype  comm.DType
	places []Placement
	order  [][]int // per tensor dim: the mesh axes sharding it, outer to inner
	rows   []int   // Routed row counts per routed group (WithRoutedRows), or nil
	key    string
}

// SpecOption configures NewSpec.
type SpecOption func(*specConfig)

type specConfig struct {
	orders map[int][]string
	rows   []int
	err    error
}

// WithOrder sets the order, outer to inner, of the mesh axes that shard
// tensor dim: the first axis splits the whole dim, the next splits each of
// those pieces, and so on. The axes must be exactly the axes whose placement
// is Shard(dim). Without it the order is mesh-axis order. FSDP over TP on a
// ("dp","tp") mesh with both axes on Shard(0) is WithOrder(0, "tp", "dp"):
// TP shards first and FSDP shards each TP shard (PyTorch's _StridedShard).
func WithOrder(dim int, axes ...string) SpecOption {
	return func(c *specConfig) {
		if c.orders == nil {
			c.orders = map[int][]string{}
		}
		if _, dup := c.orders[dim]; dup && c.err == nil {
			c.err = fmt.Errorf("WithOrder given twice for dim %d", dim)
		}
		c.orders[dim] = slices.Clone(axes)
	}
}

// WithRoutedRows gives a spec with Routed placements its row counts, which
// the routing decides at run time (the moe package's dispatch computes
// them). The Routed axes split tensor dim 0 into one contiguous run of rows
// per routed group: rows[g] is the number of rows held by the ranks whose
// coordinate on the Routed axes, taken row-major over those axes in mesh
// order, is g (ranks that differ only on other axes hold the same rows,
// or their Partial or Shard pieces). So len(rows) is the product of the
// Routed axes' sizes, every count is at least 0, and the counts sum to the
// global dim 0 (0 when no rows are anywhere). Dim 0 must not also
// be sharded. With row counts, LocalShape, Box, NewLocal and Inner work on
// Routed specs; redistribution to or from Routed stays unsupported (the moe
// package's dispatch and combine move those tensors). Without this option a
// Routed spec only names the layout: it has no local shape.
func WithRoutedRows(rows []int) SpecOption {
	return func(c *specConfig) {
		if c.rows != nil && c.err == nil {
			c.err = fmt.Errorf("WithRoutedRows given twice")
		}
		c.rows = slices.Clone(rows)
		if c.rows == nil {
			c.rows = []int{}
		}
	}
}

// NewSpec builds a spec for a tensor of the given global shape and dtype
// (Float32 or Float64) on m, with one placement per mesh axis. Global dims
// may be 0: such a tensor holds no elements, every rank's block is empty,
// and it redistributes like any other (the collectives move nothing).
// The element count and the size in bytes must fit in an int, counting
// only the non-zero dims when a dim is 0; a shape past that is an error
// naming it, so no count derived from a spec ever wraps. Errors wrap
// ErrInvalid.
func NewSpec(m *mesh.Mesh, shape []int, dtype comm.DType, placements []Placement, opts ...SpecOption) (*Spec, error) {
	const op = "NewSpec"
	if m == nil {
		return nil, invalidf(op, "nil mesh")
	}
	var cfg specConfig
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.err != nil {
		return nil, invalidf(op, "%v", cfg.err)
	}
	l := &layout{
		names:  m.Names(),
		mshape: m.Shape(),
		ranks:  m.WorldRanks(),
		shape:  slices.Clone(shape),
		dtype:  dtype,
		places: slices.Clone(placements),
		rows:   cfg.rows,
	}
	orders := make(map[int][]int, len(cfg.orders))
	for d, names := range cfg.orders {
		axes := make([]int, len(names))
		for i, n := range names {
			a := slices.Index(l.names, n)
			if a < 0 {
				return nil, invalidf(op, "WithOrder(%d): unknown mesh axis %q (mesh axes: %s)", d, n, strings.Join(l.names, ", "))
			}
			axes[i] = a
		}
		orders[d] = axes
	}
	if err := l.init(orders); err != nil {
		return nil, invalidf(op, "%v", err)
	}
	return &Spec{m: m, l: l}, nil
}

// init validates the layout, fills in the shard order and computes the key.
// orders holds explicit orders by tensor dim (mesh axis indices).
func (l *layout) init(orders map[int][]int) error {
	if l.dtype != comm.Float32 && l.dtype != comm.Float64 {
		return fmt.Errorf("dtype %v: want float32 or float64", l.dtype)
	}
	if len(l.places) != len(l.mshape) {
		return fmt.Errorf("%d placements %v for a mesh with %d axes %v", len(l.places), l.places, len(l.mshape), l.names)
	}
	for i, n := range l.shape {
		if n < 0 {
			return fmt.Errorf("global shape %v: dim %d is %d; global dims must be at least 0", l.shape, i, n)
		}
	}
	if err := checkSize(l.shape, l.dtype); err != nil {
		return err
	}
	var partialOps []comm.ReduceOp
	for a, p := range l.places {
		if err := p.validate(len(l.shape)); err != nil {
			return fmt.Errorf("placement %d (mesh axis %q): %v", a, l.names[a], err)
		}
		if p.IsPartial() && !slices.Contains(partialOps, p.op) {
			partialOps = append(partialOps, p.op)
		}
	}
	if len(partialOps) > 1 {
		for _, op := range partialOps {
			if !linear(op) {
				return fmt.Errorf("placements %v mix Partial(%v) with other reduce ops; the order of reduction would change the value", l.places, op)
			}
		}
	}
	l.order = make([][]int, len(l.shape))
	for d := range l.shape {
		var def []int
		for a, p := range l.places {
			if p.IsShard() && p.dim == d {
				def = append(def, a)
			}
		}
		if o, ok := orders[d]; ok {
			if d < 0 || d >= len(l.shape) {
				return fmt.Errorf("WithOrder(%d): dim out of range for a %d-d tensor", d, len(l.shape))
			}
			s := slices.Clone(o)
			slices.Sort(s)
			if !slices.Equal(s, def) {
				return fmt.Errorf("WithOrder(%d) names axes %v, but the axes on Shard(%d) are %v", d, l.axisNames(o), d, l.axisNames(def))
			}
			def = slices.Clone(o)
		}
		l.order[d] = def
	}
	for d := range orders {
		if d < 0 || d >= len(l.shape) {
			return fmt.Errorf("WithOrder(%d): dim out of range for a %d-d tensor", d, len(l.shape))
		}
	}
	if err := l.checkRows(); err != nil {
		return err
	}
	if err := l.checkBalanced(); err != nil {
		return err
	}
	l.key = l.computeKey()
	return nil
}

// routedAxes returns the mesh axes whose placement is Routed, in mesh order.
func (l *layout) routedAxes() []int {
	var axes []int
	for a, p := range l.places {
		if p.IsRouted() {
			axes = append(axes, a)
		}
	}
	return axes
}

// checkRows validates the Routed row counts against the placements.
func (l *layout) checkRows() error {
	if l.rows == nil {
		return nil
	}
	axes := l.routedAxes()
	if len(axes) == 0 {
		return fmt.Errorf("WithRoutedRows given, but no placement in %v is Routed", l.places)
	}
	if len(l.shape) == 0 {
		return fmt.Errorf("WithRoutedRows needs a tensor of at least one dim (Routed splits dim 0)")
	}
	if len(l.order[0]) > 0 {
		return fmt.Errorf("placements %v shard dim 0, which the Routed axes split", l.places)
	}
	groups := 1
	for _, a := range axes {
		groups *= l.mshape[a] // at most the mesh size
	}
	if len(l.rows) != groups {
		return fmt.Errorf("WithRoutedRows has %d counts; the Routed axes %v have %d groups", len(l.rows), l.axisNames(axes), groups)
	}
	for g, n := range l.rows {
		if n < 0 {
			return fmt.Errorf("WithRoutedRows: routed group %d has %d rows", g, n)
		}
	}
	total, ok := checked.Sum(l.rows)
	if !ok {
		return fmt.Errorf("WithRoutedRows: the counts %v sum past the largest int", l.rows)
	}
	if total != l.shape[0] {
		return fmt.Errorf("WithRoutedRows counts sum to %d rows, but the global dim 0 is %d", total, l.shape[0])
	}
	return nil
}

// routedGroup returns the index of coord's routed group: its coordinate on
// the Routed axes, row-major in mesh order.
func (l *layout) routedGroup(coord []int) int {
	g := 0
	for a, p := range l.places {
		if p.IsRouted() {
			g = g*l.mshape[a] + coord[a]
		}
	}
	return g
}

// box returns the offset and size of the block held at coord: the nested
// chunk rule, with dim 0 given by the Routed row counts when there are any.
func (l *layout) box(coord []int) (off, size []int) {
	off, size = boxOf(l.shape, l.mshape, l.order, coord)
	if l.rows != nil {
		g := l.routedGroup(coord)
		o := 0
		for _, n := range l.rows[:g] {
			o += n // checkRows: a prefix of counts that sum to dim 0
		}
		off[0], size[0] = o, l.rows[g]
	}
	return off, size
}

// checkSize reports an error naming the shape when its element count or
// its size in bytes does not fit in an int (the strict rule of
// checked.Product: zero dims do not excuse the others). Every block,
// stride, offset and byte count of a layout is then a sub-product of one
// that fits, so the layout math below needs no checks of its own.
func checkSize(shape []int, dt comm.DType) error {
	if _, ok := checked.Product(append(slices.Clone(shape), dt.Size())); !ok {
		return fmt.Errorf("global shape %v of %v: its element count or size in bytes (%d bytes an element) overflows int", shape, dt, dt.Size())
	}
	return nil
}
func (l *layout) axisNames(axes []int) []string {
	out := make([]string, len(axes))
	for i, a := range axes {
		out[i] = l.names[a]
	}
	return out
}

// meshKey identifies the mesh layout (names, shape, world ranks).
func (l *layout) meshKey() string { return string(l.appendMeshKey(nil)) }

// appendMeshKey appends the mesh's names, sizes and ranks ("dp=2,tp=2@0..3").
func (l *layout) appendMeshKey(b []byte) []byte {
	for i, n := range l.names {
		if i > 0 {
			b = append(b, ',')
		}
		b = append(b, n...)
		b = append(b, '=')
		b = strconv.AppendInt(b, int64(l.mshape[i]), 10)
	}
	b = append(b, '@')
	if isIota(l.ranks) {
		b = append(b, "0.."...)
		return strconv.AppendInt(b, int64(len(l.ranks)-1), 10)
	}
	return appendInts(b, l.ranks)
}

// computeKey encodes everything that tells layouts apart (Equal compares
// keys; plans are cached by them). It is built without fmt: specs are made
// for every op's result, so this is on the hot path.
func (l *layout) computeKey() string {
	b := make([]byte, 0, 96)
	b = l.appendMeshKey(b)
	b = append(b, '|')
	b = appendInts(b, l.shape)
	b = append(b, '|')
	b = strconv.AppendUint(b, uint64(l.dtype), 10)
	for _, p := range l.places {
		b = append(b, '|')
		b = strconv.AppendUint(b, uint64(p.kind), 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(p.dim), 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(p.op), 10)
		if p.bal {
			b = append(b, 'b')
		}
	}
	for _, o := range l.order {
		b = append(b, '[')
		b = appendInts(b, o)
		b = append(b, ']')
	}
	if l.rows != nil {
		b = append(b, "|rows"...)
		b = appendInts(b, l.rows)
	}
	return string(b)
}

// appendInts appends v comma-separated.
func appendInts(b []byte, v []int) []byte {
	for i, x := range v {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, int64(x), 10)
	}
	return b
}

func isIota(r []int) bool {
	for i, v := range r {
		if v != i {
			return false
		}
	}
	return true
}

// sameMesh reports whether two layouts are on the same mesh layout.
func (l *layout) sameMesh(o *layout) bool {
	return slices.Equal(l.names, o.names) && slices.Equal(l.mshape, o.mshape) && slices.Equal(l.ranks, o.ranks)
}

// withPlacements returns a copy with other placements and default order.
// Routed row counts are kept when the Routed axes stay the same.
func (l *layout) withPlacements(places []Placement, orders map[int][]int) (*layout, error) {
	n := &layout{names: l.names, mshape: l.mshape, ranks: l.ranks, shape: l.shape, dtype: l.dtype, places: slices.Clone(places)}
	if l.rows != nil && slices.Equal(n.routedAxes(), l.routedAxes()) {
		n.rows = l.rows
	}
	if err := n.init(orders); err != nil {
		return nil, err
	}
	return n, nil
}

// hasRouted reports whether any placement is Routed.
func (l *layout) hasRouted() bool {
	return slices.ContainsFunc(l.places, Placement.IsRouted)
}

// String describes the layout: "[6 4] float32 on (dp=2, tp=4): [S(0) S(0)] order 0:[tp dp]".
func (l *layout) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v %v on (", l.shape, l.dtype)
	for i, n := range l.names {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s=%d", n, l.mshape[i])
	}
	fmt.Fprintf(&b, "): %v", l.places)
	if s := l.orderString(); s != "" {
		b.WriteString(" order " + s)
	}
	if l.rows != nil {
		fmt.Fprintf(&b, " rows %v", l.rows)
	}
	return b.String()
}

// orderString lists non-default shard orders ("0:[tp dp]"), or "".
func (l *layout) orderString() string {
	var parts []string
	for d, o := range l.order {
		if len(o) > 1 && !slices.IsSorted(o) {
			parts = append(parts, fmt.Sprintf("%d:%v", d, l.axisNames(o)))
		}
	}
	return strings.Join(parts, " ")
}

// Mesh returns the mesh the tensor lives on.
func (s *Spec) Mesh() *mesh.Mesh { return s.m }

// Shape returns the global shape.
func (s *Spec) Shape() []int { return slices.Clone(s.l.shape) }

// DType returns the element type.
func (s *Spec) DType() comm.DType { return s.l.dtype }

// Placements returns one placement per mesh axis.
func (s *Spec) Placements() []Placement { return slices.Clone(s.l.places) }

// RoutedRows returns the row counts of a Routed spec (WithRoutedRows), one
// per routed group, or nil when the spec has none.
func (s *Spec) RoutedRows() []int { return slices.Clone(s.l.rows) }

// Order returns the mesh axes (by name) that shard tensor dim, outer to
// inner; it is empty for an unsharded dim.
func (s *Spec) Order(dim int) []string {
	if dim < 0 || dim >= len(s.l.order) {
		return nil
	}
	return s.l.axisNames(s.l.order[dim])
}

// String describes the spec, e.g.
// "[6 4] float32 on (dp=2, tp=4): [S(0) S(0)] order 0:[tp dp]".
func (s *Spec) String() string { return s.l.String() }

// Equal reports whether two specs describe the same layout on the same mesh
// layout (axis names, sizes and world ranks).
func (s *Spec) Equal(o *Spec) bool {
	return s != nil && o != nil && s.l.key == o.l.key
}

// With returns a spec on the same mesh with the same shape and dtype and new
// placements (and shard orders given by opts).
func (s *Spec) With(placements []Placement, opts ...SpecOption) (*Spec, error) {
	return NewSpec(s.m, s.l.shape, s.l.dtype, placements, opts...)
}

// OnMesh returns a spec with the same shape and dtype on another mesh with
// the given placements (for redistribution between meshes).
func (s *Spec) OnMesh(m *mesh.Mesh, placements []Placement, opts ...SpecOption) (*Spec, error) {
	return NewSpec(m, s.l.shape, s.l.dtype, placements, opts...)
}

// Box returns the offset and size in every tensor dim of the block that the
// mesh rank meshRank (a position in the mesh view, not a world rank) holds.
// Partial axes do not affect it; sizes may be 0 (empty shard). A Routed
// spec has a box only with row counts (WithRoutedRows): its dim 0 is the
// routed group's run of rows. A ShardBalanced dim is two runs, not a box:
// Box refuses it (ErrUnsupported); Positions lists its indices.
func (s *Spec) Box(meshRank int) (offset, size []int, err error) {
	if s.l.hasRouted() && s.l.rows == nil {
		return nil, nil, unsupportedf("Box", "a Routed spec without row counts has no layout (the moe package assigns rows: WithRoutedRows)")
	}
	if s.l.hasPerm() {
		return nil, nil, unsupportedf("Box", "%v is load-balanced (ShardBalanced): a rank's block is two runs of the dim, not a box; use Positions", s.l.places)
	}
	coord, err := s.m.CoordOf(meshRank)
	if err != nil {
		return nil, nil, invalidf("Box", "%v", err)
	}
	off, sz := s.l.box(coord)
	return off, sz, nil
}

// LocalShape returns the shape of this rank's local block. For a Routed
// spec without row counts it is the global shape (such a spec only names a
// layout; nothing can be built on it).
func (s *Spec) LocalShape() []int {
	_, sz := s.l.box(s.m.Coord())
	return sz
}

// chunk returns the offset and size of piece c of n split over k with the
// torch.chunk rule: chunk = ceil(n/k); trailing pieces may be short or empty
// (an empty piece has offset n).
func chunk(n, k, c int) (off, size int) {
	if k <= 1 {
		return 0, n
	}
	ch := n / k // ceil(n/k) without forming n+k-1
	if n%k != 0 {
		ch++
	}
	off = min(c*ch, n)
	size = min(ch, n-off)
	return off, size
}

// boxOf applies the nested chunk rule: for every tensor dim, each mesh axis
// in order (outer to inner) splits the piece the previous axes left.
func boxOf(shape, mshape []int, order [][]int, coord []int) (off, size []int) {
	off = make([]int, len(shape))
	size = make([]int, len(shape))
	for d, n := range shape {
		o := 0
		for _, a := range order[d] {
			co, cs := chunk(n, mshape[a], coord[a])
			o += co
			n = cs
		}
		off[d], size[d] = o, n
	}
	return off, size
}

// prod is the product of dims (1 for none): the dims of a block or a
// sub-shape of a layout, whose product checkSize has bounded.
func prod(dims []int) int {
	n := 1
	for _, d := range dims {
		n *= d
	}
	return n
}

// unravel returns the coordinate of row-major position p over shape.
func unravel(p int, shape []int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		c[i] = p % shape[i]
		p /= shape[i]
	}
	return c
}
