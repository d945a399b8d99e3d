package cp

import (
	"context"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// layout is what the methods need to know of the inputs' layout: the
// local block sizes, the cp group(s) and the global sequence position of
// every local row of every member.
type layout struct {
	method Method
	dtype  comm.DType
	spec   *placement.Spec
	m      *mesh.Mesh
	tdim   int // the sequence dim (rank−2)

	lead, heads, dh, dv int // local [lead…, heads, rows, dh|dv]
	batch               int // lead·heads

	axis, inner string
	n, me       int // the cp axis: size, this rank's coordinate
	nInner, mi  int // the Ulysses axis of Hybrid (1, 0 otherwise)

	c, ci comm.Communicator // the cp axis's and the inner axis's groups
	// pos[i][j]: the global positions of the rows held by the member at
	// coordinate i on the cp axis and j on the inner axis (j = 0 without
	// one), with this rank's coordinates on the other axes.
	pos [][][]int
}

// newLayout validates q, k and v for the method and fills in the sizes and
// positions (no communication).
func newLayout(op string, q, k, v *autograd.Value, axis string, cfg config) (*layout, error) {
	for i, x := range []*autograd.Value{q, k, v} {
		if x == nil || x.Data() == nil {
			return nil, invalidf(op, "input %d (q, k, v) is nil", i)
		}
	}
	sq, sk, sv := q.Spec(), k.Spec(), v.Spec()
	shq, shv := sq.Shape(), sv.Shape()
	r := len(shq)
	if r < 3 {
		return nil, invalidf(op, "q has shape %v; want [..., heads, T, Dh]", shq)
	}
	if !slices.Equal(shq, sk.Shape()) || len(shv) != r || !slices.Equal(shq[:r-1], shv[:r-1]) {
		return nil, invalidf(op, "shapes q %v, k %v, v %v: q and k must be equal and v like them but for its last dim", shq, sk.Shape(), shv)
	}
	if sq.DType() != sk.DType() || sq.DType() != sv.DType() {
		return nil, invalidf(op, "dtypes q %v, k %v, v %v differ", sq.DType(), sk.DType(), sv.DType())
	}
	if sq.Mesh() != sk.Mesh() || sq.Mesh() != sv.Mesh() {
		if !sameMesh(sq.Mesh(), sk.Mesh()) || !sameMesh(sq.Mesh(), sv.Mesh()) {
			return nil, invalidf(op, "q, k and v are on different meshes (%v, %v, %v)", sq.Mesh(), sk.Mesh(), sv.Mesh())
		}
	}
	if !samePlacements(sq, sk) || !samePlacements(sq, sv) {
		return nil, invalidf(op, "q %v, k %v and v %v must be laid out alike", sq, sk, sv)
	}
	m := sq.Mesh()
	l := &layout{method: cfg.method, dtype: sq.DType(), spec: sq, m: m, tdim: r - 2, axis: axis, inner: cfg.inner, nInner: 1}
	names := m.Names()
	ai := slices.Index(names, axis)
	if ai < 0 {
		return nil, invalidf(op, "no mesh axis %q (mesh axes %v)", axis, names)
	}
	want := []string{axis}
	if cfg.inner != "" {
		if cfg.method != Hybrid && cfg.method != Auto {
			return nil, invalidf(op, "WithUlyssesAxis(%q) is for Hybrid; the method is %v", cfg.inner, cfg.method)
		}
		l.method = Hybrid
		ii := slices.Index(names, cfg.inner)
		if ii < 0 || ii == ai {
			return nil, invalidf(op, "the Ulysses axis %q is not a mesh axis other than %q (mesh axes %v)", cfg.inner, axis, names)
		}
		want = append(want, cfg.inner)
	} else if cfg.method == Hybrid {
		return nil, invalidf(op, "Hybrid needs the inner axis: WithUlyssesAxis")
	}
	for a, p := range sq.Placements() {
		if p.IsPartial() || p.IsRouted() {
			return nil, invalidf(op, "q is %v on mesh axis %q; attention needs Shard or Replicate inputs", p, names[a])
		}
	}
	if got := sq.Order(l.tdim); !slices.Equal(got, want) {
		return nil, invalidf(op, "the sequence dim %d must be sharded over exactly the mesh axes %v (outer first); it is over %v", l.tdim, want, got)
	}
	if o := sq.Order(r - 1); len(o) > 0 {
		return nil, invalidf(op, "the head dim %d is sharded over %v; Dh must be whole on every rank", r-1, o)
	}
	if o := sv.Order(r - 1); len(o) > 0 {
		return nil, invalidf(op, "v's last dim is sharded over %v; Dv must be whole on every rank", o)
	}
	lq, lv := sq.LocalShape(), sv.LocalShape()
	l.lead = 1
	for _, d := range lq[:r-3] {
		l.lead *= d
	}
	l.heads, l.dh, l.dv = lq[r-3], lq[r-1], lv[r-1]
	l.batch = l.lead * l.heads
	l.n, _ = m.AxisSize(axis)
	l.me, _ = m.Local(axis)
	if cfg.inner != "" {
		l.nInner, _ = m.AxisSize(cfg.inner)
		l.mi, _ = m.Local(cfg.inner)
	}
	// Positions of every cp member's rows.
	coord := m.Coord()
	ii := slices.Index(names, cfg.inner)
	l.pos = make([][][]int, l.n)
	for i := range l.n {
		l.pos[i] = make([][]int, l.nInner)
		for j := range l.nInner {
			c := slices.Clone(coord)
			c[ai] = i
			if ii >= 0 {
				c[ii] = j
			}
			mr, err := m.RankOf(c)
			if err != nil {
				return nil, invalidf(op, "%v", err)
			}
			p, err := sq.Positions(l.tdim, mr)
			if err != nil {
				return nil, invalidf(op, "%v", err)
			}
			l.pos[i][j] = p
		}
	}
	return l, nil
}

// sameMesh reports whether two meshes have the same axes and ranks.
func sameMesh(a, b *mesh.Mesh) bool {
	return a.World() == b.World() && slices.Equal(a.Names(), b.Names()) && slices.Equal(a.Shape(), b.Shape()) && slices.Equal(a.WorldRanks(), b.WorldRanks())
}

// groups gets the communicators of the cp axis (and the inner axis).
func (l *layout) groups(ctx context.Context) error {
	var err error
	if l.c, err = l.m.Comm(ctx, l.axis); err != nil {
		return err
	}
	if l.inner != "" {
		if l.ci, err = l.m.Comm(ctx, l.inner); err != nil {
			return err
		}
	}
	return nil
}

// outSpec is the result's spec: q's, with v's last dim.
func (l *layout) outSpec(sq *placement.Spec) (*placement.Spec, error) {
	sh := sq.Shape()
	if sh[len(sh)-1] == l.dv {
		return sq, nil
	}
	sh[len(sh)-1] = l.dv
	var opts []placement.SpecOption
	for d := range sh {
		if o := sq.Order(d); len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	return placement.NewSpec(sq.Mesh(), sh, sq.DType(), sq.Placements(), opts...)
}

// rows returns the positions of the rows of cp member i (its whole
// block: the inner members' rows concatenated for Hybrid).
func (l *layout) rows(i int) []int {
	var out []int
	for _, p := range l.pos[i] {
		out = append(out, p...)
	}
	return out
}
