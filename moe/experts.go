package moe

import (
	"context"
	"fmt"
	"github.com/b7ea7098/loom/internal/half"
	"math"
	"slices"
	"time"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
)

// Experts is E expert MLPs, o = W2[e]·GELU(W1[e]·x + b1[e]) + b2[e] with
// the exact (erf) GELU and PyTorch's [out, in] weight layout, distributed
// over the expert-parallel axis: the parameters W1 [E, Hd, D], b1 [E, Hd],
// W2 [E, D, Hd] and b2 [E, D] are Shard(0) on that axis (rank r holds
// experts [r·E/P, (r+1)·E/P)) and Replicate on every other axis, so they
// compose with data-parallel axes that shard the tokens.
//
// Forward runs each local expert on its contiguous run of dispatched rows
// with three GEMMs forward and four backward (kernels.BLAS), so the cost
// follows the tokens an expert received; an expert with no rows computes
// nothing and gets exactly zero gradient.
type Experts struct {
	// W1, B1, W2 and B2 are the parameters, usually autograd leaves
	// (autograd.Tape.Param); NewExperts checks their layouts.
	W1, B1, W2, B2 *autograd.Value
	// BLAS runs the GEMMs on the host; nil means kernels.Default(). On a
	// device the GEMMs are the device's (Kernels.Gemm).
	BLAS *kernels.BLAS

	axis      string
	e, hd, d  int
	dtype     comm.DType
	otherAxes []string // axes besides the expert-parallel one
}

// NewExperts checks the expert parameters and returns the module. axis is
// the expert-parallel mesh axis (the DispatchConfig.Axis of the dispatches
// it will serve). W1 must be [E, Hd, D], b1 [E, Hd], W2 [E, D, Hd] and b2
// [E, D], all of one dtype (float32 or float64) on one mesh, each Shard(0)
// on axis and Replicate on every other axis; the axis size must divide E.
// Errors wrap ErrInvalid and name the parameter.
func NewExperts(axis string, w1, b1, w2, b2 *autograd.Value) (*Experts, error) {
	const op = "moe: NewExperts"
	bad := func(format string, args ...any) (*Experts, error) {
		return nil, fmt.Errorf("%s: %w: "+format, append([]any{op, ErrInvalid}, args...)...)
	}
	vals := []*autograd.Value{w1, b1, w2, b2}
	names := []string{"W1", "b1", "W2", "b2"}
	for i, v := range vals {
		if v == nil || v.Spec() == nil {
			return bad("nil %s", names[i])
		}
	}
	s1 := w1.Spec().Shape()
	if len(s1) != 3 {
		return bad("W1 has shape %v; want [E, Hd, D]", s1)
	}
	e, hd, d := s1[0], s1[1], s1[2]
	want := [][]int{{e, hd, d}, {e, hd}, {e, d, hd}, {e, d}}
	m := w1.Spec().Mesh()
	p, err := m.AxisSize(axis)
	if err != nil {
		return bad("expert-parallel axis %q is not an axis of the mesh %v", axis, m)
	}
	if e%p != 0 {
		return bad("%d experts do not divide over the %d ranks of axis %q", e, p, axis)
	}
	dt := w1.Spec().DType()
	if dt != comm.Float32 && dt != comm.Float64 {
		return bad("W1 is %v; want float32 or float64", dt)
	}
	for i, v := range vals {
		s := v.Spec()
		if !slices.Equal(s.Shape(), want[i]) {
			return bad("%s has shape %v; with W1 %v it must be %v", names[i], s.Shape(), s1, want[i])
		}
		if s.DType() != dt {
			return bad("%s is %v, W1 %v; they must match", names[i], s.DType(), dt)
		}
		sm := s.Mesh()
		if sm.World() != m.World() || !slices.Equal(sm.Names(), m.Names()) || !slices.Equal(sm.Shape(), m.Shape()) || !slices.Equal(sm.WorldRanks(), m.WorldRanks()) {
			return bad("%s is on mesh %v, W1 on %v; they must share a mesh", names[i], sm, m)
		}
		if got, w := s.Placements(), expertPlacements(m, axis); !slices.Equal(got, w) {
			return bad("%s is laid out %v; expert parameters are %v (Shard(0) on %q, Replicate elsewhere)", names[i], got, w, axis)
		}
	}
	var others []string
	for _, n := range m.Names() {
		if n != axis {
			others = append(others, n)
		}
	}
	return &Experts{W1: w1, B1: b1, W2: w2, B2: b2, axis: axis, e: e, hd: hd, d: d, dtype: dt, otherAxes: others}, nil
}

