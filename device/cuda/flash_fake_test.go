//go:build linux && (amd64 || arm64)

package cuda

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// flashTol are the tolerances of the fused attention against package
// kernels' float64-softmax CPU attention and against the reference device
// path (cuBLAS GEMMs and the causal softmax kernel). The fused kernels
// compute scores, exps and sums in float32, online (tile by tile, with a
// rescaling per tile): with q, k, v, g in [−1, 1) and scale 1/√dh, out
// within 2e-5 absolute plus 1e-4 relative, the saved log-sum-exp within
// 2e-5 (≈ 2⁻¹⁵: float32 rounding of a value below 8 plus expf's error),
// gradients (sums of up to T products of both signs, up to about 10 at
// T = 129) within 5e-5 absolute plus 2e-4 relative. bfloat16 inputs are
// exact in float32, so the extra errors are the rounding of each output to
// bfloat16 (2⁻⁹ relative, taken as 4e-3) and, in dq and dk, the backward's
// row sums D = Σ_c g_c·out_c read from the bfloat16 out: D is off by up to
// 2⁻⁹·Σ_c|g_c·out_c| (below 0.1 here), which reaches dq_i as
// scale·Σ_j p_ij·δD·k_j, taken as 2e-3 absolute (seen: up to 8e-4).
var (
	flashOut  = tol{1e-4, 2e-5}
	flashLSE  = tol{0, 2e-5}
	flashGrad = tol{2e-4, 5e-5}
)

// flashShapes are the shapes of TestFakeFlashAttention: T {1, 7, 64, 129}
// (one key; part of a 32-key tile; two whole tiles; four tiles and one key,
// with row tiles of 8 queries ending mid key tile) × head widths {8, 24, 64}
// × batch·heads {1, 6}, in float32; a few in bfloat16, the widest rows (128),
// and value rows narrower and wider than the query rows.
func flashShapes() []struct {
	s  device.AttnShape
	dt comm.DType
} {
	var out []struct {
		s  device.AttnShape
		dt comm.DType
	}
	add := func(b, t, dh, dv int, dt comm.DType) {
		out = append(out, struct {
			s  device.AttnShape
			dt comm.DType
		}{device.AttnShape{Batch: b, T: t, DH: dh, DV: dv, Scale: float32(1 / math.Sqrt(float64(dh)))}, dt})
	}
	for _, t := range []int{1, 7, 64, 129} {
		for _, dh := range []int{8, 24, 64} {
			for _, b := range []int{1, 6} {
				add(b, t, dh, dh, comm.Float32)
			}
		}
	}
	add(6, 7, 24, 24, comm.BFloat16)
	add(6, 64, 8, 8, comm.BFloat16)
	add(1, 129, 64, 64, comm.BFloat16)
	add(1, 65, 128, 128, comm.Float32)
	add(1, 65, 128, 128, comm.BFloat16)
	add(2, 33, 16, 40, comm.Float32)
	add(2, 33, 40, 16, comm.Float32)
	return out
}

