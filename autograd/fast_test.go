package autograd

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// Tests of the float32 fast paths (fused kernels, fused attention) and of
// the tape's arena: float32 against float64 on the same values, the fused
// attention against its composition, and buffers that users keep (op
// results, the loss, leaf gradients) never being reused.

// paramSpec is one parameter of a test graph: shape and placements.
type paramSpec struct {
	shape []int
	p     pl
}

// runGraph builds params of dtype dt (values from fixed seeds), records f,
// runs Backward and returns the loss's local value, the full result of the
// value f returns besides the loss (nil if none) and every parameter's
// full gradient.
func runGraph(ctx context.Context, m *mesh.Mesh, dt comm.DType, params []paramSpec, f func(tp *Tape, ps []*Value) (loss, out *Value, err error)) (float64, []float64, [][]float64, error) {
	tp := NewTape()
	vs := make([]*Value, len(params))
	for i, c := range params {
		s, err := placement.NewSpec(m, c.shape, dt, c.p)
		if err != nil {
			return 0, nil, nil, err
		}
		d, err := placement.FromFull(s, placementtest.Random(c.shape, dt, uint64(70+i)))
		if err != nil {
			return 0, nil, nil, err
		}
		if vs[i], err = tp.Param(fmt.Sprint("p", i), d); err != nil {
			return 0, nil, nil, err
		}
	}
	loss, out, err := f(tp, vs)
	if err != nil {
		return 0, nil, nil, err
	}
	var outFull []float64
	if out != nil {
		if outFull, err = fullData(ctx, out.Data()); err != nil {
			return 0, nil, nil, err
		}
	}
	l, err := fullData(ctx, loss.Data())
	if err != nil {
		return 0, nil, nil, err
	}
	if err := tp.Backward(ctx, loss); err != nil {
		return 0, nil, nil, err
	}
	if n := len(tp.arena.out); n != 0 {
		return 0, nil, nil, fmt.Errorf("%d arena buffers still handed out after Backward", n)
	}
	grads := make([][]float64, len(vs))
	for i, v := range vs {
		if v.Grad() == nil {
			continue
		}
		if grads[i], err = fullData(ctx, v.Grad()); err != nil {
			return 0, nil, nil, err
		}
	}
	return l[0], outFull, grads, nil
}

// close32 reports whether a float32 result matches the float64 one:
// |got − want| <= tol·max(scale, |want|).
func close32(got, want, scale, tol float64) bool {
	return math.Abs(got-want) <= tol*max(scale, math.Abs(want))
}

func compareRuns(t *testing.T, name string, got, want []float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: %d values, want %d", name, len(got), len(want))
		return
	}
	scale := 0.0
	for _, w := range want {
		scale = max(scale, math.Abs(w))
	}
	scale = max(scale*1e-2, 1e-30)
	bad := 0
	for i := range got {
		if !close32(got[i], want[i], scale, tol) {
			t.Errorf("%s[%d]: %g, want %g", name, i, got[i], want[i])
			if bad++; bad > 4 {
				return
			}
		}
	}
}

// fastCase is a graph checked in float32 against float64.
type fastCase struct {
	name   string
	mesh   []int
	params []paramSpec
	f      func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error)
}

// probed turns an op's result into (loss, result).
func probed(ctx context.Context, op func(ps []*Value) (*Value, error)) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
	return func(tp *Tape, ps []*Value) (*Value, *Value, error) {
		y, err := op(ps)
		if err != nil {
			return nil, nil, err
		}
		l, err := probe(ctx, y)
		return l, y, err
	}
}

