package emu

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/internal/checked"
	"github.com/b7ea7098/loom/internal/half"
	"github.com/b7ea7098/loom/internal/numcheck"
	"github.com/b7ea7098/loom/kernels"
)

// emuKernels is the device's device.Kernels: each method checks its
// buffers now and queues the CPU kernel on the compute stream, on views
// of the buffers' memory.
type emuKernels struct{ d *Device }

var _ device.Kernels = emuKernels{}

// arg is one buffer argument of a kernel: its name, the buffer, the dtypes
// it may have, and whether it may be nil.
type arg struct {
	name     string
	b        device.Buffer
	dtypes   []comm.DType
	optional bool
}

func f32(name string, b device.Buffer) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float32}}
}

func optF32(name string, b device.Buffer) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float32}, optional: true}
}

func f64(name string, b device.Buffer, optional bool) arg {
	return arg{name: name, b: b, dtypes: []comm.DType{comm.Float64}, optional: optional}
}

// check validates the arguments of op and returns their host views, nil
// for a nil optional buffer.
func (k emuKernels) check(op string, args ...arg) ([]*comm.HostBuffer, error) {
	if err := k.d.live(op); err != nil {
		return nil, err
	}
	views := make([]*comm.HostBuffer, len(args))
	for i, a := range args {
		b, err := k.d.buffer(op, a.name, a.b, a.optional)
		if err != nil {
			return nil, err
		}
		if b == nil {
			continue
		}
		ok := false
		for _, dt := range a.dtypes {
			ok = ok || b.DType() == dt
		}
		if !ok {
			return nil, fmt.Errorf("%s: %s: %w: %s is %v, want %v", k.d.name, op, device.ErrInvalid, a.name, b.DType(), a.dtypes)
		}
		views[i] = b.host
	}
	return views, nil
}

// float32s and float64s view h, nil for nil.
func float32s(h *comm.HostBuffer) []float32 {
	if h == nil {
		return nil
	}
	return h.Float32s()
}

func float64s(h *comm.HostBuffer) []float64 {
	if h == nil {
		return nil
	}
	return h.Float64s()
}

// workers is the row kernels' budget: the BLAS's threads, as the host
// path's Tape.Workers.
func (k emuKernels) workers() (kernels.Workers, error) {
	b, err := k.d.blasOrDefault()
	if err != nil {
		return 0, err
	}
	return kernels.Workers(b.Threads()), nil
}

// Gemm runs (*kernels.BLAS).Sgemm or Dgemm, once or g.Batch times.
func (k emuKernels) Gemm(g device.Gemm) error {
	const op = "Gemm"
	dts := []comm.DType{comm.Float32, comm.Float64}
	v, err := k.check(op, arg{name: "A", b: g.A, dtypes: dts}, arg{name: "B", b: g.B, dtypes: dts}, arg{name: "C", b: g.C, dtypes: dts})
	if err != nil {
		return err
	}
	if v[0].DType() != v[1].DType() || v[0].DType() != v[2].DType() {
		return fmt.Errorf("%s: %s: %w: A, B and C are %v, %v and %v", k.d.name, op, device.ErrInvalid, v[0].DType(), v[1].DType(), v[2].DType())
	}
	batch := max(g.Batch, 1)
	if g.Batch < 0 {
		return fmt.Errorf("%s: %s: %w: negative batch %d", k.d.name, op, device.ErrInvalid, g.Batch)
	}
	offs := [3][]int{}
	for i, s := range []int{g.StrideA, g.StrideB, g.StrideC} {
		if batch > 1 && s < 0 {
			return fmt.Errorf("%s: %s: %w: negative stride %d", k.d.name, op, device.ErrInvalid, s)
		}
		last, ok := checked.Mul(batch-1, s)
		if batch > 1 && (!ok || last > v[i].Len()) {
			return fmt.Errorf("%s: %s: %w: batch %d at stride %d passes the end of %s (%d elements)", k.d.name, op, device.ErrInvalid, batch, s, "ABC"[i:i+1], v[i].Len())
		}
		for j := range batch {
			offs[i] = append(offs[i], j*s)
		}
	}
	bl, err := k.d.blasOrDefault()
	if err != nil {
		return err
	}
	switch g.Precision {
	case device.GemmF32:
	case device.GemmBF16:
		if v[0].DType() != comm.Float32 {
			return fmt.Errorf("%s: %s: %w: a bfloat16 GEMM takes Float32 buffers, not %v", k.d.name, op, device.ErrInvalid, v[0].DType())
		}
	default:
		return fmt.Errorf("%s: %s: %w: precision %v", k.d.name, op, device.ErrInvalid, g.Precision)
	}
	if v[0].DType() == comm.Float32 {
		a, b, c := v[0].Float32s(), v[1].Float32s(), v[2].Float32s()
		alpha, beta := float32(g.Alpha), float32(g.Beta)
		bf16 := g.Precision == device.GemmBF16
		return k.d.compute.launch(op, func() error {
			if bf16 {
				// The inputs as they are when the work runs, rounded
				// into copies (C may alias them).
				ra, rb := make([]float32, len(a)), make([]float32, len(b))
				half.RoundBFloat16s(ra, a)
				half.RoundBFloat16s(rb, b)
				a, b = ra, rb
			}
			for j := range batch {
				if err := bl.Sgemm(g.TransA, g.TransB, g.M, g.N, g.K, alpha, a[offs[0][j]:], g.LDA, b[offs[1][j]:], g.LDB, beta, c[offs[2][j]:], g.LDC); err != nil {
					return err
				}
			}
			return nil
		})
	}
	a, b, c := v[0].Float64s(), v[1].Float64s(), v[2].Float64s()
	return k.d.compute.launch(op, func() error {
		for j := range batch {
			if err := bl.Dgemm(g.TransA, g.TransB, g.M, g.N, g.K, g.Alpha, a[offs[0][j]:], g.LDA, b[offs[1][j]:], g.LDB, g.Beta, c[offs[2][j]:], g.LDC); err != nil {
				return err
			}
		}
		return nil
	})
}