// TestFakeFlashAttention runs device.FlashAttention (kernels/flash_attn.cu
// under the emulator, inside the whole-device fake) against package
// kernels' CPU attention, the saved log-sum-exp against a float64 one, and
// both against the reference device path (Kernels.Attention: fake cuBLAS
// and the causal softmax kernel) on the same inputs. It also checks what
// the fused path allocates: the forward nothing, the backward one Batch·T
// float32 scratch (D), so no Batch·T·T buffer; and that it runs no GEMM.
func TestFakeFlashAttention(t *testing.T) {
	f := buildDeviceFake(t)
	l, d := f.open(t, f.path, f.blas())
	defer func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	}()
	fa, ok := d.Kernels().(device.FlashAttention)
	if !ok {
		t.Fatal("the cuda device's Kernels is not a device.FlashAttention")
	}
	testFlashErrors(t, d, fa)
	r := rand.New(rand.NewPCG(27, 2))
	for _, c := range flashShapes() {
		s := c.s
		what := fmt.Sprintf("%v %+v", c.dt, s)
		if !fa.FlashFits(s, c.dt) {
			t.Fatalf("%s: FlashFits is false", what)
		}
		bt := s.Batch * s.T
		// Inputs in [−1, 1), rounded to the dtype: the CPU and the
		// reference path take the values the flash kernels read.
		in := func(n int) []float64 {
			x := make([]float64, n)
			for i := range x {
				v := float32(2*r.Float64() - 1)
				if c.dt == comm.BFloat16 {
					v = math.Float32frombits(uint32(bf16Bits(v)) << 16)
				}
				x[i] = float64(v)
			}
			return x
		}
		q, k, v, g := in(bt*s.DH), in(bt*s.DH), in(bt*s.DV), in(bt*s.DV)
		cpu := cpuAttention(t, s, q, k, v, g)
		ref := deviceAttention(t, d, s, q, k, v, g)
		f.logReset()
		got, peak := flashAttention(t, d, fa, c.dt, s, q, k, v, g)
		if strings.Contains(f.log(), "Gemm") {
			t.Errorf("%s: the fused path called cuBLAS:\n%s", what, f.log())
		}
		if lim := max(512, (int64(bt)*4+511)/512*512); peak > lim {
			t.Errorf("%s: the fused forward and backward allocated a peak of %d bytes, want at most %d (one Batch·T float32 scratch; Batch·T·T is %d)",
				what, peak, lim, bt*s.T*4)
		}
		wide := func(tl tol, grad bool) tol {
			if c.dt == comm.BFloat16 {
				tl.rtol += 4e-3
				if grad {
					tl.atol += 2e-3
				}
			}
			return tl
		}
		for i, name := range []string{"out", "lse", "dq", "dk", "dv"} {
			tl := map[string]tol{"out": wide(flashOut, false), "lse": flashLSE}[name]
			if i >= 2 {
				tl = wide(flashGrad, true)
			}
			compareOut(t, what+": "+name+" vs kernels", got[i], cpu[i], tl)
			if name != "lse" {
				// The reference path is float32 too: the two differ by
				// both sides' errors against the CPU.
				compareOut(t, what+": "+name+" vs the reference path", got[i], ref[i], tol{2 * tl.rtol, 2 * tl.atol})
			}
		}
	}
}

// cpuAttention is package kernels' attention of s on q, k, v and its
// backward for g: out, lse (float64 from the float32 scores), dq, dk, dv.
func cpuAttention(t *testing.T, s device.AttnShape, q, k, v, g []float64) [][]float64 {
	t.Helper()
	f32 := func(x []float64) []float32 {
		out := make([]float32, len(x))
		for i, e := range x {
			out[i] = float32(e)
		}
		return out
	}
	bt := s.Batch * s.T
	q32, k32, v32, g32 := f32(q), f32(k), f32(v), f32(g)
	out, probs := make([]float32, bt*s.DV), make([]float32, bt*s.T)
	if err := kernels.CausalAttentionForward(1, out, probs, q32, k32, v32, s.Batch, s.T, s.DH, s.DV, s.Scale); err != nil {
		t.Fatal(err)
	}
	dq, dk, dv := make([]float32, bt*s.DH), make([]float32, bt*s.DH), make([]float32, bt*s.DV)
	if err := kernels.CausalAttentionBackward(1, dq, dk, dv, g32, probs, q32, k32, v32, s.Batch, s.T, s.DH, s.DV, s.Scale); err != nil {
		t.Fatal(err)
	}
	lse := make([]float64, bt)
	for b := range s.Batch {
		for i := range s.T {
			sc := make([]float64, i+1)
			mx := math.Inf(-1)
			for j := range i + 1 {
				var dot float32
				for c := range s.DH {
					dot += q32[(b*s.T+i)*s.DH+c] * k32[(b*s.T+j)*s.DH+c]
				}
				sc[j] = float64(s.Scale * dot)
				mx = max(mx, sc[j])
			}
			sum := 0.0
			for _, x := range sc {
				sum += math.Exp(x - mx)
			}
			lse[b*s.T+i] = mx + math.Log(sum)
		}
	}
	wide := func(x []float32) []float64 {
		out := make([]float64, len(x))
		for i, e := range x {
			out[i] = float64(e)
		}
		return out
	}
	return [][]float64{wide(out), lse, wide(dq), wide(dk), wide(dv)}
}

