package mesh_test

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/mesh"
)

// layouts are the meshes every table test runs on; world size is the
// product of the shape.
var layouts = []struct {
	shape []int
	names []string
}{
	{[]int{8}, []string{"dp"}},
	{[]int{2, 4}, []string{"dp", "tp"}},
	{[]int{4, 2}, []string{"dp", "tp"}},
	{[]int{2, 2, 2}, []string{"pp", "dp", "tp"}},
	{[]int{3}, []string{"tp"}},
	{[]int{1, 5}, []string{"pp", "dp"}},
	{[]int{2, 3}, []string{"dp", "cp"}},
	{[]int{1}, []string{"dp"}},
	{[]int{3, 1, 2}, []string{"pp", "cp", "tp"}},
}

func prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// unravel is the reference row-major coordinate of r.
func unravel(shape []int, r int) []int {
	c := make([]int, len(shape))
	for i := len(shape) - 1; i >= 0; i-- {
		c[i] = r % shape[i]
		r /= shape[i]
	}
	return c
}

// refGroup is the brute-force reference for world rank me's group over the
// selected axes of a root mesh: every world rank that agrees with me off sel,
// sorted lexicographically by its coordinates on sel in the order given.
func refGroup(shape []int, names []string, me int, sel []string) []int {
	idx := make([]int, len(sel))
	for k, n := range sel {
		idx[k] = slices.Index(names, n)
	}
	mine := unravel(shape, me)
	var out []int
	for w := range prod(shape) {
		c := unravel(shape, w)
		ok := true
		for i := range c {
			if !slices.Contains(idx, i) && c[i] != mine[i] {
				ok = false
			}
		}
		if ok {
			out = append(out, w)
		}
	}
	key := func(w int) []int {
		c := unravel(shape, w)
		k := make([]int, len(idx))
		for j, i := range idx {
			k[j] = c[i]
		}
		return k
	}
	slices.SortFunc(out, func(a, b int) int { return slices.Compare(key(a), key(b)) })
	return out
}

// selections returns every ordered selection of distinct names, of every
// length from 1 to len(names).
func selections(names []string) [][]string {
	var out [][]string
	var rec func(cur []string)
	rec = func(cur []string) {
		if len(cur) > 0 {
			out = append(out, slices.Clone(cur))
		}
		for _, n := range names {
			if !slices.Contains(cur, n) {
				rec(append(cur, n))
			}
		}
	}
	rec(nil)
	return out
}

// errNoCollectives aborts the handles that layout tests use: they need no
// collectives, and any Split or collective fails at once with it.
var errNoCollectives = errors.New("layout test issued a collective")

// handle returns rank's handle on a fresh in-process world of size ranks,
// already aborted with errNoCollectives.
func handle(t *testing.T, rank, size int) comm.Communicator {
	t.Helper()
	wd, err := local.NewWorld(size)
	if err != nil {
		t.Fatal(err)
	}
	c := wd.Comm(rank)
	c.Abort(errNoCollectives)
	return c
}

func mustNew(t *testing.T, world comm.Communicator, shape []int, names []string) *mesh.Mesh {
	t.Helper()
	m, err := mesh.New(world, shape, names)
	if err != nil {
		t.Fatalf("New(%v, %q): %v", shape, names, err)
	}
	return m
}

func TestLayout(t *testing.T) {
	for _, l := range layouts {
		t.Run(fmt.Sprint(l.shape), func(t *testing.T) {
			p := prod(l.shape)
			for r := range p {
				m := mustNew(t, handle(t, r, p), l.shape, l.names)
				if m.Rank() != r || m.WorldRank() != r || m.Size() != p || m.NDim() != len(l.shape) {
					t.Errorf("rank %d: Rank %d WorldRank %d Size %d NDim %d", r, m.Rank(), m.WorldRank(), m.Size(), m.NDim())
				}
				if got, want := m.Coord(), unravel(l.shape, r); !slices.Equal(got, want) {
					t.Errorf("rank %d: Coord = %v, want %v", r, got, want)
				}
				if !slices.Equal(m.Names(), l.names) || !slices.Equal(m.Shape(), l.shape) {
					t.Errorf("rank %d: Names %q Shape %v", r, m.Names(), m.Shape())
				}
				for i, n := range l.names {
					if got, err := m.AxisSize(n); err != nil || got != l.shape[i] {
						t.Errorf("rank %d: AxisSize(%q) = %d, %v", r, n, got, err)
					}
					if got, err := m.Local(n); err != nil || got != unravel(l.shape, r)[i] {
						t.Errorf("rank %d: Local(%q) = %d, %v", r, n, got, err)
					}
				}
				wr := m.WorldRanks()
				for q := range p {
					if wr[q] != q {
						t.Errorf("rank %d: WorldRanks = %v", r, wr)
						break
					}
					c, err := m.CoordOf(q)
					if err != nil || !slices.Equal(c, unravel(l.shape, q)) {
						t.Errorf("CoordOf(%d) = %v, %v", q, c, err)
					}
					if back, err := m.RankOf(c); err != nil || back != q {
						t.Errorf("RankOf(%v) = %d, %v; want %d", c, back, err, q)
					}
				}
			}
		})
	}
}