func TestFloat32FastPaths(t *testing.T) {
	one := func(f func(*Value) (*Value, error)) func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
		return func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
			return probed(ctx, func(ps []*Value) (*Value, error) { return f(ps[0]) })
		}
	}
	attn := func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
		return probed(ctx, func(ps []*Value) (*Value, error) { return CausalAttention(ps[0], ps[1], ps[2]) })
	}
	qkv := func(shape []int, p pl) []paramSpec {
		return []paramSpec{{shape, p}, {shape, p}, {shape, p}}
	}
	cases := []fastCase{
		{"gelu", []int{1}, []paramSpec{{[]int{3, 5, 7}, pl{R}}}, one(GELU)},
		{"gelu-sharded", []int{2}, []paramSpec{{[]int{4, 9}, pl{S0}}}, one(GELU)},
		{"softmax-last", []int{1}, []paramSpec{{[]int{4, 9}, pl{R}}}, one(func(x *Value) (*Value, error) { return Softmax(x, -1) })},
		{"softmax-first", []int{1}, []paramSpec{{[]int{4, 9}, pl{R}}}, one(func(x *Value) (*Value, error) { return Softmax(x, 0) })},
		{"logsoftmax-last", []int{2}, []paramSpec{{[]int{4, 5, 9}, pl{S1}}}, one(func(x *Value) (*Value, error) { return LogSoftmax(x, 2) })},
		{"causal-softmax", []int{2}, []paramSpec{{[]int{2, 3, 5, 5}, pl{S1}}}, one(CausalSoftmax)},
		{"permute-heads", []int{1}, []paramSpec{{[]int{2, 5, 3, 4}, pl{R}}}, one(func(x *Value) (*Value, error) { return Permute(x, 0, 2, 1, 3) })},
		{"permute-reverse", []int{1}, []paramSpec{{[]int{2, 5, 3, 4}, pl{R}}}, one(func(x *Value) (*Value, error) { return Permute(x, 3, 2, 1, 0) })},
		{"transpose-last", []int{2}, []paramSpec{{[]int{2, 5, 3}, pl{S0}}}, one(func(x *Value) (*Value, error) { return Transpose(x, 1, 2) })},
		{"split-concat", []int{1}, []paramSpec{{[]int{3, 4, 9}, pl{R}}}, one(func(x *Value) (*Value, error) {
			parts, err := SplitLast(x, 3)
			if err != nil {
				return nil, err
			}
			a, err := Mul(parts[0], parts[2])
			if err != nil {
				return nil, err
			}
			return Concat(-1, a, parts[1], parts[0])
		})},
		{"layernorm", []int{2}, []paramSpec{{[]int{4, 3, 7}, pl{S0}}, {[]int{7}, pl{R}}, {[]int{7}, pl{R}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return probed(ctx, func(ps []*Value) (*Value, error) { return LayerNorm(ps[0], ps[1], ps[2], 1e-5) })
			}},
		{"linear-bias", []int{2}, []paramSpec{{[]int{4, 3, 5}, pl{S0}}, {[]int{6, 5}, pl{R}}, {[]int{6}, pl{R}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return probed(ctx, func(ps []*Value) (*Value, error) { return Linear(ps[0], ps[1], ps[2]) })
			}},
		{"linear-colwise", []int{2}, []paramSpec{{[]int{3, 5}, pl{R}}, {[]int{6, 5}, pl{S0}}, {[]int{6}, pl{S0}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return probed(ctx, func(ps []*Value) (*Value, error) { return Linear(ps[0], ps[1], ps[2]) })
			}},
		{"bmm", []int{2}, []paramSpec{{[]int{2, 3, 4}, pl{S0}}, {[]int{2, 4, 5}, pl{S0}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return probed(ctx, func(ps []*Value) (*Value, error) { return BatchedMatMul(ps[0], ps[1]) })
			}},
		{"attention", []int{1}, qkv([]int{2, 3, 5, 4}, pl{R}), attn},
		{"attention-batch-sharded", []int{2}, qkv([]int{2, 3, 5, 4}, pl{S0}), attn},
		{"attention-head-sharded", []int{2}, qkv([]int{2, 3, 5, 4}, pl{S1}), attn},
		{"attention-2d", []int{2, 2}, qkv([]int{2, 3, 5, 4}, pl{S0, S1}), attn},
		{"attention-T1", []int{1}, qkv([]int{2, 1, 3}, pl{R}), attn},
		{"attention-value-width", []int{1}, []paramSpec{{[]int{3, 6, 4}, pl{R}}, {[]int{3, 6, 4}, pl{R}}, {[]int{3, 6, 5}, pl{R}}}, attn},
		// Not fused (v Partial): the composition runs.
		{"attention-partial-v", []int{2}, []paramSpec{{[]int{2, 5, 4}, pl{R}}, {[]int{2, 5, 4}, pl{R}}, {[]int{2, 5, 4}, pl{Psum}}}, attn},
		{"cross-entropy", []int{2}, []paramSpec{{[]int{6, 5}, pl{S0}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return func(tp *Tape, ps []*Value) (*Value, *Value, error) {
					tg, err := IndicesFromFull(ps[0].Spec().Mesh(), []int{6}, pl{S0}, []int64{4, 0, 2, 2, 1, 3})
					if err != nil {
						return nil, nil, err
					}
					l, err := CrossEntropy(ps[0], tg)
					return l, nil, err
				}
			}},
		// Residual stream: one value feeding several consumers whose
		// gradients accumulate (in place in the arena).
		{"residual", []int{1}, []paramSpec{{[]int{4, 6}, pl{R}}, {[]int{6, 6}, pl{R}}, {[]int{6}, pl{R}}, {[]int{6}, pl{R}}},
			func(ctx context.Context) func(tp *Tape, ps []*Value) (*Value, *Value, error) {
				return probed(ctx, func(ps []*Value) (*Value, error) {
					h := ps[0]
					for range 3 {
						a, err := LayerNorm(h, ps[2], ps[3], 1e-5)
						if err != nil {
							return nil, err
						}
						if a, err = Linear(a, ps[1], ps[2]); err != nil {
							return nil, err
						}
						if a, err = GELU(a); err != nil {
							return nil, err
						}
						if h, err = Add(h, a); err != nil {
							return nil, err
						}
						if h, err = Add(h, h); err != nil {
							return nil, err
						}
					}
					return h, nil
				})
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			simulate(t, c.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				f := c.f(ctx)
				l64, o64, g64, err := runGraph(ctx, m, comm.Float64, c.params, f)
				if err != nil {
					return fmt.Errorf("float64: %w", err)
				}
				l32, o32, g32, err := runGraph(ctx, m, comm.Float32, c.params, f)
				if err != nil {
					return fmt.Errorf("float32: %w", err)
				}
				if !close32(l32, l64, 1, 1e-5) {
					t.Errorf("loss %g, float64 %g", l32, l64)
				}
				compareRuns(t, "result", o32, o64, 1e-5)
				for i := range g64 {
					compareRuns(t, fmt.Sprint("grad ", i), g32[i], g64[i], 1e-5)
				}
				return nil
			})
		})
	}
}

// composedAttention is CausalAttention written out as its composition.
func composedAttention(q, k, v *Value) (*Value, error) {
	kt, err := Transpose(k, -2, -1)
	if err != nil {
		return nil, err
	}
	s, err := BatchedMatMul(q, kt)
	if err != nil {
		return nil, err
	}
	sh := q.Spec().Shape()
	if s, err = Scale(s, 1/math.Sqrt(float64(sh[len(sh)-1]))); err != nil {
		return nil, err
	}
	if s, err = CausalSoftmax(s); err != nil {
		return nil, err
	}
	return BatchedMatMul(s, v)
}

// TestFusedAttentionMatchesComposition: the fused float32 attention records
// one op and gives the composition's result, gradients and gradient
// layouts, including a gradient that arrives Partial(sum).
func TestFusedAttentionMatchesComposition(t *testing.T) {
	for _, c := range []struct {
		mesh    []int
		p       pl
		partial bool // use the result in a colwise matmul (its gradient arrives P(sum))
	}{{[]int{1}, pl{R}, false}, {[]int{2}, pl{S0}, false}, {[]int{2}, pl{S1}, false}, {[]int{2}, pl{R}, true}} {
		t.Run(fmt.Sprint(c.mesh, c.p, c.partial), func(t *testing.T) {
			simulate(t, c.mesh, func(ctx context.Context, m *mesh.Mesh) error {
				shape := []int{2, 4, 7, 6}
				type run struct {
					out   []float64
					grads [][]float64
					specs []string
					ops   int
				}
				do := func(att func(q, k, v *Value) (*Value, error)) (run, error) {
					var r run
					tp := NewTape()
					var vs []*Value
					for i := range 3 {
						s, err := placement.NewSpec(m, shape, comm.Float32, c.p)
						if err != nil {
							return r, err
						}
						d, err := placement.FromFull(s, placementtest.Random(shape, comm.Float32, uint64(90+i)))
						if err != nil {
							return r, err
						}
						v, err := tp.Param(fmt.Sprint("qkv", i), d)
						if err != nil {
							return r, err
						}
						vs = append(vs, v)
					}
					o, err := att(vs[0], vs[1], vs[2])
					if err != nil {
						return r, err
					}
					r.ops = tp.Len()
					if r.out, err = fullData(ctx, o.Data()); err != nil {
						return r, err
					}
					y := o
					if c.partial {
						// A colwise product (o replicated, W Shard(1)):
						// o's gradient arrives Partial(sum).
						flat, err := Reshape(o, -1, shape[3])
						if err != nil {
							return r, err
						}
						ws, err := placement.NewSpec(m, []int{shape[3], 4}, comm.Float32, pl{S1})
						if err != nil {
							return r, err
						}
						wd, err := placement.FromFull(ws, placementtest.Random(ws.Shape(), comm.Float32, 5))
						if err != nil {
							return r, err
						}
						wv, err := tp.Constant(wd)
						if err != nil {
							return r, err
						}
						if y, err = MatMul(flat, wv); err != nil {
							return r, err
						}
					}
					l, err := probe(ctx, y)
					if err != nil {
						return r, err
					}
					if err := tp.Backward(ctx, l); err != nil {
						return r, err
					}
					for _, v := range vs {
						g, err := fullData(ctx, v.Grad())
						if err != nil {
							return r, err
						}
						r.grads = append(r.grads, g)
						r.specs = append(r.specs, v.Grad().Spec().String())
					}
					return r, nil
				}
				fused, err := do(CausalAttention)
				if err != nil {
					return fmt.Errorf("fused: %w", err)
				}
				comp, err := do(composedAttention)
				if err != nil {
					return fmt.Errorf("composed: %w", err)
				}
				if fused.ops != 1 || comp.ops != 5 {
					t.Errorf("fused attention recorded %d ops, composition %d; want 1 and 5", fused.ops, comp.ops)
				}
				compareRuns(t, "result", fused.out, comp.out, 2e-6)
				for i := range 3 {
					compareRuns(t, fmt.Sprint("grad ", i), fused.grads[i], comp.grads[i], 1e-5)
					if fused.specs[i] != comp.specs[i] {
						t.Errorf("grad %d laid out %s, composition %s", i, fused.specs[i], comp.specs[i])
					}
				}
				return nil
			})
		})
	}
}

// trainGraph is a small float32 model using every fast path: LayerNorm,
// Linear with bias, GELU, fused attention, permutes, SplitLast, residual
// adds and CrossEntropy. It returns the loss and an intermediate result.
func trainGraph(tp *Tape, ps []*Value, tg *Indices) (loss, mid *Value, err error) {
	f := forwardChain{}
	h := ps[0] // [2, 4, 6] tokens
	a := f.v(LayerNorm(h, ps[1], ps[2], 1e-5))
	qkv := f.v(Linear(a, ps[3], ps[4])) // [2, 4, 18]
	var parts []*Value
	if f.err == nil {
		parts, f.err = SplitLast(qkv, 3)
	}
	heads := func(i int) *Value {
		if f.err != nil {
			return nil
		}
		r := f.v(Reshape(parts[i], 2, 4, 2, 3))
		return f.v(Permute(r, 0, 2, 1, 3))
	}
	q, k, v := heads(0), heads(1), heads(2)
	var o *Value
	if f.err == nil {
		o = f.v(CausalAttention(q, k, v))
		o = f.v(Permute(o, 0, 2, 1, 3))
		o = f.v(Reshape(o, 2, 4, 6))
		h = f.v(Add(h, o))
		mid = f.v(GELU(h))
		h = f.v(Add(h, mid))
		h = f.v(Reshape(h, 8, 6))
		loss = f.v(CrossEntropy(h, tg))
	}
	return loss, mid, f.err
}

type forwardChain struct{ err error }

func (f *forwardChain) v(v *Value, err error) *Value {
	if f.err != nil {
		return nil
	}
	f.err = err
	return v
}

func trainParams(t *testing.T, tp *Tape, m *mesh.Mesh) []*Value {
	t.Helper()
	var vs []*Value
	for i, shape := range [][]int{{2, 4, 6}, {6}, {6}, {18, 6}, {18}} {
		s, err := placement.NewSpec(m, shape, comm.Float32, pl{R})
		if err != nil {
			t.Fatal(err)
		}
		d, err := placement.FromFull(s, placementtest.Random(shape, comm.Float32, uint64(10+i)))
		if err != nil {
			t.Fatal(err)
		}
		v, err := tp.Param(fmt.Sprint("w", i), d)
		if err != nil {
			t.Fatal(err)
		}
		vs = append(vs, v)
	}
	return vs
}

func block32(dt *placement.DTensor) []float32 {
	d, _ := dt.LocalData().([]float32)
	return d
}

// overlapsArena reports whether d shares memory with a buffer the arena
// has handed out or holds free.
func overlapsArena(a *arena, d []float32) bool {
	if len(d) == 0 {
		return false
	}
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(d)))
	hi := lo + uintptr(len(d))*4
	in := func(p unsafe.Pointer, bytes uintptr) bool {
		b := uintptr(p)
		return b < hi && lo < b+bytes
	}
	for p, b := range a.out {
		if in(p, uintptr(b.n*b.size)) {
			return true
		}
	}
	for _, l := range a.free32 {
		for _, f := range l {
			if in(unsafe.Pointer(unsafe.SliceData(f)), uintptr(len(f))*4) {
				return true
			}
		}
	}
	return false
}

// TestArenaNeverAliasesUserData: results, the loss and leaf gradients that
// a user keeps are not arena memory and do not change when later steps
// reuse the arena; repeated steps give bit-identical gradients (no stale
// scratch leaks into a result); gradients accumulate across Backward
// calls; hooks see stable gradients; nothing stays handed out after
// Backward, and NoGrad passes keep nothing.
func TestArenaNeverAliasesUserData(t *testing.T) {
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		tp := NewTape()
		ps := trainParams(t, tp, m)
		tg, err := IndicesFromFull(m, []int{8}, pl{R}, []int64{0, 5, 2, 2, 1, 3, 4, 0})
		if err != nil {
			return err
		}
		var hooked []*placement.DTensor
		if err := ps[3].OnGradReady(func(_ context.Context, v *Value) error { hooked = append(hooked, v.Grad()); return nil }); err != nil {
			return err
		}
		step := func() (loss, mid *Value, grads []*placement.DTensor) {
			l, mid, err := trainGraph(tp, ps, tg)
			if err != nil {
				t.Fatal(err)
			}
			if err := tp.Backward(ctx, l); err != nil {
				t.Fatal(err)
			}
			if n := len(tp.arena.out); n != 0 {
				t.Fatalf("%d arena buffers handed out after Backward", n)
			}
			for _, p := range ps {
				grads = append(grads, p.Grad())
			}
			return l, mid, grads
		}
		l1, mid1, g1 := step()
		keepLoss := slices.Clone(block32(l1.Data()))
		keepMid := slices.Clone(block32(mid1.Data()))
		var keepGrads [][]float32
		for i, g := range g1 {
			keepGrads = append(keepGrads, slices.Clone(block32(g)))
			if overlapsArena(tp.arena, block32(g)) {
				t.Errorf("gradient of param %d is arena memory", i)
			}
		}
		if overlapsArena(tp.arena, block32(l1.Data())) || overlapsArena(tp.arena, block32(mid1.Data())) {
			t.Errorf("the loss or an op result is arena memory")
		}
		// Accumulation: a second Backward without ZeroGrad doubles the
		// gradients (same data), leaving the first step's tensors alone.
		_, _, g2 := step()
		for i, g := range g2 {
			for j, v := range block32(g) {
				if want := 2 * keepGrads[i][j]; math.Abs(float64(v-want)) > 1e-6*max(1, math.Abs(float64(want))) {
					t.Fatalf("param %d: accumulated gradient[%d] = %g, want %g", i, j, v, want)
				}
			}
		}
		// Fresh steps reuse the arena and reproduce step 1 bit for bit.
		for range 3 {
			for _, p := range ps {
				p.ZeroGrad()
			}
			_, _, g := step()
			for i := range g {
				if !slices.Equal(block32(g[i]), keepGrads[i]) {
					t.Fatalf("param %d: gradient differs from the first step's", i)
				}
			}
		}
		// What the user kept from step 1 is untouched.
		if !slices.Equal(block32(l1.Data()), keepLoss) || !slices.Equal(block32(mid1.Data()), keepMid) {
			t.Errorf("the first step's loss or result changed in later steps")
		}
		for i, g := range g1 {
			if !slices.Equal(block32(g), keepGrads[i]) {
				t.Errorf("param %d: the first step's gradient tensor changed in later steps", i)
			}
		}
		if len(hooked) != 5 || !slices.Equal(block32(hooked[0]), keepGrads[3]) {
			t.Errorf("hooks saw %d gradients; the first no longer holds step 1's values", len(hooked))
		}
		// NoGrad forward passes keep no scratch.
		err = tp.NoGrad(func() error {
			for range 3 {
				if _, _, err := trainGraph(tp, ps, tg); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		if n := len(tp.arena.out); n != 0 {
			t.Errorf("%d arena buffers handed out after NoGrad passes", n)
		}
		// Reset without Backward returns what the forward took.
		if _, _, err := trainGraph(tp, ps, tg); err != nil {
			return err
		}
		if len(tp.arena.out) == 0 {
			t.Errorf("a recorded forward saved nothing in the arena")
		}
		tp.Reset()
		if n := len(tp.arena.out); n != 0 {
			t.Errorf("%d arena buffers handed out after Reset", n)
		}
		return nil
	})
}

// TestInPlaceAccumulationRespectsAliases: a LocalFunc whose Backward
// returns the output's gradient block itself for one input, while the
// other input's pending gradient is that same block (an Add fanned it
// out), must not see it modified by in-place accumulation. The graph is
// L = Σ c⊙(f(a, b) + a) with f(a, b) = a + b, a = 1·p and b = 1·q, so
// dL/dp = 2c and dL/dq = c.
func TestInPlaceAccumulationRespectsAliases(t *testing.T) {
	for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
		simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
			tp := NewTape()
			shape := []int{3, 5}
			mk := func(seed uint64) (*Value, error) {
				s, err := placement.NewSpec(m, shape, dt, pl{R})
				if err != nil {
					return nil, err
				}
				d, err := placement.FromFull(s, placementtest.Random(shape, dt, seed))
				if err != nil {
					return nil, err
				}
				return tp.Param(fmt.Sprint("p", seed), d)
			}
			p, err := mk(1)
			if err != nil {
				return err
			}
			q, err := mk(2)
			if err != nil {
				return err
			}
			a, err := Scale(p, 1)
			if err != nil {
				return err
			}
			b, err := Scale(q, 1)
			if err != nil {
				return err
			}
			var y *Value
			if dt == comm.Float32 {
				y, err = passThrough[float32]().Apply(a, b)
			} else {
				y, err = passThrough[float64]().Apply(a, b)
			}
			if err != nil {
				return err
			}
			h, err := Add(y, a)
			if err != nil {
				return err
			}
			// L = Σ h⊙c: Mul's backward puts h's gradient in the arena, so
			// in-place accumulation is on the table for a.
			cd, err := placement.FromFull(p.Spec(), placementtest.Random(shape, dt, 1234))
			if err != nil {
				return err
			}
			cv, err := tp.Constant(cd)
			if err != nil {
				return err
			}
			hc, err := Mul(h, cv)
			if err != nil {
				return err
			}
			l, err := Sum(hc)
			if err != nil {
				return err
			}
			if err := tp.Backward(ctx, l); err != nil {
				return err
			}
			gp, err := fullData(ctx, p.Grad())
			if err != nil {
				return err
			}
			gq, err := fullData(ctx, q.Grad())
			if err != nil {
				return err
			}
			cf, err := fullData(ctx, cd)
			if err != nil {
				return err
			}
			for i, w := range cf {
				if math.Abs(gp[i]-2*w) > 1e-6 || math.Abs(gq[i]-w) > 1e-6 {
					t.Fatalf("%v: element %d: dp = %g (want %g), dq = %g (want %g)", dt, i, gp[i], 2*w, gq[i], w)
				}
			}
			return nil
		})
	}
}