// deviceAttention is d's reference attention (Kernels.Attention and
// AttentionBackward, float32): out, nil, dq, dk, dv.
func deviceAttention(t *testing.T, d device.Device, s device.AttnShape, q, k, v, g []float64) [][]float64 {
	t.Helper()
	bt := s.Batch * s.T
	c := kcase{name: "reference", bufs: []kbuf{outF32(bt*s.DV, tol{}), outF32(bt*s.T, tol{}),
		{dt: comm.Float32, n: len(q), init: q}, {dt: comm.Float32, n: len(k), init: k}, {dt: comm.Float32, n: len(v), init: v}},
		call: func(kk device.Kernels, b []device.Buffer) error { return kk.Attention(b[0], b[1], b[2], b[3], b[4], s) }}
	fwd, err := runCase(d, c)
	if err != nil {
		t.Fatal(err)
	}
	c = kcase{name: "reference backward", bufs: []kbuf{outF32(bt*s.DH, tol{}), outF32(bt*s.DH, tol{}), outF32(bt*s.DV, tol{}),
		{dt: comm.Float32, n: len(g), init: g}, {dt: comm.Float32, n: len(fwd[1]), init: fwd[1]},
		{dt: comm.Float32, n: len(q), init: q}, {dt: comm.Float32, n: len(k), init: k}, {dt: comm.Float32, n: len(v), init: v}},
		call: func(kk device.Kernels, b []device.Buffer) error {
			return kk.AttentionBackward(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], s)
		}}
	bwd, err := runCase(d, c)
	if err != nil {
		t.Fatal(err)
	}
	return [][]float64{fwd[0], nil, bwd[0], bwd[1], bwd[2]}
}

// flashAttention runs fa's forward and backward on d in dtype dt: out,
// lse, dq, dk, dv as float64 values, and the allocator's peak above what
// was allocated before the two calls (bytes).
func flashAttention(t *testing.T, d device.Device, fa device.FlashAttention, dt comm.DType, s device.AttnShape,
	q, k, v, g []float64) ([][]float64, int64) {
	t.Helper()
	bt := s.Batch * s.T
	sizes := []int{bt * s.DV, bt, bt * s.DH, bt * s.DH, bt * s.DV, bt * s.DH, bt * s.DH, bt * s.DV, bt * s.DV}
	inits := [][]float64{nil, nil, nil, nil, nil, q, k, v, g}
	bufs := make([]device.Buffer, len(sizes))
	defer func() {
		for _, b := range bufs {
			if b != nil {
				_ = b.Free()
			}
		}
	}()
	for i, n := range sizes {
		bdt := dt
		if i == 1 {
			bdt = comm.Float32 // lse
		}
		b, err := d.Alloc(bdt, n)
		if err != nil {
			t.Fatal(err)
		}
		bufs[i] = b
		if err := d.CopyFromHost(b, toHost(bdt, n, inits[i])); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	mem := d.Memory()
	mem.ResetPeak()
	base := mem.Stats().Allocated
	out, lse, dq, dk, dv, qb, kb, vb, gb := bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5], bufs[6], bufs[7], bufs[8]
	if err := fa.FlashAttention(out, lse, qb, kb, vb, s); err != nil {
		t.Fatal(err)
	}
	if err := fa.FlashAttentionBackward(dq, dk, dv, gb, out, lse, qb, kb, vb, s); err != nil {
		t.Fatal(err)
	}
	if err := d.Synchronize(); err != nil {
		t.Fatal(err)
	}
	peak := mem.Stats().PeakAllocated - base
	res := make([][]float64, 5)
	for i := range res {
		h := toHost(bufs[i].DType(), sizes[i], nil)
		if err := d.CopyToHost(h, bufs[i]); err != nil {
			t.Fatal(err)
		}
		res[i] = fromHost(h)
		if bufs[i].DType() == comm.BFloat16 {
			for j, bits := range res[i] {
				res[i][j] = float64(math.Float32frombits(uint32(bits) << 16))
			}
		}
	}
	return res, peak
}

