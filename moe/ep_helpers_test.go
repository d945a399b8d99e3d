package moe_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/moe"
	"github.com/b7ea7098/loom/placement"
)

// epFixture is moe_layer.safetensors (reference/MOE_LAYER.md §5), everything the
// expert-parallel tests compare with.
type epFixture struct {
	n, d, e, k, hd              int
	alpha, beta                 float64
	x, g, wr, w1, b1, w2, b2    []float32
	gate, y                     []float32
	topk                        []int64
	aux, zloss, l               float64
	dx, dwr, dw1, db1, dw2, db2 []float32
}

// epLoadFixture reads the embedded MoE reference fixture.
func epLoadFixture(t *testing.T) *epFixture {
	t.Helper()
	f := moe.OpenMoEReference(t)
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
	ts, err := f.Tensor("topk_idx")
	if err != nil {
		t.Fatal(err)
	}
	topk, err := ts.Int64s()
	if err != nil {
		t.Fatal(err)
	}
	fx := &epFixture{
		n: 64, d: 32, e: 8, k: 2, hd: 64, alpha: 0.01, beta: 0.001,
		x: f32("x"), g: f32("G"), wr: f32("Wr"), w1: f32("W1"), b1: f32("b1"), w2: f32("W2"), b2: f32("b2"),
		gate: f32("gate_w"), y: f32("y"), topk: topk,
		aux: float64(f32("aux")[0]), zloss: float64(f32("zloss")[0]), l: float64(f32("L")[0]),
		dx: f32("grad.x"), dwr: f32("grad.Wr"), dw1: f32("grad.W1"), db1: f32("grad.b1"), dw2: f32("grad.W2"), db2: f32("grad.b2"),
	}
	info, err := f.Info("W1")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(info.Shape, []int{fx.e, fx.hd, fx.d}) || len(fx.x) != fx.n*fx.d || len(topk) != fx.n*fx.k {
		t.Fatalf("fixture sizes differ from reference/MOE_LAYER.md §1 (W1 %v)", info.Shape)
	}
	return fx
}

// epMesh is a simulated mesh for the expert-parallel tests: the tokens are
// Shard(0) on every axis but "tp", which replicates them.
type epMesh struct {
	name  string
	shape []int
	names []string
}

func (c epMesh) tokenPlaces() []placement.Placement {
	out := make([]placement.Placement, len(c.names))
	for a, n := range c.names {
		out[a] = placement.Shard(0)
		if n == "tp" {
			out[a] = placement.Replicate()
		}
	}
	return out
}

func replicated(m *mesh.Mesh) []placement.Placement {
	out := make([]placement.Placement, m.NDim())
	for a := range out {
		out[a] = placement.Replicate()
	}
	return out
}

func dtypeOf[T float32 | float64]() comm.DType {
	var z T
	if _, ok := any(z).(float32); ok {
		return comm.Float32
	}
	return comm.Float64
}

// epValue lays out full (every rank passes the same) and makes a parameter
// (param) or a constant of it.
func epValue[T float32 | float64](tape *autograd.Tape, m *mesh.Mesh, name string, shape []int, places []placement.Placement, full []T, param bool) (*autograd.Value, error) {
	spec, err := placement.NewSpec(m, shape, dtypeOf[T](), places)
	if err != nil {
		return nil, err
	}
	dt, err := placement.FromFull(spec, full)
	if err != nil {
		return nil, err
	}
	if param {
		return tape.Param(name, dt)
	}
	return tape.Constant(dt)
}

// epFull materialises a tensor's global data as float64 (collective).
func epFull(ctx context.Context, dt *placement.DTensor) ([]float64, error) {
	if dt == nil {
		return nil, fmt.Errorf("nil tensor (no gradient?)")
	}
	d, err := dt.Full(ctx)
	if err != nil {
		return nil, err
	}
	switch v := d.(type) {
	case []float32:
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out, nil
	case []float64:
		return v, nil
	}
	return nil, fmt.Errorf("full data of type %T", d)
}

func f64[T float32 | float64](v []T) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// relL2 is ‖got − want‖ / ‖want‖ (‖got‖ when want is zero).
func relL2(got, want []float64) float64 {
	if len(got) != len(want) {
		return math.Inf(1)
	}
	var num, den, g2 float64
	for i := range got {
		d := got[i] - want[i]
		num += d * d
		den += want[i] * want[i]
		g2 += got[i] * got[i]
	}
	if den == 0 {
		return math.Sqrt(g2)
	}
	return math.Sqrt(num / den)
}

func maxAbs(got, want []float64) float64 {
	m := 0.0
	for i := range got {
		m = max(m, math.Abs(got[i]-want[i]))
	}
	return m
}