// expertPlacements is Shard(0) on axis and Replicate elsewhere.
func expertPlacements(m *mesh.Mesh, axis string) []placement.Placement {
	names := m.Names()
	out := make([]placement.Placement, len(names))
	for a, n := range names {
		out[a] = placement.Replicate()
		if n == axis {
			out[a] = placement.Shard(0)
		}
	}
	return out
}

// ExpertsOption configures ShardExperts.
type ExpertsOption func(*expertsConfig)

type expertsConfig struct{ prefix string }

// WithPrefix names the expert parameters prefix + ".W1", ".b1", ".W2" and
// ".b2" (default prefix "moe"): give the layer's path in the model
// ("h.0.moe", "4") so that parameter names, DDP's buckets, FSDP's errors
// and checkpoints name the layer. An empty prefix is an error.
func WithPrefix(prefix string) ExpertsOption {
	return func(c *expertsConfig) { c.prefix = prefix }
}

// ShardExperts makes the expert parameters on tape t from full weights
// that every rank holds, row-major: W1 [e, hidden, dim], b1 [e, hidden],
// W2 [e, dim, hidden] and b2 [e, dim]. Each rank keeps its experts' slices
// (no communication) as leaves named "moe.W1", "moe.b1", "moe.W2" and
// "moe.b2" (another prefix with WithPrefix), and NewExperts checks them. A
// slice whose length does not match its shape is an error. Errors wrap
// ErrInvalid or placement's errors.
func ShardExperts[T float32 | float64](t *autograd.Tape, m *mesh.Mesh, axis string, e, hidden, dim int, w1, b1, w2, b2 []T, opts ...ExpertsOption) (*Experts, error) {
	const op = "moe: ShardExperts"
	if t == nil || m == nil {
		return nil, fmt.Errorf("%s: %w: nil tape or mesh", op, ErrInvalid)
	}
	cfg := expertsConfig{prefix: "moe"}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.prefix == "" {
		return nil, fmt.Errorf("%s: %w: empty WithPrefix", op, ErrInvalid)
	}
	if !slices.Contains(m.Names(), axis) {
		return nil, fmt.Errorf("%s: %w: expert-parallel axis %q is not an axis of the mesh %v", op, ErrInvalid, axis, m)
	}
	dt := comm.Float32
	if _, ok := any(w1).([]float64); ok {
		dt = comm.Float64
	}
	names := []string{cfg.prefix + ".W1", cfg.prefix + ".b1", cfg.prefix + ".W2", cfg.prefix + ".b2"}
	shapes := [][]int{{e, hidden, dim}, {e, hidden}, {e, dim, hidden}, {e, dim}}
	vals := make([]*autograd.Value, 4)
	for i, full := range [][]T{w1, b1, w2, b2} {
		spec, err := placement.NewSpec(m, shapes[i], dt, expertPlacements(m, axis))
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", op, names[i], err)
		}
		dtn, err := placement.FromFull(spec, full)
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", op, names[i], err)
		}
		if vals[i], err = t.Param(names[i], dtn); err != nil {
			return nil, fmt.Errorf("%s: %s: %w", op, names[i], err)
		}
	}
	return NewExperts(axis, vals[0], vals[1], vals[2], vals[3])
}

// OwnParams returns W1, b1, W2 and b2, so that Experts is a
// parallel.ParamHolder.
func (x *Experts) OwnParams() []*autograd.Value {
	if x == nil {
		return nil
	}
	return []*autograd.Value{x.W1, x.B1, x.W2, x.B2}
}

// Axis returns the expert-parallel mesh axis ("" for nil experts).
func (x *Experts) Axis() string {
	if x == nil {
		return ""
	}
	return x.axis
}

// Sizes returns E, the hidden width Hd and the model width D (zeros for
// nil experts).
func (x *Experts) Sizes() (experts, hidden, width int) {
	if x == nil {
		return 0, 0, 0
	}
	return x.e, x.hd, x.d
}