// TestFakeFlashTape runs autograd.CausalAttention forward and backward on
// the whole-device fake, which takes the fused kernels (the cuda device is
// a device.FlashAttention), against the host: the output and the three
// gradients within flashOut and flashGrad, and the device memory the
// attention and its backward allocate (out, lse, the incoming gradient,
// dq, dk, dv, the D scratch) stays below one Batch·T·T float32 buffer,
// which the reference path's probabilities alone would fill.
func TestFakeFlashTape(t *testing.T) {
	f := buildDeviceFake(t)
	l, d := f.open(t, f.path, f.blas())
	defer func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
		if err := l.Close(); err != nil {
			t.Error(err)
		}
	}()
	const b, h, tt, dh = 2, 3, 129, 8
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		want, _, err := tapeAttention(ctx, m, device.Host(), []int{b, h, tt, dh})
		if err != nil {
			return fmt.Errorf("host: %w", err)
		}
		got, peak, err := tapeAttention(ctx, m, d, []int{b, h, tt, dh})
		if err != nil {
			return fmt.Errorf("%s: %w", d.Name(), err)
		}
		for i, name := range []string{"out", "dq", "dk", "dv"} {
			tl := flashGrad
			if i == 0 {
				tl = flashOut
			}
			compareOut(t, name, got[i], want[i], tl)
		}
		if probs := int64(b * h * tt * tt * 4); peak >= probs {
			t.Errorf("CausalAttention and its backward allocated a peak of %d bytes on %s, want less than the %d of the probabilities",
				peak, d.Name(), probs)
		}
		return nil
	})
}

// tapeAttention computes CausalAttention of q, k, v of shape on device d
// (host parameters copied there with autograd.To) and the gradients of
// the sum of its output weighted by a fixed ramp: out, dq, dk, dv, and on
// a device the allocator's peak above what it held before the attention.
func tapeAttention(ctx context.Context, m *mesh.Mesh, d device.Device, shape []int) ([][]float64, int64, error) {
	tape := autograd.NewTape()
	n := 1
	for _, s := range shape {
		n *= s
	}
	spec, err := placement.NewSpec(m, shape, comm.Float32, []placement.Placement{placement.Replicate()})
	if err != nil {
		return nil, 0, err
	}
	r := rand.New(rand.NewPCG(3, 27))
	var params, moved []*autograd.Value
	for i := range 3 {
		data := make([]float32, n)
		for j := range data {
			data[j] = float32(2*r.Float64() - 1)
		}
		x, err := placement.NewLocal(spec, data)
		if err != nil {
			return nil, 0, err
		}
		p, err := tape.Param(fmt.Sprint("p", i), x)
		if err != nil {
			return nil, 0, err
		}
		mv, err := autograd.To(p, d)
		if err != nil {
			return nil, 0, err
		}
		params, moved = append(params, p), append(moved, mv)
	}
	ramp := make([]float32, n)
	for j := range ramp {
		ramp[j] = float32(j%7) - 3
	}
	rt, err := placement.NewLocal(spec, ramp)
	if err != nil {
		return nil, 0, err
	}
	w, err := tape.Constant(rt)
	if err != nil {
		return nil, 0, err
	}
	var base int64
	mem := d.Memory()
	if d.Kind() != device.KindHost {
		if err := d.Synchronize(); err != nil {
			return nil, 0, err
		}
		mem.ResetPeak()
		base = mem.Stats().Allocated
	}
	a, err := autograd.CausalAttention(moved[0], moved[1], moved[2])
	if err != nil {
		return nil, 0, err
	}
	back, err := autograd.To(a, device.Host())
	if err != nil {
		return nil, 0, err
	}
	weighted, err := autograd.Mul(back, w)
	if err != nil {
		return nil, 0, err
	}
	loss, err := autograd.Sum(weighted)
	if err != nil {
		return nil, 0, err
	}
	if err := tape.Backward(ctx, loss); err != nil {
		return nil, 0, err
	}
	var peak int64
	if d.Kind() != device.KindHost {
		if err := d.Synchronize(); err != nil {
			return nil, 0, err
		}
		peak = mem.Stats().PeakAllocated - base
	}
	wide := func(x any) []float64 {
		var out []float64
		for _, e := range x.([]float32) {
			out = append(out, float64(e))
		}
		return out
	}
	res := [][]float64{wide(back.Data().LocalData())}
	for _, p := range params {
		res = append(res, wide(p.Grad().LocalData()))
	}
	return res, peak, nil
}