func TestAccessorsReturnCopies(t *testing.T) {
	m := mustNew(t, handle(t, 5, 8), []int{2, 4}, []string{"dp", "tp"})
	m.Names()[0] = "x"
	m.Shape()[0] = 7
	m.Coord()[0] = 9
	m.WorldRanks()[0] = 42
	if !slices.Equal(m.Names(), []string{"dp", "tp"}) || !slices.Equal(m.Shape(), []int{2, 4}) ||
		!slices.Equal(m.Coord(), []int{1, 1}) || m.WorldRanks()[0] != 0 {
		t.Errorf("mesh changed through a returned slice: %v", m)
	}
	shape, names := []int{2, 4}, []string{"dp", "tp"}
	m = mustNew(t, handle(t, 5, 8), shape, names)
	shape[0], names[0] = 8, "x"
	if m.String() != "Mesh(dp=2, tp=4) rank 5 (world 5) at [1 1]" {
		t.Errorf("mesh changed through New's arguments: %v", m)
	}
}

func TestString(t *testing.T) {
	m := mustNew(t, handle(t, 5, 8), []int{2, 4}, []string{"dp", "tp"})
	if got, want := m.String(), "Mesh(dp=2, tp=4) rank 5 (world 5) at [1 1]"; got != want {
		t.Errorf("String = %q, want %q", got, want)
	}
	s, err := m.Sub("dp")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := s.String(), "Mesh(dp=2) rank 1 (world 5) at [1]"; got != want {
		t.Errorf("Sub String = %q, want %q", got, want)
	}
}

func TestSub(t *testing.T) {
	for _, l := range layouts {
		t.Run(fmt.Sprint(l.shape), func(t *testing.T) {
			p := prod(l.shape)
			for r := range p {
				m := mustNew(t, handle(t, r, p), l.shape, l.names)
				for _, sel := range selections(l.names) {
					s, err := m.Sub(sel...)
					if err != nil {
						t.Fatalf("rank %d: Sub(%q): %v", r, sel, err)
					}
					checkView(t, fmt.Sprintf("rank %d: Sub(%q)", r, sel), s, l.shape, l.names, r, sel)
					// A sub-mesh of a sub-mesh is the sub-mesh of the root.
					for _, sel2 := range selections(sel) {
						s2, err := s.Sub(sel2...)
						if err != nil {
							t.Fatalf("rank %d: Sub(%q).Sub(%q): %v", r, sel, sel2, err)
						}
						checkView(t, fmt.Sprintf("rank %d: Sub(%q).Sub(%q)", r, sel, sel2), s2, l.shape, l.names, r, sel2)
					}
				}
			}
		})
	}
}

// checkView checks that v is world rank r's view over the root axes sel.
func checkView(t *testing.T, what string, v *mesh.Mesh, shape []int, names []string, r int, sel []string) {
	t.Helper()
	want := refGroup(shape, names, r, sel)
	if got := v.WorldRanks(); !slices.Equal(got, want) {
		t.Errorf("%s: WorldRanks = %v, want %v", what, got, want)
	}
	if !slices.Equal(v.Names(), sel) {
		t.Errorf("%s: Names = %q", what, v.Names())
	}
	wantShape := make([]int, len(sel))
	wantCoord := make([]int, len(sel))
	mine := unravel(shape, r)
	for k, n := range sel {
		i := slices.Index(names, n)
		wantShape[k], wantCoord[k] = shape[i], mine[i]
	}
	if !slices.Equal(v.Shape(), wantShape) || !slices.Equal(v.Coord(), wantCoord) {
		t.Errorf("%s: Shape %v Coord %v, want %v %v", what, v.Shape(), v.Coord(), wantShape, wantCoord)
	}
	if v.WorldRank() != r || v.WorldRanks()[v.Rank()] != r || v.Size() != len(want) {
		t.Errorf("%s: WorldRank %d Rank %d Size %d", what, v.WorldRank(), v.Rank(), v.Size())
	}
	if q, err := v.RankOf(v.Coord()); err != nil || q != v.Rank() {
		t.Errorf("%s: RankOf(Coord) = %d, %v; Rank %d", what, q, err, v.Rank())
	}
}