// Fill sets every element of dst to v, rounded to dst's type.
func (k emuKernels) Fill(dst device.Buffer, v float64) error {
	const op = "Fill"
	views, err := k.check(op, arg{name: "dst", b: dst, dtypes: []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16}})
	if err != nil {
		return err
	}
	h := views[0]
	return k.d.compute.launch(op, func() error {
		switch h.DType() {
		case comm.Float32:
			fill(h.Float32s(), float32(v))
		case comm.Float64:
			fill(h.Float64s(), v)
		case comm.BFloat16:
			fill(h.BFloat16s(), comm.BFloat16Bits(half.ToBFloat16(float32(v))))
		case comm.Float16:
			fill(h.Float16s(), comm.Float16Bits(half.ToFloat16(float32(v))))
		}
		return nil
	})
}

func fill[T any](s []T, v T) {
	for i := range s {
		s[i] = v
	}
}

// Cast converts src into dst between Float32 and BFloat16, Float16 or
// Float64.
func (k emuKernels) Cast(dst, src device.Buffer) error {
	const op = "Cast"
	dts := []comm.DType{comm.Float32, comm.Float64, comm.BFloat16, comm.Float16}
	v, err := k.check(op, arg{name: "dst", b: dst, dtypes: dts}, arg{name: "src", b: src, dtypes: dts})
	if err != nil {
		return err
	}
	d, s := v[0], v[1]
	if d.Len() != s.Len() {
		return fmt.Errorf("%s: %s: %w: dst has %d elements, src %d", k.d.name, op, device.ErrInvalid, d.Len(), s.Len())
	}
	var fn func()
	switch [2]comm.DType{s.DType(), d.DType()} {
	case [2]comm.DType{comm.Float32, comm.BFloat16}:
		fn = func() {
			convert(d.BFloat16s(), s.Float32s(), func(x float32) comm.BFloat16Bits { return comm.BFloat16Bits(half.ToBFloat16(x)) })
		}
	case [2]comm.DType{comm.BFloat16, comm.Float32}:
		fn = func() {
			convert(d.Float32s(), s.BFloat16s(), func(x comm.BFloat16Bits) float32 { return half.BFloat16ToFloat32(uint16(x)) })
		}
	case [2]comm.DType{comm.Float32, comm.Float16}:
		fn = func() {
			convert(d.Float16s(), s.Float32s(), func(x float32) comm.Float16Bits { return comm.Float16Bits(half.ToFloat16(x)) })
		}
	case [2]comm.DType{comm.Float16, comm.Float32}:
		fn = func() {
			convert(d.Float32s(), s.Float16s(), func(x comm.Float16Bits) float32 { return half.Float16ToFloat32(uint16(x)) })
		}
	case [2]comm.DType{comm.Float32, comm.Float64}:
		fn = func() { convert(d.Float64s(), s.Float32s(), func(x float32) float64 { return float64(x) }) }
	case [2]comm.DType{comm.Float64, comm.Float32}:
		fn = func() { convert(d.Float32s(), s.Float64s(), func(x float64) float32 { return float32(x) }) }
	default:
		return fmt.Errorf("%s: %s: %w: no cast from %v to %v (one side must be float32, the other another float type)", k.d.name, op, device.ErrInvalid, s.DType(), d.DType())
	}
	return k.d.compute.launch(op, func() error { fn(); return nil })
}

func convert[D, S any](dst []D, src []S, f func(S) D) {
	for i, x := range src {
		dst[i] = f(x)
	}
}