// testFlashErrors: buffers that do not fit the shape, mixed dtypes and a
// negative shape are device.ErrInvalid, head widths past 128 and float64
// loom.ErrUnsupported, each naming the method, before anything is queued.
func testFlashErrors(t *testing.T, d device.Device, fa device.FlashAttention) {
	t.Helper()
	s := device.AttnShape{Batch: 2, T: 3, DH: 4, DV: 4, Scale: 0.5}
	buf := func(dt comm.DType, n int) device.Buffer {
		b, err := d.Alloc(dt, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Free() })
		return b
	}
	x, lse, short := buf(comm.Float32, 24), buf(comm.Float32, 6), buf(comm.Float32, 5)
	h, f64 := buf(comm.BFloat16, 24), buf(comm.Float64, 24)
	wide := device.AttnShape{Batch: 1, T: 1, DH: 129, DV: 4, Scale: 0.5}
	for _, c := range []struct {
		name string
		err  error
		want error
		msg  string
	}{
		{"short lse", fa.FlashAttention(x, short, x, x, x, s), device.ErrInvalid, "FlashAttention: invalid argument: lse has 5 elements, want 6"},
		{"short q", fa.FlashAttention(x, lse, short, x, x, s), device.ErrInvalid, "FlashAttention: invalid argument: q has 5 elements, want 24"},
		{"mixed dtypes", fa.FlashAttention(x, lse, h, h, h, s), device.ErrInvalid, "FlashAttention: invalid argument: out is float32, want [bfloat16]"},
		{"negative", fa.FlashAttention(x, lse, x, x, x, device.AttnShape{Batch: -1, T: 3, DH: 4, DV: 4}), device.ErrInvalid, "negative shape"},
		{"wide", fa.FlashAttention(x, lse, x, x, x, wide), loom.ErrUnsupported, "head widths 129 and 4: the fused kernels take 1 to 128"},
		{"float64", fa.FlashAttention(f64, lse, f64, f64, f64, s), loom.ErrUnsupported, "FlashAttention: unsupported: float64"},
		{"backward short dk", fa.FlashAttentionBackward(x, short, x, x, x, lse, x, x, x, s), device.ErrInvalid, "FlashAttentionBackward: invalid argument: dk has 5 elements, want 24"},
	} {
		if !errors.Is(c.err, c.want) || c.err == nil || !strings.Contains(c.err.Error(), c.msg) {
			t.Errorf("%s: %v, want %v containing %q", c.name, c.err, c.want, c.msg)
		}
	}
	if err := d.Synchronize(); err != nil {
		t.Errorf("after the rejected calls: %v", err)
	}
}