func TestFlatten(t *testing.T) {
	for _, l := range layouts {
		t.Run(fmt.Sprint(l.shape), func(t *testing.T) {
			p := prod(l.shape)
			n := len(l.names)
			for r := range p {
				m := mustNew(t, handle(t, r, p), l.shape, l.names)
				for lo := range n {
					for hi := lo + 1; hi <= n; hi++ {
						fl := l.names[lo:hi]
						for _, newName := range []string{"", "merged"} {
							f, err := m.Flatten(fl, newName)
							if err != nil {
								t.Fatalf("rank %d: Flatten(%q, %q): %v", r, fl, newName, err)
							}
							name := newName
							if name == "" {
								name = strings.Join(fl, "_")
							}
							wantNames := slices.Concat(l.names[:lo], []string{name}, l.names[hi:])
							wantShape := slices.Concat(l.shape[:lo], []int{prod(l.shape[lo:hi])}, l.shape[hi:])
							if !slices.Equal(f.Names(), wantNames) || !slices.Equal(f.Shape(), wantShape) {
								t.Errorf("rank %d: Flatten(%q, %q): Names %q Shape %v, want %q %v",
									r, fl, newName, f.Names(), f.Shape(), wantNames, wantShape)
							}
							if !slices.Equal(f.WorldRanks(), m.WorldRanks()) || f.Rank() != r || f.WorldRank() != r {
								t.Errorf("rank %d: Flatten(%q): WorldRanks %v Rank %d", r, fl, f.WorldRanks(), f.Rank())
							}
							// The flattened axis groups what the original axes did.
							s, err := f.Sub(name)
							if err != nil {
								t.Fatalf("rank %d: Flatten(%q).Sub(%q): %v", r, fl, name, err)
							}
							if want := refGroup(l.shape, l.names, r, fl); !slices.Equal(s.WorldRanks(), want) {
								t.Errorf("rank %d: Flatten(%q).Sub(%q) = %v, want %v", r, fl, name, s.WorldRanks(), want)
							}
							loc, err := f.Local(name)
							if err != nil || loc != s.Rank() {
								t.Errorf("rank %d: Flatten(%q).Local(%q) = %d, %v; want %d", r, fl, name, loc, err, s.Rank())
							}
						}
					}
				}
			}
		})
	}
}