// passThrough is f(a, b) = a + b whose Backward hands the output's
// gradient block itself to b and a copy to a.
func passThrough[T float32 | float64]() LocalFunc[T] {
	return LocalFunc[T]{Name: "pass", In: []pl{{R}, {R}}, GradIn: []pl{{R}, {R}}, Out: pl{R}, GradOut: pl{R},
		Forward: func(in []Block[T]) (Block[T], error) {
			y := make([]T, len(in[0].Data))
			for i := range y {
				y[i] = in[0].Data[i] + in[1].Data[i]
			}
			return Block[T]{Shape: in[0].Shape, Data: y}, nil
		},
		Backward: func(g Block[T], in []Block[T], _ Block[T]) ([]Block[T], error) {
			return []Block[T]{{Shape: g.Shape, Data: slices.Clone(g.Data)}, g}, nil
		},
	}
}

// TestRecycling: a tape made WithRecycling computes the same losses and
// gradients as one that allocates, pass after pass, writing each leaf's
// gradient into the memory ZeroGrad dropped; its results outlive
// Backward and die at Recycle (Data nil, ops refuse them); after a warm-up
// pass a steady loop takes every buffer from the arena (nothing is
// allocated); and Recycle on a tape without the option only resets it.
func TestRecycling(t *testing.T) {
	simulate(t, []int{1}, func(ctx context.Context, m *mesh.Mesh) error {
		tg, err := IndicesFromFull(m, []int{8}, pl{R}, []int64{0, 5, 2, 2, 1, 3, 4, 0})
		if err != nil {
			return err
		}
		rec, plain := NewTape(WithPoisonRecycled()), NewTape()
		rps, pps := trainParams(t, rec, m), trainParams(t, plain, m)
		gradAt := make([]*float32, len(rps))
		var made int
		for pass := range 5 {
			// Vary the input so that a stale result would show.
			for i, v := range block32(rps[0].Data()) {
				block32(rps[0].Data())[i] = v + float32(pass)*0.01
				block32(pps[0].Data())[i] = block32(rps[0].Data())[i]
			}
			rec.Recycle()
			if pass == 2 {
				made = rec.arena.made
			}
			rl, rmid, err := trainGraph(rec, rps, tg)
			if err != nil {
				return err
			}
			pl, pmid, err := trainGraph(plain, pps, tg)
			if err != nil {
				return err
			}
			if !overlapsArena(rec.arena, block32(rmid.Data())) {
				t.Errorf("pass %d: a recycling tape's result is not arena memory", pass)
			}
			for _, tp := range []*Tape{rec, plain} {
				l := map[*Tape]*Value{rec: rl, plain: pl}[tp]
				if err := tp.Backward(ctx, l); err != nil {
					return err
				}
			}
			if !slices.Equal(block32(rl.Data()), block32(pl.Data())) || !slices.Equal(block32(rmid.Data()), block32(pmid.Data())) {
				t.Errorf("pass %d: after Backward the loss or a result differs: %v and %v", pass, block32(rl.Data()), block32(pl.Data()))
			}
			for i := range rps {
				if !slices.Equal(block32(rps[i].Grad()), block32(pps[i].Grad())) {
					t.Errorf("pass %d: param %d: gradient differs from an allocating tape's", pass, i)
				}
				// ZeroGrad kept the memory, and Backward wrote into it.
				if at := &block32(rps[i].Grad())[0]; pass == 0 {
					gradAt[i] = at
				} else if at != gradAt[i] {
					t.Errorf("pass %d: param %d: the gradient moved to new memory", pass, i)
				}
				rps[i].ZeroGrad()
				pps[i].ZeroGrad()
			}
			if pass == 4 {
				rec.Recycle()
				if rmid.Data() != nil || rmid.Spec() != nil {
					t.Errorf("a recycled value keeps its data")
				}
				if _, err := Scale(rmid, 2); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "recycled") {
					t.Errorf("Scale of a recycled value: %v", err)
				}
				if rps[0].Data() == nil || rps[0].Grad() != nil {
					t.Errorf("Recycle touched a leaf")
				}
				plain.Recycle()
				if pmid.Data() == nil {
					t.Errorf("Recycle on a tape without WithRecycling dropped a value")
				}
			}
		}
		if n := rec.arena.made - made; n != 0 {
			t.Errorf("steady passes allocated %d buffers instead of reusing the arena's", n)
		}
		return nil
	})
}