// epRef is a serial float64 MoE computation: the layer output, and the
// gradients of Σ y·G with respect to x (through the experts only), the
// gates and the expert parameters.
type epRef struct {
	y, dx, dgates, dw1, db1, dw2, db2 []float64
}

func gelu(u float64) (float64, float64) {
	phi := 0.5 * (1 + math.Erf(u/math.Sqrt2))
	return u * phi, phi + u*math.Exp(-0.5*u*u)/math.Sqrt(2*math.Pi)
}

// epReference computes epRef for n tokens of width d, slots experts [n·k]
// (−1: not combined), gates [n·k], experts of hidden width hd.
func epReference(n, d, e, k, hd int, x []float64, experts []int32, gates, w1, b1, w2, b2, g []float64) epRef {
	r := epRef{
		y: make([]float64, n*d), dx: make([]float64, n*d), dgates: make([]float64, n*k),
		dw1: make([]float64, e*hd*d), db1: make([]float64, e*hd), dw2: make([]float64, e*d*hd), db2: make([]float64, e*d),
	}
	u, h, hp, o := make([]float64, hd), make([]float64, hd), make([]float64, hd), make([]float64, d)
	du := make([]float64, hd)
	for t := range n {
		xt, gt := x[t*d:(t+1)*d], g[t*d:(t+1)*d]
		for j := range k {
			ex := int(experts[t*k+j])
			if ex < 0 {
				continue
			}
			gw := gates[t*k+j]
			for a := range hd {
				s := b1[ex*hd+a]
				for b := range d {
					s += w1[(ex*hd+a)*d+b] * xt[b]
				}
				u[a] = s
				h[a], hp[a] = gelu(s)
			}
			dot := 0.0
			for a := range d {
				s := b2[ex*d+a]
				for b := range hd {
					s += w2[(ex*d+a)*hd+b] * h[b]
				}
				o[a] = s
				r.y[t*d+a] += gw * s
				dot += gt[a] * s
			}
			r.dgates[t*k+j] = dot
			clear(du)
			for a := range d {
				dO := gw * gt[a]
				r.db2[ex*d+a] += dO
				for b := range hd {
					r.dw2[(ex*d+a)*hd+b] += dO * h[b]
					du[b] += w2[(ex*d+a)*hd+b] * dO
				}
			}
			for a := range hd {
				du[a] *= hp[a]
				r.db1[ex*hd+a] += du[a]
				for b := range d {
					r.dw1[(ex*hd+a)*d+b] += du[a] * xt[b]
					r.dx[t*d+b] += w1[(ex*hd+a)*d+b] * du[a]
				}
			}
		}
	}
	return r
}

// epCase is a synthetic dispatch case: sizes, the routing of every global
// token (slots [N·K], −1 for no expert) and random data.
type epCase struct {
	n, d, e, k, hd int
	experts        []int32
	x, gates, g    []float64
	w1, b1, w2, b2 []float64
}

// epRandom fills a case's data from seed (values in [−1, 1), weights
// scaled by 0.3).
func epRandom(n, d, e, k, hd int, experts []int32, seed uint64) epCase {
	s := seed*0x9E3779B97F4A7C15 + 1
	rnd := func(m int, scale float64) []float64 {
		out := make([]float64, m)
		for i := range out {
			s ^= s << 13
			s ^= s >> 7
			s ^= s << 17
			out[i] = scale * (float64(s%2000000)/1000000 - 1)
		}
		return out
	}
	return epCase{
		n: n, d: d, e: e, k: k, hd: hd, experts: experts,
		x: rnd(n*d, 1), gates: rnd(n*k, 1), g: rnd(n*d, 1),
		w1: rnd(e*hd*d, 0.3), b1: rnd(e*hd, 0.3), w2: rnd(e*d*hd, 0.3), b2: rnd(e*d, 0.3),
	}
}

// epInputs records c's tokens [n, D] (a parameter) and gates [n, K] (a
// parameter when gatesGrad) on tape, both laid out by places, and returns
// them with this rank's Routing of the tokens.
func epInputs(tape *autograd.Tape, m *mesh.Mesh, c epCase, places []placement.Placement, gatesGrad bool) (x, gates *autograd.Value, r *moe.Routing, err error) {
	if x, err = epValue(tape, m, "x", []int{c.n, c.d}, places, c.x, true); err != nil {
		return nil, nil, nil, err
	}
	if gates, err = epValue(tape, m, "gates", []int{c.n, c.k}, places, c.gates, gatesGrad); err != nil {
		return nil, nil, nil, err
	}
	r, err = epLocalRouting(c, x.Spec(), m, gates)
	return x, gates, r, err
}