// Add runs kernels.Add on Float32 or Float64 buffers of one type.
func (k emuKernels) Add(dst, a, b device.Buffer) error {
	v, err := k.checkFloats("Add", fl("dst", dst), fl("a", a), fl("b", b))
	if err != nil {
		return err
	}
	return k.launchFloat("Add", v,
		func() error { return kernels.Add(v[0].Float32s(), v[1].Float32s(), v[2].Float32s()) },
		func() error { return kernels.Add(v[0].Float64s(), v[1].Float64s(), v[2].Float64s()) })
}

// Mul runs kernels.Mul on Float32 or Float64 buffers of one type.
func (k emuKernels) Mul(dst, a, b device.Buffer) error {
	v, err := k.checkFloats("Mul", fl("dst", dst), fl("a", a), fl("b", b))
	if err != nil {
		return err
	}
	return k.launchFloat("Mul", v,
		func() error { return kernels.Mul(v[0].Float32s(), v[1].Float32s(), v[2].Float32s()) },
		func() error { return kernels.Mul(v[0].Float64s(), v[1].Float64s(), v[2].Float64s()) })
}

// ColumnSums runs kernels.ColumnSums on Float32 or Float64 buffers of one
// type.
func (k emuKernels) ColumnSums(out, x device.Buffer, n int) error {
	v, err := k.checkFloats("ColumnSums", fl("out", out), fl("x", x))
	if err != nil {
		return err
	}
	return k.launchFloat("ColumnSums", v,
		func() error { return kernels.ColumnSums(v[0].Float32s(), v[1].Float32s(), n) },
		func() error { return kernels.ColumnSums(v[0].Float64s(), v[1].Float64s(), n) })
}

// Softmax runs kernels.SoftmaxRows or kernels.LogSoftmaxRows.
func (k emuKernels) Softmax(dst, src device.Buffer, n int, log bool) error {
	v, err := k.check("Softmax", f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	f := kernels.SoftmaxRows
	if log {
		f = kernels.LogSoftmaxRows
	}
	return k.d.compute.launch("Softmax", func() error { return f(w, v[0].Float32s(), v[1].Float32s(), n) })
}

// SoftmaxBackward runs kernels.SoftmaxRowsBackward or
// kernels.LogSoftmaxRowsBackward.
func (k emuKernels) SoftmaxBackward(dx, y, dy device.Buffer, n int, log bool) error {
	v, err := k.check("SoftmaxBackward", f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("SoftmaxBackward", func() error {
		if log {
			return kernels.LogSoftmaxRowsBackward(w, v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), n)
		}
		return kernels.SoftmaxRowsBackward(v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), n)
	})
}

// CausalSoftmax runs kernels.CausalSoftmax.
func (k emuKernels) CausalSoftmax(dst, src device.Buffer, t int, scale float32) error {
	v, err := k.check("CausalSoftmax", f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("CausalSoftmax", func() error { return kernels.CausalSoftmax(w, v[0].Float32s(), v[1].Float32s(), t, scale) })
}

// CausalSoftmaxBackward runs kernels.CausalSoftmaxBackward.
func (k emuKernels) CausalSoftmaxBackward(dx, y, dy device.Buffer, t int, scale float32) error {
	v, err := k.check("CausalSoftmaxBackward", f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	return k.d.compute.launch("CausalSoftmaxBackward", func() error {
		return kernels.CausalSoftmaxBackward(v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), t, scale)
	})
}

// LayerNorm runs kernels.LayerNorm.
func (k emuKernels) LayerNorm(y, mean, rstd, x, w, b device.Buffer, n int, eps float64) error {
	v, err := k.check("LayerNorm", f32("y", y), f64("mean", mean, true), f64("rstd", rstd, true), f32("x", x), optF32("w", w), optF32("b", b))
	if err != nil {
		return err
	}
	return k.d.compute.launch("LayerNorm", func() error {
		return kernels.LayerNorm(v[0].Float32s(), float64s(v[1]), float64s(v[2]), v[3].Float32s(), float32s(v[4]), float32s(v[5]), n, eps)
	})
}

// LayerNormBackward runs kernels.LayerNormBackward.
func (k emuKernels) LayerNormBackward(dx, dw, db, dy, x, w, mean, rstd device.Buffer, n int) error {
	v, err := k.check("LayerNormBackward", optF32("dx", dx), optF32("dw", dw), optF32("db", db), f32("dy", dy), f32("x", x), optF32("w", w),
		f64("mean", mean, false), f64("rstd", rstd, false))
	if err != nil {
		return err
	}
	return k.d.compute.launch("LayerNormBackward", func() error {
		return kernels.LayerNormBackward(float32s(v[0]), float32s(v[1]), float32s(v[2]), v[3].Float32s(), v[4].Float32s(), float32s(v[5]),
			v[6].Float64s(), v[7].Float64s(), n)
	})
}

// BiasGELU runs kernels.BiasGELU.
func (k emuKernels) BiasGELU(y, deriv, x, bias device.Buffer, n int) error {
	v, err := k.check("BiasGELU", f32("y", y), optF32("deriv", deriv), f32("x", x), optF32("bias", bias))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("BiasGELU", func() error {
		return kernels.BiasGELU(w, v[0].Float32s(), float32s(v[1]), v[2].Float32s(), float32s(v[3]), n)
	})
}

// BiasGELUBackward runs kernels.BiasGELUBackward.
func (k emuKernels) BiasGELUBackward(dx, dbias, dy, deriv device.Buffer, n int) error {
	v, err := k.check("BiasGELUBackward", f32("dx", dx), optF32("dbias", dbias), f32("dy", dy), f32("deriv", deriv))
	if err != nil {
		return err
	}
	return k.d.compute.launch("BiasGELUBackward", func() error {
		return kernels.BiasGELUBackward(v[0].Float32s(), float32s(v[1]), v[2].Float32s(), v[3].Float32s(), n)
	})
}

// Attention runs kernels.CausalAttentionForward.
func (k emuKernels) Attention(out, probs, q, kk, vv device.Buffer, s device.AttnShape) error {
	v, err := k.check("Attention", f32("out", out), f32("probs", probs), f32("q", q), f32("k", kk), f32("v", vv))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("Attention", func() error {
		return kernels.CausalAttentionForward(w, v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), v[3].Float32s(), v[4].Float32s(),
			s.Batch, s.T, s.DH, s.DV, s.Scale)
	})
}