// Forward runs the local experts on the rows of one dispatch: rows is
// Dispatch's result (laid out by h.Spec(), width D) and h its handle, whose
// ExpertRows say which contiguous run of rows belongs to which local
// expert. The result has rows' layout and is what Combine takes.
//
// Backward returns the rows' gradient in their layout and the parameters'
// gradients: Shard(0) on the expert-parallel axis, Partial(sum) on the
// other axes that shard the tokens (each data-parallel replica of an
// expert saw different tokens; reduce them as for any data-parallel
// gradient), and on the remaining axes the placement of the arriving
// gradient (Replicate, or Partial(sum)). Padding rows of a static-capacity
// dispatch are computed but get zero gradient from Combine, so they add
// nothing to the parameters' gradients. Errors wrap ErrInvalid (a handle
// of another axis or size, rows of another layout or dtype) or the
// kernels' errors.
func (x *Experts) Forward(ctx context.Context, rows *autograd.Value, h *Handle) (*autograd.Value, error) {
	const op = "moe: Experts.Forward"
	if x == nil || h == nil {
		return nil, fmt.Errorf("%s: %w: nil experts or handle", op, ErrInvalid)
	}
	if h.axis != x.axis || h.e != x.e || h.d != x.d {
		return nil, fmt.Errorf("%s: %w: the handle dispatched %d experts of width %d over axis %q; these are %d experts of width %d over %q", op, ErrInvalid, h.e, h.d, h.axis, x.e, x.d, x.axis)
	}
	if rows == nil || rows.Spec() == nil || !rows.Spec().Equal(h.routed) {
		var got *placement.Spec
		if rows != nil {
			got = rows.Spec()
		}
		return nil, fmt.Errorf("%s: %w: the rows are laid out as %v; the handle's dispatch gave %v", op, ErrInvalid, got, h.routed)
	}
	if rows.Spec().DType() != x.dtype {
		return nil, fmt.Errorf("%s: %w: the rows are %v, the parameters %v", op, ErrInvalid, rows.Spec().DType(), x.dtype)
	}
	if w1s := x.W1.Spec().Mesh(); w1s.World() != h.xs.Mesh().World() || !slices.Equal(w1s.WorldRanks(), h.xs.Mesh().WorldRanks()) || !slices.Equal(w1s.Names(), h.xs.Mesh().Names()) {
		return nil, fmt.Errorf("%s: %w: the parameters are on mesh %v, the rows on %v", op, ErrInvalid, w1s, h.xs.Mesh())
	}
	dev, err := deviceOf(op, rows.Data())
	if err != nil {
		return nil, err
	}
	if dev != nil {
		return x.forwardDev(ctx, rows, h, dev)
	}
	blas := x.BLAS
	if blas == nil {
		var err error
		if blas, err = kernels.Default(); err != nil {
			return nil, fmt.Errorf("%s: BLAS: %w", op, err)
		}
	}
	run := &expertRun{x: x, h: h, rows: rows, blas: blas}
	out, err := autograd.Custom("moe.Experts", []*autograd.Value{rows, x.W1, x.B1, x.W2, x.B2},
		func() (*placement.DTensor, error) {
			start := time.Now()
			defer func() { h.stats.Forward.Experts += time.Since(start) }()
			if x.dtype == comm.Float32 {
				return expertsForward[float32](run)
			}
			return expertsForward[float64](run)
		},
		func(_ context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			start := time.Now()
			defer func() { h.stats.Backward.Experts += time.Since(start) }()
			if x.dtype == comm.Float32 {
				return expertsBackward[float32](run, g)
			}
			return expertsBackward[float64](run, g)
		})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return out, nil
}

// expertRun is one Experts.Forward call and what it keeps for backward.
type expertRun struct {
	x     *Experts
	h     *Handle
	rows  *autograd.Value
	blas  *kernels.BLAS
	act   any // []T [rows, Hd]: GELU(u), the second GEMM's input
	deriv any // []T [rows, Hd]: GELU'(u)
}

// expertBlocks returns the local blocks of the rows and the parameters.
func expertBlocks[T kernels.Float](r *expertRun) (xs, w1, b1, w2, b2 []T, err error) {
	get := func(v *autograd.Value, what string) []T {
		if err != nil {
			return nil
		}
		var d []T
		d, err = localData[T](v.Data(), what)
		return d
	}
	xs = get(r.rows, "Experts rows")
	w1 = get(r.x.W1, "Experts W1")
	b1 = get(r.x.B1, "Experts b1")
	w2 = get(r.x.W2, "Experts W2")
	b2 = get(r.x.B2, "Experts b2")
	return
}

