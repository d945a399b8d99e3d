package moe

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
	"github.com/b7ea7098/loom/reference"
	"github.com/b7ea7098/loom/safetensors"
)

var (
	pR  = placement.Replicate()
	pS0 = placement.Shard(0)
)

type pl = []placement.Placement

// moeFixture is the part of moe_layer.safetensors the router needs, and the
// expert weights for the full-layer gradient check.
type moeFixture struct {
	n, d, e, k, hd      int
	alpha, beta         float64
	x, wr, g            []float32
	w1, b1, w2, b2      []float32
	logits, probs, gate []float32
	topk, counts        []int64
	aux, zloss          float64
	gradX, gradWr       []float32
}

// loadMoEFixture reads the embedded MoE reference fixture.
func loadMoEFixture(t *testing.T) *moeFixture {
	t.Helper()
	f := openMoEReference(t)
	f32 := func(name string) []float32 {
		ts, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		v, err := ts.Float32s()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	i64 := func(name string) []int64 {
		ts, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		v, err := ts.Int64s()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	fx := &moeFixture{
		n: 64, d: 32, e: 8, k: 2, hd: 64, alpha: 0.01, beta: 0.001,
		x: f32("x"), wr: f32("Wr"), g: f32("G"),
		w1: f32("W1"), b1: f32("b1"), w2: f32("W2"), b2: f32("b2"),
		logits: f32("logits"), probs: f32("probs"), gate: f32("gate_w"),
		topk: i64("topk_idx"), counts: i64("tokens_per_expert"),
		aux: float64(f32("aux")[0]), zloss: float64(f32("zloss")[0]),
		gradX: f32("grad.x"), gradWr: f32("grad.Wr"),
	}
	info, err := f.Info("x")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Shape, []int{fx.n, fx.d}) {
		t.Fatalf("fixture x has shape %v, want [%d %d]", info.Shape, fx.n, fx.d)
	}
	return fx
}

// expertTerms returns, for the fixture's routing, c_tj = G_t·o_tj (the
// gradient of Σ y·G with respect to the gate g_tj) and the experts' share
// of ∂L/∂x (through W1), both in float64.
func (fx *moeFixture) expertTerms() (c []float64, dxExpert []float64) {
	n, d, k, hd := fx.n, fx.d, fx.k, fx.hd
	c = make([]float64, n*k)
	dxExpert = make([]float64, n*d)
	gelu := func(u float64) float64 { return 0.5 * u * (1 + math.Erf(u/math.Sqrt2)) }
	dgelu := func(u float64) float64 {
		return 0.5*(1+math.Erf(u/math.Sqrt2)) + u*math.Exp(-u*u/2)/math.Sqrt(2*math.Pi)
	}
	u := make([]float64, hd)
	h := make([]float64, hd)
	for t := range n {
		xt := fx.x[t*d : (t+1)*d]
		gt := fx.g[t*d : (t+1)*d]
		for j := range k {
			e := int(fx.topk[t*k+j])
			for a := range hd {
				s := float64(fx.b1[e*hd+a])
				for b := range d {
					s += float64(fx.w1[(e*hd+a)*d+b]) * float64(xt[b])
				}
				u[a], h[a] = s, gelu(s)
			}
			dot := 0.0
			for b := range d {
				o := float64(fx.b2[e*d+b])
				for a := range hd {
					o += float64(fx.w2[(e*d+b)*hd+a]) * h[a]
				}
				dot += o * float64(gt[b])
			}
			c[t*k+j] = dot
			// dU = (W2ᵀ·(g·G_t)) ⊙ GELU'(u); dx += W1ᵀ·dU.
			g := float64(fx.gate[t*k+j])
			for a := range hd {
				s := 0.0
				for b := range d {
					s += float64(fx.w2[(e*d+b)*hd+a]) * g * float64(gt[b])
				}
				du := s * dgelu(u[a])
				for b := range d {
					dxExpert[t*d+b] += float64(fx.w1[(e*hd+a)*d+b]) * du
				}
			}
		}
	}
	return c, dxExpert
}

func maxAbsDiff[A, B float32 | float64](a []A, b []B) float64 {
	m := 0.0
	for i := range a {
		m = max(m, math.Abs(float64(a[i])-float64(b[i])))
	}
	return m
}

func relL2[A, B float32 | float64](got []A, want []B) float64 {
	num, den := 0.0, 0.0
	for i := range got {
		d := float64(got[i]) - float64(want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
	}
	return math.Sqrt(num / den)
}

func relErr(got, want float64) float64 { return math.Abs(got-want) / math.Abs(want) }

func dtypeOf[T float32 | float64]() comm.DType {
	var z T
	if _, ok := any(z).(float32); ok {
		return comm.Float32
	}
	return comm.Float64
}

// newValue lays out full (row-major over shape) by places on m and makes it
// a parameter (requires grad) on tape.
func newValue[T float32 | float64](tape *autograd.Tape, m *mesh.Mesh, name string, shape []int, places pl, full []T) (*autograd.Value, error) {
	spec, err := placement.NewSpec(m, shape, dtypeOf[T](), places)
	if err != nil {
		return nil, err
	}
	dt, err := placement.FromFull(spec, full)
	if err != nil {
		return nil, err
	}
	return tape.Param(name, dt)
}

// fullOf materialises a value's global data (collective).
func fullOf[T float32 | float64](ctx context.Context, dt *placement.DTensor) ([]T, error) {
	d, err := dt.Full(ctx)
	if err != nil {
		return nil, err
	}
	if v, ok := d.([]T); ok {
		return v, nil
	}
	return nil, fmt.Errorf("full data of type %T", d)
}

// routerLoss is Σ_t Σ_j g_tj·c_tj + Aux + Z (the terms present), c laid
// out like the gates.
func routerLoss[T float32 | float64](tape *autograd.Tape, rt *Routing, c []T) (*autograd.Value, error) {
	cd, err := placement.FromFull(rt.Gates.Spec(), c)
	if err != nil {
		return nil, err
	}
	cv, err := tape.Constant(cd)
	if err != nil {
		return nil, err
	}
	gc, err := autograd.Mul(rt.Gates, cv)
	if err != nil {
		return nil, err
	}
	loss, err := autograd.Sum(gc)
	if err != nil {
		return nil, err
	}
	for _, l := range []*autograd.Value{rt.Aux, rt.Z} {
		if l != nil {
			if loss, err = autograd.Add(loss, l); err != nil {
				return nil, err
			}
		}
	}
	return loss, nil
}

// routerRun is everything one routing produced, gathered to global arrays.
type routerRun struct {
	experts         []int32
	gates           []float64
	aux, z          float64 // NaN when nil
	counts          []int64
	dropped, padded int64
	capacity        map[int]int // first local token -> capacity
	dW, dx          []float64
	logits, scores  []float64
	allReduces      uint64 // collectives on the token communicator during Route
}

// runConfig describes one routing run.
type runConfig struct {
	mesh   []int
	names  []string
	places pl // of x
	cfg    RouterConfig
	bias   []float64
	n, d   int
	x, w   []float64 // full, row-major
	c      []float64 // [n, K] upstream weights of the gates
	noGrad bool
}

// runRouter routes rc.x on a simulated mesh in dtype T, runs Backward of
// routerLoss and gathers the results (every rank checks that what should
// be identical is).
func runRouter[T float32 | float64](t *testing.T, rc runConfig) *routerRun {
	t.Helper()
	var mu sync.Mutex
	e := len(rc.w) / rc.d
	k := rc.cfg.K
	out := &routerRun{
		experts: make([]int32, rc.n*k), scores: make([]float64, rc.n*e),
		capacity: map[int]int{},
	}
	conv := func(v []float64) []T {
		r := make([]T, len(v))
		for i, x := range v {
			r[i] = T(x)
		}
		return r
	}
	placementtest.Run(t, rc.mesh, rc.names, func(ctx context.Context, m *mesh.Mesh) error {
		tape := autograd.NewTape()
		w, err := newValue(tape, m, "Wr", []int{e, rc.d}, slices.Repeat(pl{pR}, len(rc.mesh)), conv(rc.w))
		if err != nil {
			return err
		}
		x, err := newValue(tape, m, "x", []int{rc.n, rc.d}, rc.places, conv(rc.x))
		if err != nil {
			return err
		}
		r, err := NewRouter(w, rc.cfg)
		if err != nil {
			return err
		}
		if rc.bias != nil {
			if err := r.SetExpertBias(rc.bias); err != nil {
				return err
			}
		}
		var tokenComm comm.Communicator
		var axes []string
		for a, p := range rc.places {
			if p.IsShard() {
				axes = append(axes, rc.names[a])
			}
		}
		if len(axes) > 0 {
			if tokenComm, err = m.Group(ctx, axes...); err != nil {
				return err
			}
		}
		before := uint64(0)
		if tokenComm != nil {
			before = tokenComm.Recorder().Snapshot().Total
		}
		rt, err := r.Route(ctx, x)
		if err != nil {
			return err
		}
		calls := uint64(0)
		if tokenComm != nil {
			calls = tokenComm.Recorder().Snapshot().Total - before
		}
		off, size, err := x.Spec().Box(m.Rank())
		if err != nil {
			return err
		}
		if len(rt.Experts) != size[0]*k || rt.K != k || rt.NumExperts != e {
			return fmt.Errorf("routing of %d slots (K %d, E %d) for %d local tokens", len(rt.Experts), rt.K, rt.NumExperts, size[0])
		}
		gates, err := fullOf[T](ctx, rt.Gates.Data())
		if err != nil {
			return err
		}
		logits, err := fullOf[T](ctx, rt.logits.Data())
		if err != nil {
			return err
		}
		scalar := func(v *autograd.Value) (float64, error) {
			if v == nil {
				return math.NaN(), nil
			}
			if s := v.Spec().Shape(); len(s) != 0 {
				return 0, fmt.Errorf("loss of shape %v, want a scalar []", s)
			}
			f, err := fullOf[T](ctx, v.Data())
			if err != nil {
				return 0, err
			}
			return float64(f[0]), nil
		}
		aux, err := scalar(rt.Aux)
		if err != nil {
			return err
		}
		z, err := scalar(rt.Z)
		if err != nil {
			return err
		}
		var dW, dx []T
		if !rc.noGrad {
			loss, err := routerLoss(tape, rt, conv(rc.c))
			if err != nil {
				return err
			}
			if err := tape.Backward(ctx, loss); err != nil {
				return err
			}
			if dW, err = fullOf[T](ctx, w.Grad()); err != nil {
				return err
			}
			if dx, err = fullOf[T](ctx, x.Grad()); err != nil {
				return err
			}
		}
		mu.Lock()
		defer mu.Unlock()
		copy(out.experts[off[0]*k:], rt.Experts)
		zl, ok := rt.logits.Data().LocalData().([]T)
		if !ok {
			return fmt.Errorf("logits of type %T", rt.logits.Data().LocalData())
		}
		for t := range size[0] {
			scoreRow(rt.score, zl[t*e:(t+1)*e], out.scores[(off[0]+t)*e:(off[0]+t+1)*e])
		}
		if size[0] > 0 {
			out.capacity[off[0]] = rt.Capacity
		}
		if out.counts == nil {
			out.counts, out.dropped, out.padded = slices.Clone(rt.Counts), rt.Dropped, rt.Padded
			out.gates, out.logits = toF64(gates), toF64(logits)
			out.aux, out.z = aux, z
			out.dW, out.dx = toF64(dW), toF64(dx)
			out.allReduces = calls
			return nil
		}
		if !slices.Equal(out.counts, rt.Counts) || out.dropped != rt.Dropped || out.padded != rt.Padded {
			return fmt.Errorf("rank %d: counts %v, dropped %d, padded %d; another rank has %v, %d, %d", m.Rank(), rt.Counts, rt.Dropped, rt.Padded, out.counts, out.dropped, out.padded)
		}
		if calls != out.allReduces {
			return fmt.Errorf("rank %d issued %d collectives, another %d", m.Rank(), calls, out.allReduces)
		}
		return nil
	})
	return out
}

func toF64[T float32 | float64](v []T) []float64 {
	if v == nil {
		return nil
	}
	r := make([]float64, len(v))
	for i, x := range v {
		r[i] = float64(x)
	}
	return r
}

func f64s(v []float32) []float64 { return toF64(v) }

// fixtureConfig is the reference layer's router.
func fixtureConfig(fx *moeFixture) RouterConfig {
	return RouterConfig{K: fx.k, Renormalize: true, AuxCoef: fx.alpha, ZCoef: fx.beta}
}

// TestRouterFixture checks the router against PyTorch's numbers on one rank
// (reference/MOE_LAYER.md §8), including ∂L/∂Wr and ∂L/∂x of the whole layer, the
// experts' terms computed here in float64 from the fixture's weights.
func TestRouterFixture(t *testing.T) {
	fx := loadMoEFixture(t)
	c, dxExpert := fx.expertTerms()
	got := runRouter[float32](t, runConfig{
		mesh: []int{1}, names: []string{"ep"}, places: pl{pR}, cfg: fixtureConfig(fx),
		n: fx.n, d: fx.d, x: f64s(fx.x), w: f64s(fx.wr), c: c,
	})
	if d := maxAbsDiff(got.logits, fx.logits); d > 1e-6 {
		t.Errorf("logits: max abs difference %.3g > 1e-6", d)
	}
	if d := maxAbsDiff(got.scores, fx.probs); d > 1e-6 {
		t.Errorf("probs: max abs difference %.3g > 1e-6", d)
	}
	for i, e := range got.experts {
		if int64(e) != fx.topk[i] {
			t.Fatalf("topk_idx[%d][%d] = %d, reference %d", i/fx.k, i%fx.k, e, fx.topk[i])
		}
	}
	if !slices.Equal(got.counts, fx.counts) {
		t.Errorf("tokens per expert %v, reference %v", got.counts, fx.counts)
	}
	if got.dropped != 0 || got.padded != 0 {
		t.Errorf("dropless routing dropped %d, padded %d", got.dropped, got.padded)
	}
	if d := maxAbsDiff(got.gates, fx.gate); d > 1e-6 {
		t.Errorf("gate_w: max abs difference %.3g > 1e-6", d)
	}
	if e := relErr(got.aux/fx.alpha, fx.aux); e > 1e-5 {
		t.Errorf("aux %v, reference %v: relative error %.3g > 1e-5", got.aux/fx.alpha, fx.aux, e)
	}
	if e := relErr(got.z/fx.beta, fx.zloss); e > 1e-5 {
		t.Errorf("zloss %v, reference %v: relative error %.3g > 1e-5", got.z/fx.beta, fx.zloss, e)
	}
	if e := relL2(got.dW, fx.gradWr); e > 1e-4 {
		t.Errorf("∂L/∂Wr: relative L2 error %.3g > 1e-4", e)
	}
	dx := slices.Clone(got.dx)
	for i := range dx {
		dx[i] += dxExpert[i]
	}
	if e := relL2(dx, fx.gradX); e > 1e-4 {
		t.Errorf("∂L/∂x (router + experts): relative L2 error %.3g > 1e-4", e)
	}
	if got.allReduces != 0 {
		t.Errorf("one rank issued %d collectives", got.allReduces)
	}
	t.Logf("max abs: logits %.2g, probs %.2g, gates %.2g; relative: aux %.2g, zloss %.2g; relative L2: ∂Wr %.2g, ∂x %.2g",
		maxAbsDiff(got.logits, fx.logits), maxAbsDiff(got.scores, fx.probs), maxAbsDiff(got.gates, fx.gate),
		relErr(got.aux/fx.alpha, fx.aux), relErr(got.z/fx.beta, fx.zloss), relL2(got.dW, fx.gradWr), relL2(dx, fx.gradX))
}

// TestRouterShardedFixture routes the fixture's tokens sharded over 2, 4
// and 8 ranks, and on 2-D meshes, and expects the one-rank routing, losses
// and gradients, with one all-reduce per Route.
func TestRouterShardedFixture(t *testing.T) {
	fx := loadMoEFixture(t)
	c, _ := fx.expertTerms()
	base := runConfig{cfg: fixtureConfig(fx), n: fx.n, d: fx.d, x: f64s(fx.x), w: f64s(fx.wr), c: c}
	one := base
	one.mesh, one.names, one.places = []int{1}, []string{"ep"}, pl{pR}
	want := runRouter[float32](t, one)
	for _, m := range []struct {
		mesh   []int
		names  []string
		places pl
	}{
		{[]int{2}, []string{"ep"}, pl{pS0}},
		{[]int{4}, []string{"ep"}, pl{pS0}},
		{[]int{8}, []string{"ep"}, pl{pS0}},
		{[]int{2, 2}, []string{"dp", "tp"}, pl{pS0, pR}},
		{[]int{2, 2}, []string{"ep", "dp"}, pl{pS0, pS0}},
		{[]int{3}, []string{"ep"}, pl{pS0}}, // 22 + 22 + 20 tokens
	} {
		t.Run(fmt.Sprintf("%v%v", m.names, m.mesh), func(t *testing.T) {
			rc := base
			rc.mesh, rc.names, rc.places = m.mesh, m.names, m.places
			got := runRouter[float32](t, rc)
			if !slices.Equal(got.experts, want.experts) {
				t.Errorf("experts differ from one rank's")
			}
			if !slices.Equal(got.counts, want.counts) {
				t.Errorf("counts %v, one rank %v", got.counts, want.counts)
			}
			// The logits' GEMM may round differently for fewer rows.
			if d := maxAbsDiff(got.gates, want.gates); d > 1e-6 {
				t.Errorf("gates differ from one rank's by %.3g", d)
			}
			if e := relErr(got.aux, want.aux); e > 1e-6 {
				t.Errorf("aux %v, one rank %v", got.aux, want.aux)
			}
			if e := relErr(got.z, want.z); e > 1e-6 {
				t.Errorf("z-loss %v, one rank %v", got.z, want.z)
			}
			if e := relL2(got.dW, want.dW); e > 1e-6 {
				t.Errorf("∂/∂Wr: relative L2 error %.3g against one rank", e)
			}
			if e := relL2(got.dx, want.dx); e > 1e-6 {
				t.Errorf("∂/∂x: relative L2 error %.3g against one rank", e)
			}
			if got.allReduces != 1 {
				t.Errorf("Route issued %d collectives on the token communicator, want 1", got.allReduces)
			}
		})
	}
}

// openMoEReference opens the embedded moe_layer.safetensors after checking
// it against the SHA-256 that moe_layer.json records.
func openMoEReference(t *testing.T) *safetensors.File {
	t.Helper()
	data, err := reference.ReadFile(reference.MoESafetensors)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := reference.ReadFile(reference.MoEJSON)
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		SHA256 string `json:"safetensors_sha256"`
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if s := sha256.Sum256(data); hex.EncodeToString(s[:]) != doc.SHA256 {
		t.Fatalf("%s does not match the SHA-256 in %s", reference.MoESafetensors, reference.MoEJSON)
	}
	f, err := safetensors.Read(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}