// AttentionBackward runs kernels.CausalAttentionBackward.
func (k emuKernels) AttentionBackward(dq, dk, dv, g, probs, q, kk, vv device.Buffer, s device.AttnShape) error {
	v, err := k.check("AttentionBackward", optF32("dq", dq), optF32("dk", dk), optF32("dv", dv), f32("g", g), f32("probs", probs),
		f32("q", q), f32("k", kk), f32("v", vv))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("AttentionBackward", func() error {
		return kernels.CausalAttentionBackward(w, float32s(v[0]), float32s(v[1]), float32s(v[2]), v[3].Float32s(), v[4].Float32s(),
			v[5].Float32s(), v[6].Float32s(), v[7].Float32s(), s.Batch, s.T, s.DH, s.DV, s.Scale)
	})
}

// CrossEntropy runs kernels.CrossEntropyRows and stores its sum in loss.
func (k emuKernels) CrossEntropy(loss, lse, logits, targets device.Buffer, v int) error {
	const op = "CrossEntropy"
	views, err := k.check(op, f64("loss", loss, false), f64("lse", lse, true), f32("logits", logits),
		arg{name: "targets", b: targets, dtypes: []comm.DType{comm.Int64}})
	if err != nil {
		return err
	}
	if views[0].Len() != 1 {
		return fmt.Errorf("%s: %s: %w: loss has %d elements, want 1", k.d.name, op, device.ErrInvalid, views[0].Len())
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		total, err := kernels.CrossEntropyRows(w, float64s(views[1]), views[2].Float32s(), views[3].Int64s(), v)
		if err != nil {
			return err
		}
		views[0].Float64s()[0] = total
		return nil
	})
}

// CrossEntropyBackward runs kernels.CrossEntropyRowsBackward.
func (k emuKernels) CrossEntropyBackward(dx, logits, targets, lse device.Buffer, v int, scale float64) error {
	views, err := k.check("CrossEntropyBackward", f32("dx", dx), f32("logits", logits),
		arg{name: "targets", b: targets, dtypes: []comm.DType{comm.Int64}}, f64("lse", lse, false))
	if err != nil {
		return err
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch("CrossEntropyBackward", func() error {
		return kernels.CrossEntropyRowsBackward(w, views[0].Float32s(), views[1].Float32s(), views[2].Int64s(), views[3].Float64s(), v, scale)
	})
}

// SoftmaxDim runs kernels.Softmax64 on Float32 buffers over the middle
// dim of [outer, n, inner], as autograd's host path does for a dim other
// than the last.
func (k emuKernels) SoftmaxDim(dst, src device.Buffer, outer, n, inner int, log bool) error {
	const op = "SoftmaxDim"
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		return kernels.Softmax64(v[0].Float32s(), v[1].Float32s(), outer, n, inner, log)
	})
}

// SoftmaxDimBackward runs kernels.Softmax64Backward on Float32 buffers.
func (k emuKernels) SoftmaxDimBackward(dx, y, dy device.Buffer, outer, n, inner int, log bool) error {
	const op = "SoftmaxDimBackward"
	v, err := k.check(op, f32("dx", dx), f32("y", y), f32("dy", dy))
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		return kernels.Softmax64Backward(v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), outer, n, inner, log)
	})
}