// TestCustomBlocks: ResultBlock is fresh memory on an ordinary tape and
// arena memory on a recycling one, ScratchBlock arena memory on both, and
// neither returns nil or panics for n <= 0 or a nil tape.
func TestCustomBlocks(t *testing.T) {
	plain, rec := NewTape(), NewTape(WithRecycling())
	for _, n := range []int{-1, 0} {
		if b := ResultBlock[float32](rec, n); b == nil || len(b) != 0 {
			t.Errorf("ResultBlock(%d) = %v", n, b)
		}
		if b := ScratchBlock[float64](nil, n); b == nil || len(b) != 0 {
			t.Errorf("ScratchBlock(nil, %d) = %v", n, b)
		}
	}
	if b := ResultBlock[float32](plain, 5); len(b) != 5 || overlapsArena(plain.arena, b) {
		t.Errorf("an ordinary tape's result block is arena memory")
	}
	if b := ResultBlock[float32](rec, 5); len(b) != 5 || !overlapsArena(rec.arena, b) {
		t.Errorf("a recycling tape's result block is not arena memory")
	}
	if b := ScratchBlock[float32](plain, 5); len(b) != 5 || !overlapsArena(plain.arena, b) {
		t.Errorf("a scratch block is not arena memory")
	}
	if b := ResultBlock[float32](nil, 3); len(b) != 3 {
		t.Errorf("ResultBlock(nil tape) = %v", b)
	}
}