func expertsForward[T kernels.Float](r *expertRun) (*placement.DTensor, error) {
	xs, w1, b1, w2, b2, err := expertBlocks[T](r)
	if err != nil {
		return nil, err
	}
	hd, d := r.x.hd, r.x.d
	total := len(xs) / max(d, 1)
	// The hidden activations live until backward (the tape's scratch);
	// every kernel below writes all of its output rows.
	t := r.rows.Tape()
	act := autograd.ScratchBlock[T](t, total*hd)
	deriv := autograd.ScratchBlock[T](t, total*hd)
	out := autograd.ResultBlock[T](t, total*d)
	off := 0
	for l, c := range r.h.expertRows {
		if c == 0 {
			continue
		}
		xl := xs[off*d : (off+c)*d]
		al, dl := act[off*hd:(off+c)*hd], deriv[off*hd:(off+c)*hd]
		ol := out[off*d : (off+c)*d]
		w1l, w2l := w1[l*hd*d:(l+1)*hd*d], w2[l*d*hd:(l+1)*d*hd]
		// u = x·W1ᵀ, h = GELU(u + b1), o = h·W2ᵀ + b2.
		if err := gemm(r, false, true, c, hd, d, xl, d, w1l, d, al, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", r.h.rank*r.h.local+l, err)
		}
		if err := biasGELU(kernels.Workers(r.blas.Threads()), al, dl, b1[l*hd:(l+1)*hd], hd); err != nil {
			return nil, err
		}
		if err := gemm(r, false, true, c, d, hd, al, hd, w2l, hd, ol, d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", r.h.rank*r.h.local+l, err)
		}
		bl := b2[l*d : (l+1)*d]
		for i := range c {
			row := ol[i*d : (i+1)*d]
			for j, v := range bl {
				row[j] += v
			}
		}
		off += c
	}
	r.act, r.deriv = act, deriv
	return placement.NewLocal(r.h.routed, out)
}