// CrossEntropyMean runs kernels.CrossEntropyRows and stores
// float32(sum/count) in loss.
func (k emuKernels) CrossEntropyMean(loss, lse, logits, targets device.Buffer, v, count int) error {
	const op = "CrossEntropyMean"
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "count", count); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	views, err := k.check(op, f32("loss", loss), f64("lse", lse, true), f32("logits", logits),
		arg{name: "targets", b: targets, dtypes: []comm.DType{comm.Int64}})
	if err != nil {
		return err
	}
	if views[0].Len() != 1 {
		return fmt.Errorf("%s: %s: %w: loss has %d elements, want 1", k.d.name, op, device.ErrInvalid, views[0].Len())
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		total, err := kernels.CrossEntropyRows(w, float64s(views[1]), views[2].Float32s(), views[3].Int64s(), v)
		if err != nil {
			return err
		}
		views[0].Float32s()[0] = float32(total / float64(count))
		return nil
	})
}

// CrossEntropyMeanBackward runs kernels.CrossEntropyRowsBackward with the
// scale g[0]/count, g read when the work runs.
func (k emuKernels) CrossEntropyMeanBackward(dx, logits, targets, lse, g device.Buffer, v, count int) error {
	const op = "CrossEntropyMeanBackward"
	if err := numcheck.NonNegativeCount(device.ErrInvalid, "count", count); err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	views, err := k.check(op, f32("dx", dx), f32("logits", logits),
		arg{name: "targets", b: targets, dtypes: []comm.DType{comm.Int64}}, f64("lse", lse, false), f32("g", g))
	if err != nil {
		return err
	}
	if views[4].Len() != 1 {
		return fmt.Errorf("%s: %s: %w: g has %d elements, want 1", k.d.name, op, device.ErrInvalid, views[4].Len())
	}
	w, err := k.workers()
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		scale := float64(views[4].Float32s()[0]) / float64(count)
		return kernels.CrossEntropyRowsBackward(w, views[0].Float32s(), views[1].Float32s(), views[2].Int64s(), views[3].Float64s(), v, scale)
	})
}

// AdamW runs kernels.AdamW in p's type, Float32 or Float64.
func (k emuKernels) AdamW(p, g, m, v device.Buffer, c [8]float64) error {
	const op = "AdamW"
	dts := []comm.DType{comm.Float32, comm.Float64}
	views, err := k.check(op, arg{name: "p", b: p, dtypes: dts}, arg{name: "g", b: g, dtypes: dts}, arg{name: "m", b: m, dtypes: dts}, arg{name: "v", b: v, dtypes: dts})
	if err != nil {
		return err
	}
	dt := views[0].DType()
	for i, h := range views[1:] {
		if h.DType() != dt {
			return fmt.Errorf("%s: %s: %w: %s is %v, p %v", k.d.name, op, device.ErrInvalid, "gmv"[i:i+1], h.DType(), dt)
		}
	}
	if dt == comm.Float32 {
		var c32 [8]float32
		for i, x := range c {
			c32[i] = float32(x)
		}
		return k.d.compute.launch(op, func() error {
			return kernels.AdamW(views[0].Float32s(), views[1].Float32s(), views[2].Float32s(), views[3].Float32s(), &c32)
		})
	}
	return k.d.compute.launch(op, func() error {
		return kernels.AdamW(views[0].Float64s(), views[1].Float64s(), views[2].Float64s(), views[3].Float64s(), &c)
	})
}

// floats are the dtypes of the optimizer kernels.
var floats = []comm.DType{comm.Float32, comm.Float64}

// sameType checks that every view has the first one's dtype.
func (k emuKernels) sameType(op string, names string, views []*comm.HostBuffer) error {
	for i, h := range views[1:] {
		if h != nil && h.DType() != views[0].DType() {
			return fmt.Errorf("%s: %s: %w: %c is %v, %c %v", k.d.name, op, device.ErrInvalid, names[i+1], h.DType(), names[0], views[0].DType())
		}
	}
	return nil
}

var _ device.Float64Kernels = emuKernels{}

// Float64 is true: the dtype-generic kernels run the CPU kernels in
// float64 too.
func (emuKernels) Float64() bool { return true }

// fl is a Float32 or Float64 argument of a kernel whose float arguments
// share one dtype (checkFloats).
func fl(name string, b device.Buffer) arg { return arg{name: name, b: b, dtypes: floats} }

// checkFloats is check for kernels on Float32 or Float64 buffers that
// all have one dtype (the CPU kernel's type parameter).
func (k emuKernels) checkFloats(op string, args ...arg) ([]*comm.HostBuffer, error) {
	v, err := k.check(op, args...)
	if err != nil {
		return nil, err
	}
	for i, h := range v[1:] {
		if h != nil && h.DType() != v[0].DType() {
			return nil, fmt.Errorf("%s: %s: %w: %s is %v, %s %v", k.d.name, op, device.ErrInvalid, args[i+1].name, h.DType(), args[0].name, v[0].DType())
		}
	}
	return v, nil
}