func TestFlattenOfSub(t *testing.T) {
	// Flatten the transposed sub-mesh ("tp","dp") of a 2x2x2 mesh: the
	// flattened axis lists the ranks tp-major.
	m := mustNew(t, handle(t, 5, 8), []int{2, 2, 2}, []string{"pp", "dp", "tp"})
	s, err := m.Sub("tp", "dp")
	if err != nil {
		t.Fatal(err)
	}
	f, err := s.Flatten([]string{"tp", "dp"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.WorldRanks(), []int{4, 6, 5, 7}; !slices.Equal(got, want) {
		t.Errorf("WorldRanks = %v, want %v", got, want)
	}
	if !slices.Equal(f.Names(), []string{"tp_dp"}) || f.Rank() != 2 || !slices.Equal(f.Coord(), []int{2}) {
		t.Errorf("got %v", f)
	}
}

func TestErrors(t *testing.T) {
	w8 := handle(t, 5, 8)
	m := mustNew(t, w8, []int{2, 4}, []string{"dp", "tp"})
	m3 := mustNew(t, w8, []int{2, 2, 2}, []string{"pp", "dp", "tp"})
	ctx := context.Background()
	call := func(f func() (*mesh.Mesh, error)) func() error {
		return func() error { _, err := f(); return err }
	}
	tests := []struct {
		name    string
		f       func() error
		unknown bool   // wants ErrUnknownAxis too
		msg     string // the whole message
	}{
		{"nil world", call(func() (*mesh.Mesh, error) { return mesh.New(nil, []int{1}, []string{"a"}) }), false,
			"mesh: New: invalid argument: nil world communicator"},
		{"product", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{2, 3}, []string{"dp", "tp"}) }), false,
			"mesh: New: invalid argument: shape [2 3] covers 6 ranks but the world has 8"},
		{"overflowing product", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{1<<62 + 1, 4}, []string{"dp", "tp"}) }), false,
			"mesh: New: invalid argument: shape [4611686018427387905 4] covers more ranks than the world's 8"},
		{"too large", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{4, 4}, []string{"dp", "tp"}) }), false,
			"mesh: New: invalid argument: shape [4 4] covers more ranks than the world's 8"},
		{"zero size", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{0, 8}, []string{"dp", "tp"}) }), false,
			`mesh: New: invalid argument: axis "dp" has size 0; sizes must be positive`},
		{"negative size", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{-2, -4}, []string{"dp", "tp"}) }), false,
			`mesh: New: invalid argument: axis "dp" has size -2; sizes must be positive`},
		{"duplicate", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{2, 4}, []string{"dp", "dp"}) }), false,
			`mesh: New: invalid argument: axis name "dp" appears twice (axes 0 and 1)`},
		{"empty name", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{2, 4}, []string{"dp", ""}) }), false,
			"mesh: New: invalid argument: axis 1 has an empty name"},
		{"len mismatch", call(func() (*mesh.Mesh, error) { return mesh.New(w8, []int{2, 4}, []string{"dp"}) }), false,
			`mesh: New: invalid argument: 2 sizes [2 4] but 1 names ["dp"]`},
		{"no axes", call(func() (*mesh.Mesh, error) { return mesh.New(handle(t, 0, 1), nil, nil) }), false,
			"mesh: New: invalid argument: a mesh needs at least one axis"},
		{"Sub unknown", call(func() (*mesh.Mesh, error) { return m.Sub("tp", "cp") }), true,
			`mesh: Sub: unknown axis "cp" (mesh axes: dp, tp)`},
		{"Sub none", call(func() (*mesh.Mesh, error) { return m.Sub() }), false,
			"mesh: Sub: invalid argument: no axis names (mesh axes: dp, tp)"},
		{"Sub twice", call(func() (*mesh.Mesh, error) { return m.Sub("tp", "tp") }), false,
			`mesh: Sub: invalid argument: axis "tp" named twice in ["tp" "tp"]`},
		{"Flatten unknown", call(func() (*mesh.Mesh, error) { return m.Flatten([]string{"dp", "ep"}, "") }), true,
			`mesh: Flatten: unknown axis "ep" (mesh axes: dp, tp)`},
		{"Flatten out of order", call(func() (*mesh.Mesh, error) { return m.Flatten([]string{"tp", "dp"}, "") }), false,
			`mesh: Flatten: invalid argument: axes ["tp" "dp"] are not contiguous and in mesh order (mesh axes: dp, tp)`},
		{"Flatten not contiguous", call(func() (*mesh.Mesh, error) { return m3.Flatten([]string{"pp", "tp"}, "") }), false,
			`mesh: Flatten: invalid argument: axes ["pp" "tp"] are not contiguous and in mesh order (mesh axes: pp, dp, tp)`},
		{"Flatten clash", call(func() (*mesh.Mesh, error) { return m3.Flatten([]string{"dp", "tp"}, "pp") }), false,
			`mesh: Flatten: invalid argument: flattened axis name "pp" clashes with axis 0 of the mesh (mesh axes: pp, dp, tp)`},
		{"Flatten none", call(func() (*mesh.Mesh, error) { return m.Flatten(nil, "x") }), false,
			"mesh: Flatten: invalid argument: no axis names (mesh axes: dp, tp)"},
		{"Flatten twice", call(func() (*mesh.Mesh, error) { return m.Flatten([]string{"dp", "dp"}, "") }), false,
			`mesh: Flatten: invalid argument: axis "dp" named twice in ["dp" "dp"]`},
		{"AxisSize", func() error { _, err := m.AxisSize("ep"); return err }, true,
			`mesh: AxisSize: unknown axis "ep" (mesh axes: dp, tp)`},
		{"Local", func() error { _, err := m.Local("ep"); return err }, true,
			`mesh: Local: unknown axis "ep" (mesh axes: dp, tp)`},
		{"CoordOf", func() error { _, err := m.CoordOf(8); return err }, false,
			"mesh: CoordOf: invalid argument: mesh rank 8 out of range [0, 8)"},
		{"CoordOf negative", func() error { _, err := m.CoordOf(-1); return err }, false,
			"mesh: CoordOf: invalid argument: mesh rank -1 out of range [0, 8)"},
		{"RankOf length", func() error { _, err := m.RankOf([]int{1}); return err }, false,
			`mesh: RankOf: invalid argument: coordinate [1] has 1 entries; the mesh has 2 axes [dp tp]`},
		{"RankOf range", func() error { _, err := m.RankOf([]int{1, 4}); return err }, false,
			`mesh: RankOf: invalid argument: coordinate [1 4]: index 4 on axis "tp" out of range [0, 4)`},
		{"Comm unknown", func() error { _, err := m.Comm(ctx, "ep"); return err }, true,
			`mesh: Comm: unknown axis "ep" (mesh axes: dp, tp)`},
		{"Group unknown", func() error { _, err := m.Group(ctx, "dp", "ep"); return err }, true,
			`mesh: Group: unknown axis "ep" (mesh axes: dp, tp)`},
		{"Group twice", func() error { _, err := m.Group(ctx, "dp", "dp"); return err }, false,
			`mesh: Group: invalid argument: axis "dp" named twice in ["dp" "dp"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.f()
			if err == nil {
				t.Fatal("no error")
			}
			if !errors.Is(err, mesh.ErrInvalid) {
				t.Errorf("%v does not match ErrInvalid", err)
			}
			if got := errors.Is(err, mesh.ErrUnknownAxis); got != tt.unknown {
				t.Errorf("errors.Is(%v, ErrUnknownAxis) = %v", err, got)
			}
			if err.Error() != tt.msg {
				t.Errorf("message\n got: %s\nwant: %s", err, tt.msg)
			}
		})
	}
}

// failing wraps a world communicator: it counts the calls Do runs (the
// agreement check's all-gathers) and fails every Split with errSplit.
type failing struct {
	comm.Communicator
	dos atomic.Int64
}

var errSplit = errors.New("split refused")

func (c *failing) Do(ctx context.Context, call comm.Call) error {
	c.dos.Add(1)
	return c.Communicator.Do(ctx, call)
}

func (c *failing) Split(context.Context, int, int) (comm.Communicator, error) {
	return nil, errSplit
}

func TestSplitFailure(t *testing.T) {
	run(t, 8, func(ctx context.Context, world comm.Communicator) error {
		fw := &failing{Communicator: world}
		m, err := mesh.New(fw, []int{2, 4}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		for range 2 { // a failed Split is not cached
			_, err := m.Comm(ctx, "tp")
			if !errors.Is(err, errSplit) {
				return fmt.Errorf("Comm: %v, want the Split error", err)
			}
			var key []string
			for _, w := range refGroup([]int{2, 4}, []string{"dp", "tp"}, world.Rank(), []string{"tp"}) {
				key = append(key, fmt.Sprint(w))
			}
			want := "mesh: creating the communicator of group [" + strings.Join(key, ",") + "]: "
			if !strings.HasPrefix(err.Error(), want) {
				return fmt.Errorf("message %q, want it to start with %q", err, want)
			}
		}
		// The agreement check ran once, before the first Split.
		if n := fw.dos.Load(); n != 1 {
			return fmt.Errorf("%d collectives, want the check's one all-gather", n)
		}
		return nil
	})
	// A check that cannot run (the communicator is aborted) fails, and is
	// tried again by the next call.
	fw := &failing{Communicator: handle(t, 5, 8)}
	m := mustNew(t, fw, []int{2, 4}, []string{"dp", "tp"})
	for range 2 {
		_, err := m.Comm(context.Background(), "tp")
		if want := "mesh: Comm: comm: Agree on the mesh axes: exchanging fingerprints: "; !errors.Is(err, errNoCollectives) || !strings.HasPrefix(err.Error(), want) {
			t.Errorf("Comm on an aborted world: %v, want it to start with %q and wrap the abort", err, want)
		}
	}
	if n := fw.dos.Load(); n != 2 {
		t.Errorf("%d checks, want 2: a failed check is not remembered", n)
	}
}

func TestWholeWorldIsWorld(t *testing.T) {
	// No Split is needed: groups spanning the whole world in world order
	// are the world communicator itself.
	run(t, 6, func(ctx context.Context, world comm.Communicator) error {
		w := &counting{Communicator: world}
		m, err := mesh.New(w, []int{2, 3}, []string{"dp", "cp"})
		if err != nil {
			return err
		}
		f, err := m.Flatten([]string{"dp", "cp"}, "")
		if err != nil {
			return err
		}
		for _, tt := range []struct {
			what string
			get  func() (comm.Communicator, error)
		}{
			{"Group()", func() (comm.Communicator, error) { return m.Group(ctx) }},
			{"Group(dp, cp)", func() (comm.Communicator, error) { return m.Group(ctx, "dp", "cp") }},
			{"Flatten.Comm", func() (comm.Communicator, error) { return f.Comm(ctx, "dp_cp") }},
			{"Flatten.Group()", func() (comm.Communicator, error) { return f.Group(ctx) }},
			{"1-axis mesh Comm", func() (comm.Communicator, error) {
				m1, err := mesh.New(w, []int{6}, []string{"x"})
				if err != nil {
					return nil, err
				}
				return m1.Comm(ctx, "x")
			}},
		} {
			c, err := tt.get()
			if err != nil {
				return fmt.Errorf("%s: %w", tt.what, err)
			}
			if c != w {
				return fmt.Errorf("%s: got %#v, want the world", tt.what, c)
			}
		}
		if n := w.splits.Load(); n != 0 {
			return fmt.Errorf("%d Splits for whole-world groups, want 0", n)
		}
		// The transposed whole world is a different order: it needs a Split.
		s, err := m.Sub("cp", "dp")
		if err != nil {
			return err
		}
		if _, err := s.Group(ctx); err != nil {
			return err
		}
		if n := w.splits.Load(); n != 1 {
			return fmt.Errorf("transposed Group: %d Splits, want 1", n)
		}
		return nil
	})
	// A world of one rank needs no collective at all (the handle is aborted).
	w1 := handle(t, 0, 1)
	m, err := mesh.New(w1, []int{1, 1}, []string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	if c, err := m.Comm(context.Background(), "b"); err != nil || c != w1 {
		t.Errorf("size-1 world Comm: %v, %v; want the world", c, err)
	}
}

// TestMeshAgreement: a rank that builds its mesh with other axis names or
// sizes makes the first Comm or Group fail on every rank, naming the ranks
// and the first differing axis, before any Split.
func TestMeshAgreement(t *testing.T) {
	for _, tc := range []struct {
		name     string
		shape    []int
		names    []string
		odd      int // the rank that passes oddShape and oddNames
		oddShape []int
		oddNames []string
		want     string // "" when the meshes agree
	}{
		{name: "same", shape: []int{2, 2}, names: []string{"dp", "tp"}, odd: 1, oddShape: []int{2, 2}, oddNames: []string{"dp", "tp"}},
		{name: "names swapped", shape: []int{2, 2}, names: []string{"dp", "tp"}, odd: 1, oddShape: []int{2, 2}, oddNames: []string{"tp", "dp"},
			want: `mesh: Group: ranks disagree on the mesh axes: rank 1 has "tp=2" at position 0 where ranks 0, 2, 3 have "dp=2"`},
		{name: "shape", shape: []int{2, 2}, names: []string{"dp", "tp"}, odd: 3, oddShape: []int{4, 1}, oddNames: []string{"dp", "tp"},
			want: `mesh: Group: ranks disagree on the mesh axes: rank 3 has "dp=4" at position 0 where ranks 0-2 have "dp=2"`},
		{name: "fewer axes", shape: []int{2, 2}, names: []string{"dp", "tp"}, odd: 2, oddShape: []int{4}, oddNames: []string{"dp"},
			want: `mesh: Group: ranks disagree on the mesh axes: rank 2 has "dp=4" at position 0 where ranks 0, 1, 3 have "dp=2" (1 entry against 2)`},
		{name: "name, odd p", shape: []int{3}, names: []string{"dp"}, odd: 0, oddShape: []int{3}, oddNames: []string{"x"},
			want: `mesh: Group: ranks disagree on the mesh axes: rank 0 has "x=3" at position 0 where ranks 1, 2 have "dp=3"`},
		{name: "p=2", shape: []int{1, 2}, names: []string{"pp", "dp"}, odd: 1, oddShape: []int{2, 1}, oddNames: []string{"pp", "dp"},
			want: `mesh: Group: ranks disagree on the mesh axes: rank 1 has "pp=2" at position 0 where rank 0 has "pp=1"`},
	} {
		p := prod(tc.shape)
		errs := make([]error, p)
		splits := make([]int64, p)
		run(t, p, func(ctx context.Context, world comm.Communicator) error {
			shape, names := tc.shape, tc.names
			if world.Rank() == tc.odd {
				shape, names = tc.oddShape, tc.oddNames
			}
			w := &counting{Communicator: world}
			m, err := mesh.New(w, shape, names)
			if err != nil {
				return err
			}
			_, errs[world.Rank()] = m.Group(ctx, names[len(names)-1])
			splits[world.Rank()] = w.splits.Load()
			return nil
		})
		for r, err := range errs {
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("%s: rank %d: %v", tc.name, r, err)
			case tc.want == "":
			case err == nil || err.Error() != tc.want:
				t.Errorf("%s: rank %d:\n got %v\nwant %s", tc.name, r, err, tc.want)
			case !errors.Is(err, loom.ErrMismatch):
				t.Errorf("%s: rank %d: %v does not match loom.ErrMismatch", tc.name, r, err)
			case splits[r] != 0:
				t.Errorf("%s: rank %d: %d Splits before the error, want 0", tc.name, r, splits[r])
			}
		}
	}
}

// counting wraps a world communicator and counts its Splits.
type counting struct {
	comm.Communicator
	splits atomic.Int64
}

func (c *counting) Split(ctx context.Context, color, key int) (comm.Communicator, error) {
	c.splits.Add(1)
	return c.Communicator.Split(ctx, color, key)
}

// run runs fn on p in-process ranks with a deadline, so a hang fails the test.
func run(t *testing.T, p int, fn func(ctx context.Context, c comm.Communicator) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := local.Run(ctx, p, fn); err != nil {
		t.Fatal(err)
	}
}

// members returns the world ranks of c's members in order, by an AllGather
// of each member's world rank.
func members(ctx context.Context, c comm.Communicator, worldRank int) ([]int, error) {
	out := make([]int64, c.Size())
	if err := comm.AllGather(ctx, c, comm.Host([]int64{int64(worldRank)}), comm.Host(out)); err != nil {
		return nil, err
	}
	ws := make([]int, len(out))
	for i, w := range out {
		ws[i] = int(w)
	}
	return ws, nil
}

// contribution is world rank w's AllReduce input.
func contribution(w int) []float64 {
	return []float64{float64(w + 1), float64(10 * w), -float64(w * w)}
}

// checkGroupComm checks a group communicator against the reference group:
// its size and this rank's position, its members by AllGather, and a sum
// and max AllReduce against a serial reference.
func checkGroupComm(ctx context.Context, c comm.Communicator, want []int, w int) error {
	if c.Size() != len(want) || c.Rank() != slices.Index(want, w) {
		return fmt.Errorf("size %d rank %d, want %d %d", c.Size(), c.Rank(), len(want), slices.Index(want, w))
	}
	got, err := members(ctx, c, w)
	if err != nil {
		return err
	}
	if !slices.Equal(got, want) {
		return fmt.Errorf("members %v, want %v", got, want)
	}
	for _, op := range []comm.ReduceOp{comm.Sum, comm.Max} {
		ref := contribution(want[0])
		for _, v := range want[1:] {
			for i, x := range contribution(v) {
				if op == comm.Sum {
					ref[i] += x
				} else {
					ref[i] = max(ref[i], x)
				}
			}
		}
		out := make([]float64, len(ref))
		if err := comm.AllReduce(ctx, c, comm.Host(contribution(w)), comm.Host(out), op); err != nil {
			return err
		}
		if !slices.Equal(out, ref) {
			return fmt.Errorf("AllReduce %v = %v, want %v", op, out, ref)
		}
	}
	return nil
}

func TestAxisComms(t *testing.T) {
	for _, l := range layouts {
		t.Run(fmt.Sprint(l.shape), func(t *testing.T) {
			run(t, prod(l.shape), func(ctx context.Context, world comm.Communicator) error {
				w := world.Rank()
				m, err := mesh.New(world, l.shape, l.names)
				if err != nil {
					return err
				}
				for _, n := range l.names {
					c, err := m.Comm(ctx, n)
					if err != nil {
						return err
					}
					if loc, _ := m.Local(n); c.Rank() != loc {
						return fmt.Errorf("rank %d: Comm(%q).Rank() = %d, Local = %d", w, n, c.Rank(), loc)
					}
					if err := checkGroupComm(ctx, c, refGroup(l.shape, l.names, w, []string{n}), w); err != nil {
						return fmt.Errorf("rank %d: Comm(%q): %w", w, n, err)
					}
				}
				for _, sel := range selections(l.names) {
					c, err := m.Group(ctx, sel...)
					if err != nil {
						return err
					}
					if err := checkGroupComm(ctx, c, refGroup(l.shape, l.names, w, sel), w); err != nil {
						return fmt.Errorf("rank %d: Group(%q): %w", w, sel, err)
					}
				}
				c, err := m.Group(ctx)
				if err != nil {
					return err
				}
				if c != world {
					return fmt.Errorf("rank %d: Group() is not the world", w)
				}
				return checkGroupComm(ctx, c, m.WorldRanks(), w)
			})
		})
	}
}

func TestSubAndFlattenComms(t *testing.T) {
	// Communicators of views: Sub(sel...).Comm(axis) and Flatten(...).Comm.
	for _, l := range layouts {
		t.Run(fmt.Sprint(l.shape), func(t *testing.T) {
			run(t, prod(l.shape), func(ctx context.Context, world comm.Communicator) error {
				w := world.Rank()
				m, err := mesh.New(world, l.shape, l.names)
				if err != nil {
					return err
				}
				for _, sel := range selections(l.names) {
					s, err := m.Sub(sel...)
					if err != nil {
						return err
					}
					c, err := s.Group(ctx)
					if err != nil {
						return err
					}
					if err := checkGroupComm(ctx, c, refGroup(l.shape, l.names, w, sel), w); err != nil {
						return fmt.Errorf("rank %d: Sub(%q).Group(): %w", w, sel, err)
					}
					if c.Rank() != s.Rank() {
						return fmt.Errorf("rank %d: Sub(%q).Group().Rank() = %d, Rank() = %d", w, sel, c.Rank(), s.Rank())
					}
					if len(sel) == 1 {
						continue
					}
					f, err := s.Flatten(sel, "")
					if err != nil {
						return err
					}
					fc, err := f.Comm(ctx, strings.Join(sel, "_"))
					if err != nil {
						return err
					}
					if fc != c {
						return fmt.Errorf("rank %d: Sub(%q).Flatten: a second communicator for the same group", w, sel)
					}
				}
				return nil
			})
		})
	}
}

func TestCommSharing(t *testing.T) {
	// On a ("pp","dp","tp") = 2x2x2 mesh, count the world Splits of each
	// rank as views ask for groups that earlier views already created.
	run(t, 8, func(ctx context.Context, world comm.Communicator) error {
		w := world.Rank()
		cw := &counting{Communicator: world}
		m, err := mesh.New(cw, []int{2, 2, 2}, []string{"pp", "dp", "tp"})
		if err != nil {
			return err
		}
		type step struct {
			what   string
			get    func() (comm.Communicator, error)
			same   string // the earlier step whose communicator it must be, or ""
			splits int64  // total Splits after the step
		}
		var viewErr error // the first error building a view
		sub := func(names ...string) *mesh.Mesh {
			s, err := m.Sub(names...)
			if err != nil {
				viewErr = cmp.Or(viewErr, err)
				return m
			}
			return s
		}
		flat := func(v *mesh.Mesh, names []string, as string) *mesh.Mesh {
			f, err := v.Flatten(names, as)
			if err != nil {
				viewErr = cmp.Or(viewErr, err)
				return v
			}
			return f
		}
		steps := []step{
			{"tp", func() (comm.Communicator, error) { return m.Comm(ctx, "tp") }, "", 1},
			{"tp again", func() (comm.Communicator, error) { return m.Comm(ctx, "tp") }, "tp", 1},
			{"Group(tp)", func() (comm.Communicator, error) { return m.Group(ctx, "tp") }, "tp", 1},
			{"Sub(tp).Group()", func() (comm.Communicator, error) { return sub("tp").Group(ctx) }, "tp", 1},
			{"Sub(dp,tp).Comm(tp)", func() (comm.Communicator, error) { return sub("dp", "tp").Comm(ctx, "tp") }, "tp", 1},
			{"Group(dp,tp)", func() (comm.Communicator, error) { return m.Group(ctx, "dp", "tp") }, "", 2},
			{"Flatten(dp,tp).Comm(dp_tp)", func() (comm.Communicator, error) {
				return flat(m, []string{"dp", "tp"}, "").Comm(ctx, "dp_tp")
			}, "Group(dp,tp)", 2},
			{"Sub(dp,tp).Group()", func() (comm.Communicator, error) { return sub("dp", "tp").Group(ctx) }, "Group(dp,tp)", 2},
			{"Sub(dp,tp).Flatten(tp).Comm", func() (comm.Communicator, error) {
				return flat(sub("dp", "tp"), []string{"tp"}, "t").Comm(ctx, "t")
			}, "tp", 2},
			{"Group(tp,dp)", func() (comm.Communicator, error) { return m.Group(ctx, "tp", "dp") }, "", 3},
			{"Sub(tp,dp).Group()", func() (comm.Communicator, error) { return sub("tp", "dp").Group(ctx) }, "Group(tp,dp)", 3},
			{"world", func() (comm.Communicator, error) { return m.Group(ctx) }, "", 3},
			{"Flatten(all)", func() (comm.Communicator, error) {
				return flat(m, []string{"pp", "dp", "tp"}, "all").Comm(ctx, "all")
			}, "world", 3},
			{"pp", func() (comm.Communicator, error) { return m.Comm(ctx, "pp") }, "", 4},
			{"Sub(pp,dp).Sub(pp).Group()", func() (comm.Communicator, error) {
				s, err := sub("pp", "dp").Sub("pp")
				if err != nil {
					return nil, err
				}
				return s.Group(ctx)
			}, "pp", 4},
		}
		got := map[string]comm.Communicator{}
		for _, s := range steps {
			c, err := s.get()
			if err = cmp.Or(viewErr, err); err != nil {
				return fmt.Errorf("rank %d: %s: %w", w, s.what, err)
			}
			got[s.what] = c
			if s.same != "" && c != got[s.same] {
				return fmt.Errorf("rank %d: %s: not the communicator of %s", w, s.what, s.same)
			}
			if n := cw.splits.Load(); n != s.splits {
				return fmt.Errorf("rank %d: after %s: %d Splits, want %d", w, s.what, n, s.splits)
			}
		}
		if got["world"] != comm.Communicator(cw) {
			return fmt.Errorf("rank %d: Group() is not the world", w)
		}
		// Distinct groups got distinct communicators.
		for _, a := range []string{"tp", "Group(dp,tp)", "Group(tp,dp)", "pp"} {
			for _, b := range []string{"tp", "Group(dp,tp)", "Group(tp,dp)", "pp"} {
				if a != b && got[a] == got[b] {
					return fmt.Errorf("rank %d: %s and %s share a communicator", w, a, b)
				}
			}
		}
		// The shared communicators still work.
		for _, s := range []struct {
			what string
			sel  []string
		}{{"tp", []string{"tp"}}, {"Group(dp,tp)", []string{"dp", "tp"}}, {"Group(tp,dp)", []string{"tp", "dp"}}, {"pp", []string{"pp"}}} {
			if err := checkGroupComm(ctx, got[s.what], refGroup([]int{2, 2, 2}, []string{"pp", "dp", "tp"}, w, s.sel), w); err != nil {
				return fmt.Errorf("rank %d: %s: %w", w, s.what, err)
			}
		}
		return nil
	})
}

func TestConcurrentFirstUse(t *testing.T) {
	// Several goroutines of each rank ask for the same group at once: one
	// Split happens and all get the same communicator.
	run(t, 8, func(ctx context.Context, world comm.Communicator) error {
		cw := &counting{Communicator: world}
		m, err := mesh.New(cw, []int{2, 4}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		const g = 8
		comms := make([]comm.Communicator, g)
		errs := make([]error, g)
		var wg sync.WaitGroup
		for i := range g {
			wg.Go(func() {
				v := m
				if i%2 == 1 {
					v, errs[i] = m.Sub("tp")
					if errs[i] != nil {
						return
					}
				}
				comms[i], errs[i] = v.Comm(ctx, "tp")
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		for _, c := range comms[1:] {
			if c != comms[0] {
				return fmt.Errorf("rank %d: concurrent first uses got different communicators", world.Rank())
			}
		}
		if n := cw.splits.Load(); n != 1 {
			return fmt.Errorf("rank %d: %d Splits, want 1", world.Rank(), n)
		}
		return checkGroupComm(ctx, comms[0], refGroup([]int{2, 4}, []string{"dp", "tp"}, world.Rank(), []string{"tp"}), world.Rank())
	})
}

func TestNonSPMDFirstUse(t *testing.T) {
	// Rank 0 asks for its dp group while the others ask for their tp groups:
	// the world Split then gives rank 0 a group that is not the one it asked
	// for, which Comm reports instead of returning a wrong communicator.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := local.Run(ctx, 8, func(ctx context.Context, world comm.Communicator) error {
		m, err := mesh.New(world, []int{2, 4}, []string{"dp", "tp"})
		if err != nil {
			return err
		}
		axis := "tp"
		if world.Rank() == 0 {
			axis = "dp"
		}
		_, err = m.Comm(ctx, axis)
		return err
	})
	want := "rank 0: mesh: Split(color 0, key 0) for group [0,4] returned size 4, rank 0; want size 2, rank 0 (are all world ranks making the same calls?)"
	if err == nil || err.Error() != want {
		t.Errorf("Run: %v\nwant: %s", err, want)
	}
}