// epLocalRouting builds this rank's Routing from the global slots: the
// rank's tokens are its Shard(0) box of x's spec; gates is a value laid out
// like the tokens.
func epLocalRouting(c epCase, xs *placement.Spec, m *mesh.Mesh, gates *autograd.Value) (*moe.Routing, error) {
	off, size, err := xs.Box(m.Rank())
	if err != nil {
		return nil, err
	}
	counts := make([]int64, c.e)
	for _, ex := range c.experts {
		if ex >= 0 {
			counts[ex]++
		}
	}
	return &moe.Routing{
		NumExperts: c.e, K: c.k,
		Experts: slices.Clone(c.experts[off[0]*c.k : (off[0]+size[0])*c.k]),
		Gates:   gates,
		Counts:  counts,
	}, nil
}

// epRun is one pass of Dispatch → Experts → Combine over a case on a
// mesh, with the loss Σ y·G, and its results gathered on every rank.
type epRun struct {
	y, dx, dgates, dw1, db1, dw2, db2 []float64
	stats                             moe.Stats
	handle                            *moe.Handle
}

// epPass runs the case in dtype T on mesh m with the tokens laid out by
// places over the expert-parallel axis "ep".
func epPass[T float32 | float64](ctx context.Context, m *mesh.Mesh, places []placement.Placement, c epCase, cfg moe.DispatchConfig) (*epRun, error) {
	tape := autograd.NewTape()
	conv := func(v []float64) []T {
		out := make([]T, len(v))
		for i, x := range v {
			out[i] = T(x)
		}
		return out
	}
	x, err := epValue(tape, m, "x", []int{c.n, c.d}, places, conv(c.x), true)
	if err != nil {
		return nil, err
	}
	gates, err := epValue(tape, m, "gates", []int{c.n, c.k}, places, conv(c.gates), true)
	if err != nil {
		return nil, err
	}
	gc, err := epValue(tape, m, "G", []int{c.n, c.d}, places, conv(c.g), false)
	if err != nil {
		return nil, err
	}
	ep := make([]placement.Placement, m.NDim())
	for a, n := range m.Names() {
		ep[a] = placement.Replicate()
		if n == "ep" {
			ep[a] = placement.Shard(0)
		}
	}
	var ws [4]*autograd.Value
	for i, w := range []struct {
		name  string
		shape []int
		data  []float64
	}{{"W1", []int{c.e, c.hd, c.d}, c.w1}, {"b1", []int{c.e, c.hd}, c.b1}, {"W2", []int{c.e, c.d, c.hd}, c.w2}, {"b2", []int{c.e, c.d}, c.b2}} {
		if ws[i], err = epValue(tape, m, w.name, w.shape, ep, conv(w.data), true); err != nil {
			return nil, err
		}
	}
	experts, err := moe.NewExperts("ep", ws[0], ws[1], ws[2], ws[3])
	if err != nil {
		return nil, err
	}
	r, err := epLocalRouting(c, x.Spec(), m, gates)
	if err != nil {
		return nil, err
	}
	cfg.Axis = "ep"
	rows, h, err := moe.Dispatch(ctx, x, r, cfg)
	if err != nil {
		return nil, err
	}
	out, err := experts.Forward(ctx, rows, h)
	if err != nil {
		return nil, err
	}
	y, err := moe.Combine(ctx, out, h, gates)
	if err != nil {
		return nil, err
	}
	yg, err := autograd.Mul(y, gc)
	if err != nil {
		return nil, err
	}
	loss, err := autograd.Sum(yg)
	if err != nil {
		return nil, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return nil, err
	}
	run := &epRun{handle: h, stats: h.Stats()}
	for _, f := range []struct {
		dst *[]float64
		dt  *placement.DTensor
	}{{&run.y, y.Data()}, {&run.dx, x.Grad()}, {&run.dgates, gates.Grad()},
		{&run.dw1, ws[0].Grad()}, {&run.db1, ws[1].Grad()}, {&run.dw2, ws[2].Grad()}, {&run.db2, ws[3].Grad()}} {
		v, err := epFull(ctx, f.dt)
		if err != nil {
			return nil, err
		}
		*f.dst = v
	}
	return run, nil
}

// compare checks a run against the serial reference within tol (relative
// L2 per tensor).
func (r *epRun) compare(want epRef, tol float64) error {
	var errs []error
	for _, c := range []struct {
		name      string
		got, want []float64
	}{{"y", r.y, want.y}, {"dx", r.dx, want.dx}, {"dgates", r.dgates, want.dgates},
		{"dW1", r.dw1, want.dw1}, {"db1", r.db1, want.db1}, {"dW2", r.dw2, want.dw2}, {"db2", r.db2, want.db2}} {
		if e := relL2(c.got, c.want); !(e <= tol) {
			errs = append(errs, fmt.Errorf("%s: relative L2 error %.3g > %.3g", c.name, e, tol))
		}
	}
	return errors.Join(errs...)
}