// launchFloat queues f32 or f64 by the dtype of the views.
func (k emuKernels) launchFloat(op string, v []*comm.HostBuffer, f32, f64 func() error) error {
	if v[0].DType() == comm.Float64 {
		return k.d.compute.launch(op, f64)
	}
	return k.d.compute.launch(op, f32)
}

// SGD runs kernels.SGD in p's type, Float32 or Float64.
func (k emuKernels) SGD(p, g, buf device.Buffer, s kernels.SGDStep) error {
	const op = "SGD"
	views, err := k.check(op, arg{name: "p", b: p, dtypes: floats}, arg{name: "g", b: g, dtypes: floats},
		arg{name: "buf", b: buf, dtypes: floats, optional: s.Momentum == 0})
	if err != nil {
		return err
	}
	if err := k.sameType(op, "pgb", views); err != nil {
		return err
	}
	if views[0].DType() == comm.Float32 {
		return k.d.compute.launch(op, func() error {
			return kernels.SGD(views[0].Float32s(), views[1].Float32s(), float32s(views[2]), s)
		})
	}
	return k.d.compute.launch(op, func() error {
		return kernels.SGD(views[0].Float64s(), views[1].Float64s(), float64s(views[2]), s)
	})
}

// SumSquares runs kernels.SumSquares and stores the sum in out.
func (k emuKernels) SumSquares(out, x device.Buffer) error {
	const op = "SumSquares"
	views, err := k.check(op, f64("out", out, false), arg{name: "x", b: x, dtypes: floats})
	if err != nil {
		return err
	}
	if views[0].Len() != 1 {
		return fmt.Errorf("%s: %s: %w: out has %d elements, want 1", k.d.name, op, device.ErrInvalid, views[0].Len())
	}
	return k.d.compute.launch(op, func() error {
		if views[1].DType() == comm.Float32 {
			views[0].Float64s()[0] = kernels.SumSquares(views[1].Float32s())
		} else {
			views[0].Float64s()[0] = kernels.SumSquares(views[1].Float64s())
		}
		return nil
	})
}

// Scale runs kernels.Scale in x's type, Float32 or Float64.
func (k emuKernels) Scale(dst, x device.Buffer, c float64) error {
	const op = "Scale"
	views, err := k.check(op, arg{name: "dst", b: dst, dtypes: floats}, arg{name: "x", b: x, dtypes: floats})
	if err != nil {
		return err
	}
	if err := k.sameType(op, "dx", views); err != nil {
		return err
	}
	if views[0].DType() == comm.Float32 {
		return k.d.compute.launch(op, func() error { return kernels.Scale(views[0].Float32s(), views[1].Float32s(), float32(c)) })
	}
	return k.d.compute.launch(op, func() error { return kernels.Scale(views[0].Float64s(), views[1].Float64s(), c) })
}

// CopyBox runs kernels.CopyBox on the buffers' bytes: every dtype is
// copied alike, with the last dim scaled by the element size.
func (k emuKernels) CopyBox(dst device.Buffer, dshape, doff []int, src device.Buffer, sshape, soff, size []int) error {
	const op = "CopyBox"
	all := comm.AllDTypes()
	v, err := k.check(op, arg{name: "dst", b: dst, dtypes: all}, arg{name: "src", b: src, dtypes: all})
	if err != nil {
		return err
	}
	if v[0].DType() != v[1].DType() {
		return fmt.Errorf("%s: %s: %w: dst is %v, src %v", k.d.name, op, device.ErrInvalid, v[0].DType(), v[1].DType())
	}
	if err := kernels.CheckBox(v[0].Len(), dshape, doff, v[1].Len(), sshape, soff, size); err != nil {
		return fmt.Errorf("%s: %s: %w: %w", k.d.name, op, device.ErrInvalid, err)
	}
	// A scalar is a box of one element; bytes scale the last dim.
	es := v[0].DType().Size()
	ds, do, ss, so, sz := bytesDims(dshape, es), bytesOff(doff, es), bytesDims(sshape, es), bytesOff(soff, es), bytesDims(size, es)
	d, s := v[0].Bytes(), v[1].Bytes()
	return k.d.compute.launch(op, func() error {
		kernels.CopyBox(d, ds, do, s, ss, so, sz)
		return nil
	})
}

// bytesDims is shape in bytes: a copy with the last dim times es ([es]
// for a scalar).
func bytesDims(shape []int, es int) []int {
	if len(shape) == 0 {
		return []int{es}
	}
	out := append([]int(nil), shape...)
	out[len(out)-1] *= es
	return out
}