func expertsBackward[T kernels.Float](r *expertRun, g *placement.DTensor) ([]*placement.DTensor, error) {
	h, x := r.h, r.x
	places, err := h.gradPlaces(g, h.routed, "the experts' output")
	if err != nil {
		return nil, err
	}
	xs, w1, _, w2, _, err := expertBlocks[T](r)
	if err != nil {
		return nil, err
	}
	gd, err := localData[T](g, "Experts backward")
	if err != nil {
		return nil, err
	}
	act, _ := r.act.([]T)
	deriv, _ := r.deriv.([]T)
	hd, d, l := x.hd, x.d, h.local
	t := r.rows.Tape()
	dx := autograd.ScratchBlock[T](t, len(xs))
	dw1, db1 := autograd.ScratchBlock[T](t, l*hd*d), autograd.ScratchBlock[T](t, l*hd)
	dw2, db2 := autograd.ScratchBlock[T](t, l*d*hd), autograd.ScratchBlock[T](t, l*d)
	var du []T
	off := 0
	for j, c := range h.expertRows {
		if c == 0 { // an expert without rows: zero gradients
			clear(dw1[j*hd*d : (j+1)*hd*d])
			clear(db1[j*hd : (j+1)*hd])
			clear(dw2[j*d*hd : (j+1)*d*hd])
			clear(db2[j*d : (j+1)*d])
			continue
		}
		xl, gl := xs[off*d:(off+c)*d], gd[off*d:(off+c)*d]
		al, dl := act[off*hd:(off+c)*hd], deriv[off*hd:(off+c)*hd]
		w1l, w2l := w1[j*hd*d:(j+1)*hd*d], w2[j*d*hd:(j+1)*d*hd]
		expert := h.rank*l + j
		// dW2 = gᵀ·h, db2 = Σ_rows g, dh = g·W2, du = dh ⊙ GELU'(u),
		// db1 = Σ_rows du, dW1 = duᵀ·x, dx = du·W1.
		if err := gemm(r, true, false, d, hd, c, gl, d, al, hd, dw2[j*d*hd:(j+1)*d*hd], hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := columnSums(db2[j*d:(j+1)*d], gl, d); err != nil {
			return nil, err
		}
		du = slices.Grow(du[:0], c*hd)[:c*hd]
		if err := gemm(r, false, false, c, hd, d, gl, d, w2l, hd, du, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := biasGELUBackward(du, db1[j*hd:(j+1)*hd], dl, hd); err != nil {
			return nil, err
		}
		if err := gemm(r, true, false, hd, d, c, du, hd, xl, d, dw1[j*hd*d:(j+1)*hd*d], d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := gemm(r, false, false, c, d, hd, du, hd, w1l, d, dx[off*d:(off+c)*d], d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		off += c
	}
	dxSpec, err := gradSpec(h.routed, d, places)
	if err != nil {
		return nil, err
	}
	msh := h.xs.Mesh()
	pp := x.paramGradPlaces(h, places)
	grads := make([]*placement.DTensor, 5)
	if grads[0], err = placement.NewLocal(dxSpec, dx); err != nil {
		return nil, err
	}
	for i, pg := range []struct {
		v    *autograd.Value
		data []T
	}{{x.W1, dw1}, {x.B1, db1}, {x.W2, dw2}, {x.B2, db2}} {
		spec, err := placement.NewSpec(msh, pg.v.Spec().Shape(), x.dtype, pp)
		if err != nil {
			return nil, err
		}
		if grads[i+1], err = placement.NewLocal(spec, pg.data); err != nil {
			return nil, err
		}
	}
	return grads, nil
}

// paramGradPlaces is the layout of the parameters' gradients: Shard(0)
// on the expert axis, Partial(sum) on the other token axes, the arriving
// gradient's placement (places) elsewhere.
func (x *Experts) paramGradPlaces(h *Handle, places []placement.Placement) []placement.Placement {
	names := h.xs.Mesh().Names()
	pp := make([]placement.Placement, len(names))
	for a, n := range names {
		switch {
		case n == x.axis:
			pp[a] = placement.Shard(0)
		case slices.Contains(h.tokenAxes, n):
			pp[a] = placement.Partial(comm.Sum)
		default:
			pp[a] = places[a]
		}
	}
	return pp
}

// gemm sets c = op(a)·op(b) (row-major, leading dimensions lda, ldb, ldc)
// on r's BLAS in T's precision; float32 operands are rounded to bfloat16
// first when r's tape autocasts (autograd.WithAutocast: the host's form
// of device.GemmBF16).
func gemm[T kernels.Float](r *expertRun, ta, tb bool, m, n, k int, a []T, lda int, bm []T, ldb int, c []T, ldc int) error {
	b := r.blas
	switch a := any(a).(type) {
	case []float32:
		b32 := any(bm).([]float32)
		if r.rows.Tape().Autocast() {
			ra, rb := make([]float32, len(a)), make([]float32, len(b32))
			half.RoundBFloat16s(ra, a)
			half.RoundBFloat16s(rb, b32)
			a, b32 = ra, rb
		}
		return b.Sgemm(ta, tb, m, n, k, 1, a, lda, b32, ldb, 0, any(c).([]float32), ldc)
	case []float64:
		return b.Dgemm(ta, tb, m, n, k, 1, a, lda, any(bm).([]float64), ldb, 0, any(c).([]float64), ldc)
	}
	return fmt.Errorf("moe: gemm on %T", a)
}

// biasGELU sets u = GELU(u + bias) in place (rows of n values) and deriv =
// GELU'(u + bias): kernels.BiasGELU (on up to w goroutines) in float32,
// the same formula in float64.
func biasGELU[T kernels.Float](w kernels.Workers, u, deriv, bias []T, n int) error {
	switch uu := any(u).(type) {
	case []float32:
		return kernels.BiasGELU(w, uu, any(deriv).([]float32), uu, any(bias).([]float32), n)
	case []float64:
		dd, bb := any(deriv).([]float64), any(bias).([]float64)
		for i, v := range uu {
			z := v + bb[i%n]
			phi := 0.5 * (1 + math.Erf(z/math.Sqrt2))
			uu[i] = z * phi
			dd[i] = phi + z*math.Exp(-0.5*z*z)/math.Sqrt(2*math.Pi)
		}
		return nil
	}
	return fmt.Errorf("moe: GELU on %T", u)
}

// biasGELUBackward sets du = du ⊙ deriv in place and dbias = Σ_rows du.
func biasGELUBackward[T kernels.Float](du, dbias, deriv []T, n int) error {
	switch dd := any(du).(type) {
	case []float32:
		return kernels.BiasGELUBackward(dd, any(dbias).([]float32), dd, any(deriv).([]float32), n)
	case []float64:
		der, db := any(deriv).([]float64), any(dbias).([]float64)
		for i := range dd {
			dd[i] *= der[i]
		}
		return columnSums(db, dd, n)
	}
	return fmt.Errorf("moe: GELU backward on %T", du)
}

// columnSums sets out[j] to Σ_rows x[·, j] for rows of n values.
func columnSums[T kernels.Float](out, x []T, n int) error {
	switch o := any(out).(type) {
	case []float32:
		return kernels.ColumnSums(o, any(x).([]float32), n)
	case []float64:
		xx := any(x).([]float64)
		clear(o)
		for i, v := range xx {
			o[i%n] += v
		}
		return nil
	}
	return fmt.Errorf("moe: column sums on %T", out)
}