// bytesOff is an offset in bytes: a copy with the last index times es
// ([0] for a scalar).
func bytesOff(off []int, es int) []int {
	if len(off) == 0 {
		return []int{0}
	}
	out := append([]int(nil), off...)
	out[len(out)-1] *= es
	return out
}

// The kernels below serve autograd's ops on devices (step A6).

// FillRows runs kernels.FillRows on Float32 or Float64 buffers of one
// type.
func (k emuKernels) FillRows(dst, row device.Buffer) error {
	v, err := k.checkFloats("FillRows", fl("dst", dst), fl("row", row))
	if err != nil {
		return err
	}
	return k.launchFloat("FillRows", v,
		func() error { return kernels.FillRows(v[0].Float32s(), v[1].Float32s()) },
		func() error { return kernels.FillRows(v[0].Float64s(), v[1].Float64s()) })
}

// SumDims runs kernels.SumDims on Float32 or Float64 buffers of one type;
// shape and reduce are copied at the call.
func (k emuKernels) SumDims(out, x device.Buffer, shape []int, reduce []bool) error {
	v, err := k.checkFloats("SumDims", fl("out", out), fl("x", x))
	if err != nil {
		return err
	}
	shape, reduce = slices.Clone(shape), slices.Clone(reduce)
	return k.launchFloat("SumDims", v,
		func() error { return kernels.SumDims(v[0].Float32s(), v[1].Float32s(), shape, reduce) },
		func() error { return kernels.SumDims(v[0].Float64s(), v[1].Float64s(), shape, reduce) })
}

// BroadcastDims runs kernels.BroadcastDims on Float32 or Float64 buffers
// of one type; shape and reduce are copied at the call.
func (k emuKernels) BroadcastDims(out, g device.Buffer, shape []int, reduce []bool) error {
	v, err := k.checkFloats("BroadcastDims", fl("out", out), fl("g", g))
	if err != nil {
		return err
	}
	shape, reduce = slices.Clone(shape), slices.Clone(reduce)
	return k.launchFloat("BroadcastDims", v,
		func() error { return kernels.BroadcastDims(v[0].Float32s(), v[1].Float32s(), shape, reduce) },
		func() error { return kernels.BroadcastDims(v[0].Float64s(), v[1].Float64s(), shape, reduce) })
}

// PermuteDims runs kernels.PermuteDims on Float32 or Float64 buffers of
// one type; shape and perm are copied at the call.
func (k emuKernels) PermuteDims(out, x device.Buffer, shape, perm []int) error {
	v, err := k.checkFloats("PermuteDims", fl("out", out), fl("x", x))
	if err != nil {
		return err
	}
	shape, perm = slices.Clone(shape), slices.Clone(perm)
	return k.launchFloat("PermuteDims", v,
		func() error { return kernels.PermuteDims(v[0].Float32s(), v[1].Float32s(), shape, perm) },
		func() error { return kernels.PermuteDims(v[0].Float64s(), v[1].Float64s(), shape, perm) })
}

// NarrowDim runs kernels.NarrowDim on Float32 or Float64 buffers of one
// type.
func (k emuKernels) NarrowDim(out, x device.Buffer, outer, n, inner, start, length int) error {
	v, err := k.checkFloats("NarrowDim", fl("out", out), fl("x", x))
	if err != nil {
		return err
	}
	return k.launchFloat("NarrowDim", v,
		func() error {
			return kernels.NarrowDim(v[0].Float32s(), v[1].Float32s(), outer, n, inner, start, length)
		},
		func() error {
			return kernels.NarrowDim(v[0].Float64s(), v[1].Float64s(), outer, n, inner, start, length)
		})
}

// PadDim runs kernels.PadDim on Float32 or Float64 buffers of one type.
func (k emuKernels) PadDim(out, g device.Buffer, outer, n, inner, start, full int) error {
	v, err := k.checkFloats("PadDim", fl("out", out), fl("g", g))
	if err != nil {
		return err
	}
	return k.launchFloat("PadDim", v,
		func() error { return kernels.PadDim(v[0].Float32s(), v[1].Float32s(), outer, n, inner, start, full) },
		func() error { return kernels.PadDim(v[0].Float64s(), v[1].Float64s(), outer, n, inner, start, full) })
}

// ConcatDim runs kernels.ConcatDim on Float32 or Float64 buffers of one
// type; sizes is copied at the call.
func (k emuKernels) ConcatDim(out device.Buffer, xs []device.Buffer, sizes []int, outer, inner int) error {
	args := []arg{fl("out", out)}
	for i, x := range xs {
		args = append(args, fl(fmt.Sprintf("xs[%d]", i), x))
	}
	v, err := k.checkFloats("ConcatDim", args...)
	if err != nil {
		return err
	}
	sizes = slices.Clone(sizes)
	return k.launchFloat("ConcatDim", v,
		func() error {
			return kernels.ConcatDim(v[0].Float32s(), hostSlices(v[1:], (*comm.HostBuffer).Float32s), sizes, outer, inner)
		},
		func() error {
			return kernels.ConcatDim(v[0].Float64s(), hostSlices(v[1:], (*comm.HostBuffer).Float64s), sizes, outer, inner)
		})
}

// hostSlices is the data of each view, taken by get.
func hostSlices[T any](views []*comm.HostBuffer, get func(*comm.HostBuffer) []T) [][]T {
	out := make([][]T, len(views))
	for i, h := range views {
		out[i] = get(h)
	}
	return out
}

// Embedding runs kernels.EmbeddingForward.
func (k emuKernels) Embedding(out, table, ids device.Buffer, lo, d int) error {
	v, err := k.check("Embedding", f32("out", out), f32("table", table), arg{name: "ids", b: ids, dtypes: []comm.DType{comm.Int64}})
	if err != nil {
		return err
	}
	return k.d.compute.launch("Embedding", func() error {
		return kernels.EmbeddingForward(v[0].Float32s(), v[1].Float32s(), v[2].Int64s(), lo, d)
	})
}

// EmbeddingBackward runs kernels.EmbeddingBackward.
func (k emuKernels) EmbeddingBackward(dtable, acc, g, ids device.Buffer, lo, d int) error {
	v, err := k.check("EmbeddingBackward", f32("dtable", dtable), f64("acc", acc, false), f32("g", g),
		arg{name: "ids", b: ids, dtypes: []comm.DType{comm.Int64}})
	if err != nil {
		return err
	}
	return k.d.compute.launch("EmbeddingBackward", func() error {
		return kernels.EmbeddingBackward(v[0].Float32s(), v[1].Float64s(), v[2].Float32s(), v[3].Int64s(), lo, d)
	})
}

// Pointwise runs kernels.ReLU, SiLU, Tanh or Sigmoid.
func (k emuKernels) Pointwise(f device.Pointwise, dst, x device.Buffer) error {
	const op = "Pointwise"
	fns := map[device.Pointwise]func(dst, x []float32) error{
		device.ReLU: kernels.ReLU[float32], device.SiLU: kernels.SiLU[float32],
		device.Tanh: kernels.Tanh[float32], device.Sigmoid: kernels.Sigmoid[float32],
	}
	fn, ok := fns[f]
	if !ok {
		return fmt.Errorf("%s: %s: %w: unknown activation %v", k.d.name, op, device.ErrInvalid, f)
	}
	v, err := k.check(op, f32("dst", dst), f32("x", x))
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error { return fn(v[0].Float32s(), v[1].Float32s()) })
}

// PointwiseBackward runs kernels.ReLUBackward, SiLUBackward, TanhBackward
// or SigmoidBackward.
func (k emuKernels) PointwiseBackward(f device.Pointwise, dx, saved, dy device.Buffer) error {
	const op = "PointwiseBackward"
	fns := map[device.Pointwise]func(dx, saved, dy []float32) error{
		device.ReLU: kernels.ReLUBackward[float32], device.SiLU: kernels.SiLUBackward[float32],
		device.Tanh: kernels.TanhBackward[float32], device.Sigmoid: kernels.SigmoidBackward[float32],
	}
	fn, ok := fns[f]
	if !ok {
		return fmt.Errorf("%s: %s: %w: unknown activation %v", k.d.name, op, device.ErrInvalid, f)
	}
	v, err := k.check(op, f32("dx", dx), f32("saved", saved), f32("dy", dy))
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error { return fn(v[0].Float32s(), v[1].Float32s(), v[2].Float32s()) })
}

// DropoutMask runs kernels.DropoutMask; offset, box and global are copied
// at the call.
func (k emuKernels) DropoutMask(mask device.Buffer, offset, box, global []int, p float64, seed, step uint64) error {
	v, err := k.check("DropoutMask", f32("mask", mask))
	if err != nil {
		return err
	}
	offset, box, global = slices.Clone(offset), slices.Clone(box), slices.Clone(global)
	return k.d.compute.launch("DropoutMask", func() error {
		return kernels.DropoutMask(v[0].Float32s(), offset, box, global, p, seed, step)
	})
}

// ArgmaxRows runs kernels.ArgmaxRows.
func (k emuKernels) ArgmaxRows(dst, x device.Buffer, n int) error {
	v, err := k.check("ArgmaxRows", arg{name: "dst", b: dst, dtypes: []comm.DType{comm.Int64}}, f32("x", x))
	if err != nil {
		return err
	}
	return k.d.compute.launch("ArgmaxRows", func() error { return kernels.ArgmaxRows(v[0].Int64s(), v[1].Float32s(), n) })
}
