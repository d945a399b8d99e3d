package autograd

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Ops on devices. An op whose inputs live on a device other than the host
// (checkInputs has made sure they share one) runs there: its arithmetic is
// the device's Kernels on the inputs' device.Buffers, and its results are
// buffers of that device wrapped with placement.NewLocalOn. Host inputs
// take the code as it was, through one branch per op.
//
// Device memory follows the tape's arena (arena.go): scratch (saved
// values, intermediate gradients) is freed, back to the device's caching
// allocator, when the tape is cleared or Backward has consumed it; op
// results are freed at Recycle on a tape made WithRecycling; fresh results
// (no recycling, leaves' gradients) belong to the caller, who frees them
// with their buffer's Free.

// devKey names a device buffer the arena handed out: its device and the
// address of its first element.
type devKey struct {
	d device.Device
	p uintptr
}

// devBuf is a device buffer the arena handed out.
type devBuf struct {
	b      device.Buffer
	result bool // an op result: freed by recycle only
}

// devBytes is b's size in bytes.
func devBytes(b device.Buffer) uintptr { return uintptr(b.Len() * b.DType().Size()) }

// devSpan is the span of a device buffer, false when it is empty.
func devSpan(b device.Buffer) (span, bool) {
	p := b.Ptr()
	if p == 0 || b.Len() == 0 {
		return span{}, false
	}
	return span{bytes: devBytes(b), dev: devKey{b.Owner(), p}}, true
}

// bufOf returns dt's local block when it is a device buffer, nil for a
// host block.
func bufOf(dt *placement.DTensor) device.Buffer {
	b, _ := dt.LocalData().(device.Buffer)
	return b
}

// onDevice returns the device of x's block when it is not the host.
func onDevice(x *placement.DTensor) (device.Device, bool) {
	if b := bufOf(x); b != nil {
		return b.Owner(), true
	}
	return nil, false
}

// devKernels returns d's Kernels for op on data of type dt: Float32, or
// Float64 for the ops whose kernels are dtype-generic (float64Op) on a
// device whose Kernels take Float64 (device.Float64Kernels: the emulated
// device); anything else is an error wrapping ErrUnsupported that names
// op, the dtype and the device.
func devKernels(op string, d device.Device, dt comm.DType) (device.Kernels, error) {
	k := d.Kernels()
	if k == nil {
		return nil, unsupportedf(op, "%s has no kernels", d.Name())
	}
	if dt == comm.Float32 {
		return k, nil
	}
	if k64, ok := k.(device.Float64Kernels); ok && dt == comm.Float64 && float64Op(op) && k64.Float64() {
		return k, nil
	}
	return nil, unsupportedf(op, "%v on %s: the device's %s takes float32 (compute %v on the host)", dt, d.Name(), op, dt)
}

// float64Op reports whether op's device form uses only kernels that are
// dtype-generic (device.Float64Kernels), so that it runs on Float64 data
// where the device allows it.
func float64Op(op string) bool {
	switch op {
	case "Backward", "Add", "Mul", "Scale", "MatMul", "BatchedMatMul", "Linear", "Sum", "Narrow", "Concat", "Permute":
		return true
	}
	return false
}

// deviceForm reports whether op (the name checkInputs is given) runs on
// devices other than the host; the others refuse device inputs with
// hostOnly's error. Mean and MSE are compositions of ops that have device
// forms; Custom ops run wherever their inputs are; LocalMap copies device
// inputs to the host and its result back (LocalFunc.Apply checks its
// inputs itself, allowing devices).
func deviceForm(op string) bool {
	switch op {
	case "Add", "Mul", "Scale", "MatMul", "Linear", "Sum", "Mean", "MSE", "LayerNorm", "GELU", "Reshape", "To",
		"Redistribute", "Checkpoint", "Narrow", "Concat", "Permute", "Transpose", "Embedding", "CrossEntropy",
		"CausalAttention", "BatchedMatMul", "Softmax", "LogSoftmax", "CausalSoftmax",
		"ReLU", "SiLU", "Tanh", "Sigmoid", "Dropout", "Argmax":
		return true
	}
	return false
}

// hostOnly is the error of an op that has no device form yet, given
// inputs on d.
func hostOnly(op string, d device.Device) error {
	return unsupportedf(op, "inputs on %s: %s runs on the host only; copy its inputs there with autograd.To", d.Name(), op)
}

// devWrap wraps a kernel's error with op.
func devWrap(op string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("autograd: %s: %w", op, err)
}

// devBlock allocates n elements of dt on d as a says: scratch or a
// recycled result in t's arena (freed by it), or a fresh result the
// caller owns. Unlike block, its contents are undefined even when fresh.
func devBlock(a alloc, d device.Device, dt comm.DType, n int) (device.Buffer, error) {
	b, err := d.Alloc(dt, n)
	if err != nil {
		return nil, fmt.Errorf("autograd: allocating %d %v on %s: %w", n, dt, d.Name(), err)
	}
	if a.fresh() {
		return b, nil
	}
	a.t.arena.devTake(b, a.result)
	return b, nil
}

// devResult is devBlock for a result of spec's local shape and dtype,
// wrapped by placement.NewLocalOn; fill runs the kernel that writes it.
func devResult(a alloc, d device.Device, spec *placement.Spec, fill func(out device.Buffer) error) (*placement.DTensor, error) {
	b, err := devBlock(a, d, spec.DType(), prod(spec.LocalShape()))
	if err != nil {
		return nil, err
	}
	if err := fill(b); err != nil {
		// The buffer is unused: free it now unless the arena tracks it.
		if a.fresh() {
			return nil, errors.Join(err, b.Free())
		}
		return nil, err
	}
	return placement.NewLocalOn(spec, b)
}

// devTake records b as handed out, as take does for host buffers.
func (a *arena) devTake(b device.Buffer, result bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	e := devBuf{b: b, result: result}
	p := b.Ptr()
	if p == 0 || b.Len() == 0 {
		a.devEmpty = append(a.devEmpty, e)
		return
	}
	if a.devOut == nil {
		a.devOut = map[devKey]devBuf{}
	}
	k := devKey{b.Owner(), p}
	a.devOut[k] = e
	if n := len(a.devTracks); n > 0 {
		a.devTracks[n-1] = append(a.devTracks[n-1], k)
	}
}

// devGiveLocked frees the outstanding buffer whose block is exactly s's
// (scratch only when scratchOnly) and reports whether it did.
func (a *arena) devGiveLocked(s span, scratchOnly bool) bool {
	e, ok := a.devOut[s.dev]
	if !ok || devBytes(e.b) != s.bytes || scratchOnly && e.result {
		return false
	}
	a.devFreeOne(s.dev, e)
	return true
}

// devFreeOne frees e (poisoned with NaN first when it is a result and
// a.poison is set) and forgets it. The free is ordered after the work
// queued on the buffer's streams, so a kernel still reading it is safe.
func (a *arena) devFreeOne(k devKey, e devBuf) {
	delete(a.devOut, k)
	if e.result && a.poison {
		if kk := e.b.Owner().Kernels(); kk != nil {
			_ = kk.Fill(e.b, math.NaN()) // poisoning is a debugging aid
		}
	}
	// A failing Free is a double free or a closed device: either way the
	// arena no longer owns the memory.
	_ = e.b.Free()
}

// devFreeLocked frees every outstanding scratch buffer, and the results
// too when results is set (recycle).
func (a *arena) devFreeLocked(results bool) {
	for k, e := range a.devOut {
		if !e.result || results {
			a.devFreeOne(k, e)
		}
	}
	keep := a.devEmpty[:0]
	for _, e := range a.devEmpty {
		if e.result && !results {
			keep = append(keep, e)
			continue
		}
		_ = e.b.Free()
	}
	clear(a.devEmpty[len(keep):])
	a.devEmpty = keep
}

// devUntrackLocked is untrack's part for device buffers: it frees those
// handed out since the innermost track began, except those sharing memory
// with keep, which the enclosing track inherits.
func (a *arena) devUntrackLocked(keep []*placement.DTensor) {
	k := len(a.devTracks)
	if k == 0 {
		return
	}
	list := a.devTracks[k-1]
	a.devTracks = a.devTracks[:k-1]
	for _, key := range list {
		e, ok := a.devOut[key]
		if !ok {
			continue
		}
		s := span{bytes: devBytes(e.b), dev: key}
		if overlapsAny(s, keep) {
			if k > 1 {
				a.devTracks[k-2] = append(a.devTracks[k-2], key)
			}
			continue
		}
		a.devFreeOne(key, e)
	}
}

// filledOn is filled for a tensor on d, in a block as a says.
func filledOn(a alloc, d device.Device, spec *placement.Spec, v float64) (*placement.DTensor, error) {
	k, err := devKernels("Backward", d, spec.DType())
	if err != nil {
		return nil, err
	}
	return devResult(a, d, spec, func(out device.Buffer) error { return k.Fill(out, v) })
}

// devClone copies a device tensor's block into a fresh buffer of its
// device, which the caller owns.
func devClone(x device.Buffer, spec *placement.Spec) (*placement.DTensor, error) {
	d := x.Owner()
	b, err := d.Alloc(x.DType(), x.Len())
	if err != nil {
		return nil, fmt.Errorf("autograd: copying a gradient on %s: %w", d.Name(), err)
	}
	if err := d.Copy(b, x); err != nil {
		return nil, errors.Join(fmt.Errorf("autograd: copying a gradient on %s: %w", d.Name(), err), b.Free())
	}
	return placement.NewLocalOn(spec, b)
}

// To returns x with its local block on d: a differentiable copy between
// devices (placement's DTensor.To), whose backward copies the gradient
// back to x's device. x itself is returned when it is on d already. The
// copy is a fresh result the caller owns, or on a tape made WithRecycling
// a result freed at Recycle when it is on a device other than the host.
// Errors wrap ErrInvalid (nil input or device) or are the devices'
// (allocation, copies).
func To(x *Value, d device.Device) (*Value, error) {
	const op = "To"
	t, err := checkInputs(op, x)
	if err != nil {
		return nil, err
	}
	if d == nil {
		return nil, invalidf(op, "nil device (device.Host() is the host)")
	}
	src := x.data.Device()
	if device.Same(op, src, d) == nil {
		return x, nil
	}
	out, err := t.copyTo(x.data, d, t.result())
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		gx, err := t.copyTo(g, src, t.scratch())
		return []*placement.DTensor{gx}, err
	}), nil
}

// copyTo copies x's block to d (placement's DTensor.To), moving a copy
// that lands on a device other than the host into t's arena as a says.
func (t *Tape) copyTo(x *placement.DTensor, d device.Device, a alloc) (*placement.DTensor, error) {
	out, err := x.To(d)
	if err != nil {
		return nil, fmt.Errorf("autograd: To: %w", err)
	}
	if b := bufOf(out); b != nil && !a.fresh() {
		t.arena.devTake(b, a.result)
	}
	return out, nil
}

// devZip runs the two-input kernel f on the blocks of x and y (same
// device, dtype and length) into a block of d as a says: Add and Mul.
func devZip(op string, a alloc, d device.Device, spec *placement.Spec, x, y *placement.DTensor,
	f func(k device.Kernels, dst, x, y device.Buffer) error) (*placement.DTensor, error) {
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	xb, yb := bufOf(x), bufOf(y)
	if yb == nil || yb.Len() != xb.Len() {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v and %v do not match", op, x.LocalShape(), y.LocalShape())
	}
	return devResult(a, d, spec, func(out device.Buffer) error { return devWrap(op, f(k, out, xb, yb)) })
}

// devScale is scale on a device.
func devScale(a alloc, d device.Device, spec *placement.Spec, x *placement.DTensor, c float64) (*placement.DTensor, error) {
	k, err := devKernels("Scale", d, spec.DType())
	if err != nil {
		return nil, err
	}
	xb := bufOf(x)
	return devResult(a, d, spec, func(out device.Buffer) error { return devWrap("Scale", k.Scale(out, xb, c)) })
}

// devGemm is gemm on a device: one Kernels.Gemm with beta = 0 (device
// memory is not zeroed, fresh or not), or a Fill when k is 0.
func devGemm(a alloc, d device.Device, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, m, n, k int) (*placement.DTensor, error) {
	const op = "MatMul"
	kk, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	lda, ldb := k, n
	if transA {
		lda = m
	}
	if transB {
		ldb = k
	}
	g := device.Gemm{TransA: transA, TransB: transB, M: m, N: n, K: k, A: bufOf(x), B: bufOf(y),
		LDA: max(1, lda), LDB: max(1, ldb), LDC: max(1, n), Alpha: 1, Precision: a.t.gemmPrecision(spec.DType())}
	return devResult(a, d, spec, func(c device.Buffer) error {
		if k == 0 || m == 0 || n == 0 {
			return devWrap(op, kk.Fill(c, 0))
		}
		g.C = c
		return devWrap(op, kk.Gemm(g))
	})
}

// devGemmBias is gemmBias on a device: the result prefilled with the bias
// rows (FillRows), then the GEMM with beta = 1, as the host does.
func devGemmBias(t *Tape, d device.Device, spec *placement.Spec, x, w *placement.DTensor, bias device.Buffer, m, n, k int) (*placement.DTensor, error) {
	const op = "Linear"
	kk, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	if bias.Len() != n {
		return nil, fmt.Errorf("autograd: %s: internal: bias block of %d for %d outputs", op, bias.Len(), n)
	}
	return devResult(t.result(), d, spec, func(c device.Buffer) error {
		if err := kk.FillRows(c, bias); err != nil {
			return devWrap(op, err)
		}
		if k == 0 || m == 0 || n == 0 {
			return nil
		}
		return devWrap(op, kk.Gemm(device.Gemm{TransB: true, M: m, N: n, K: k, A: bufOf(x), B: bufOf(w), C: c,
			LDA: k, LDB: k, LDC: n, Alpha: 1, Beta: 1, Precision: t.gemmPrecision(spec.DType())}))
	})
}

// devColumnSums is columnSums on a device, into t's arena.
func devColumnSums(t *Tape, spec *placement.Spec, g device.Buffer, n int) (*placement.DTensor, error) {
	d := g.Owner()
	k, err := devKernels("Linear", d, g.DType())
	if err != nil {
		return nil, err
	}
	return devResult(t.scratch(), d, spec, func(out device.Buffer) error {
		return devWrap("Linear", k.ColumnSums(out, g, n))
	})
}

// devSum is sumLocal on a device, into a result block of t.
func devSum(t *Tape, d device.Device, spec *placement.Spec, x *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	k, err := devKernels("Sum", d, spec.DType())
	if err != nil {
		return nil, err
	}
	shape := x.LocalShape()
	return devResult(t.result(), d, spec, func(out device.Buffer) error {
		return devWrap("Sum", k.SumDims(out, bufOf(x), shape, reduce))
	})
}

// devBroadcast is broadcastLocal on a device, into t's arena.
func devBroadcast(t *Tape, d device.Device, spec *placement.Spec, g *placement.DTensor, reduce []bool) (*placement.DTensor, error) {
	k, err := devKernels("Sum", d, spec.DType())
	if err != nil {
		return nil, err
	}
	shape := spec.LocalShape()
	return devResult(t.scratch(), d, spec, func(out device.Buffer) error {
		return devWrap("Sum", k.BroadcastDims(out, bufOf(g), shape, reduce))
	})
}

// layerNormDev is LayerNorm on a device: Kernels.LayerNorm, saving the
// rows' mean and rstd (Float64 scratch) when recorded, and
// Kernels.LayerNormBackward.
func layerNormDev(t *Tape, d device.Device, spec *placement.Spec, x, w, b *Value, eps float64) (*Value, error) {
	const op = "LayerNorm"
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	shape := spec.Shape()
	n := shape[len(shape)-1]
	xb, wb, bb := bufOf(x.data), bufOf(w.data), bufOf(b.data)
	var mean, rstd device.Buffer
	if t.records(x, w, b) && n > 0 {
		rows := xb.Len() / n
		if mean, err = devBlock(t.scratch(), d, comm.Float64, rows); err != nil {
			return nil, err
		}
		if rstd, err = devBlock(t.scratch(), d, comm.Float64, rows); err != nil {
			return nil, err
		}
	}
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error {
		return devWrap(op, k.LayerNorm(y, mean, rstd, xb, wb, bb, n, eps))
	})
	if err != nil {
		return nil, err
	}
	ws, bs := w.Spec(), b.Spec()
	return splitAware(t.record(op, out, []*Value{x, w, b}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		needX, needW, needB := t.need(x), t.need(w), t.need(b)
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gb := bufOf(g)
		// dw and db stay 0 when there are no rows, as the host's zeroBuf.
		var dx, dw, db device.Buffer
		if needX {
			if dx, err = devBlock(t.scratch(), d, comm.Float32, gb.Len()); err != nil {
				return nil, err
			}
		}
		for _, p := range []struct {
			need bool
			buf  *device.Buffer
		}{{needW, &dw}, {needB, &db}} {
			if !p.need {
				continue
			}
			if *p.buf, err = devBlock(t.scratch(), d, comm.Float32, n); err != nil {
				return nil, err
			}
			if err := k.Fill(*p.buf, 0); err != nil {
				return nil, devWrap(op, err)
			}
		}
		if err := k.LayerNormBackward(dx, dw, db, gb, xb, wb, mean, rstd, n); err != nil {
			return nil, devWrap(op, err)
		}
		grads := make([]*placement.DTensor, 3)
		if needX {
			if grads[0], err = placement.NewLocalOn(g.Spec(), dx); err != nil {
				return nil, err
			}
		}
		red := reducedOver(spec, g.Spec().Placements())
		for i, p := range []struct {
			need bool
			s    *placement.Spec
			buf  device.Buffer
		}{{needW, ws, dw}, {needB, bs, db}} {
			if !p.need {
				continue
			}
			s, err := gradSpec(p.s, red)
			if err != nil {
				return nil, err
			}
			if grads[1+i], err = placement.NewLocalOn(s, p.buf); err != nil {
				return nil, err
			}
		}
		return grads, nil
	})), nil
}

// geluDev is GELU on a device: Kernels.BiasGELU without a bias, saving
// GELU' (scratch) when recorded, and Kernels.BiasGELUBackward, as the
// host's float32 path.
func geluDev(t *Tape, d device.Device, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "GELU"
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	xb := bufOf(x.data)
	ls := x.data.LocalShape()
	n := 1
	if len(ls) > 0 {
		n = ls[len(ls)-1]
	}
	w := rowWidth(xb.Len(), n)
	var deriv device.Buffer
	if t.records(x) {
		if deriv, err = devBlock(t.scratch(), d, comm.Float32, xb.Len()); err != nil {
			return nil, err
		}
	}
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error {
		return devWrap(op, k.BiasGELU(y, deriv, xb, nil, w))
	})
	if err != nil {
		return nil, err
	}
	return devRecordUnary(t, op, x, spec, out, func(gs *placement.Spec, g, dx device.Buffer) error {
		return k.BiasGELUBackward(dx, nil, g, deriv, rowWidth(g.Len(), n))
	})
}

// devRecordUnary is recordUnary on a device: back writes the input's
// gradient dx (scratch of g's length) from the aligned gradient g.
func devRecordUnary(t *Tape, op string, x *Value, spec *placement.Spec, out *placement.DTensor, back func(gs *placement.Spec, g, dx device.Buffer) error) (*Value, error) {
	d := out.Device()
	return t.record(op, out, []*Value{x}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gx, err := devResult(t.scratch(), d, g.Spec(), func(dx device.Buffer) error {
			return devWrap(op, back(g.Spec(), bufOf(g), dx))
		})
		return []*placement.DTensor{gx}, err
	}), nil
}

// devShape runs a shape kernel (Narrow, Pad, Concat, Permute) into a
// block of d as a says, laid out by spec.
func devShape(op string, a alloc, d device.Device, spec *placement.Spec, f func(k device.Kernels, out device.Buffer) error) (*placement.DTensor, error) {
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	return devResult(a, d, spec, func(out device.Buffer) error { return devWrap(op, f(k, out)) })
}

// devIDs copies ids (Int64, host) into a scratch buffer of d, read at
// the call.
func devIDs(t *Tape, d device.Device, ids []int64) (device.Buffer, error) {
	b, err := devBlock(t.scratch(), d, comm.Int64, len(ids))
	if err != nil {
		return nil, err
	}
	if err := d.CopyFromHost(b, comm.Host(ids)); err != nil {
		return nil, fmt.Errorf("autograd: copying ids to %s: %w", d.Name(), err)
	}
	return b, nil
}

// embeddingDev is Embedding on a device: the ids go to the device once
// (scratch, kept for the backward), Kernels.Embedding and
// Kernels.EmbeddingBackward with a Float64 accumulator, as the host's
// float32 path.
func embeddingDev(t *Tape, d device.Device, spec *placement.Spec, table *Value, ids *Indices) (*Value, error) {
	const op = "Embedding"
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	ts := table.Spec()
	off, _, err := ts.Box(ts.Mesh().Rank())
	if err != nil {
		return nil, fmt.Errorf("autograd: %s: %w", op, err)
	}
	lb := table.data.LocalShape()
	lo, vl, dl := off[0], lb[0], lb[1]
	tb := bufOf(table.data)
	if tb.Len() != vl*dl || len(ids.data)*dl != prod(spec.LocalShape()) {
		return nil, fmt.Errorf("autograd: %s: internal: table block %v and %d local ids for a result block %v", op, lb, len(ids.data), spec.LocalShape())
	}
	ib, err := devIDs(t, d, ids.data)
	if err != nil {
		return nil, err
	}
	out, err := devResult(t.result(), d, spec, func(o device.Buffer) error { return devWrap(op, k.Embedding(o, tb, ib, lo, dl)) })
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{table}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, s, err := embeddingGradSpec(ctx, t, spec, ts, ids, g)
		if err != nil {
			return nil, err
		}
		gb := bufOf(g)
		if gb.Len() != len(ids.data)*dl {
			return nil, fmt.Errorf("autograd: %s: internal: gradient block %v for %d local ids of %d columns", op, g.LocalShape(), len(ids.data), dl)
		}
		acc, err := devBlock(t.scratch(), d, comm.Float64, vl*dl)
		if err != nil {
			return nil, err
		}
		gt, err := devResult(t.scratch(), d, s, func(dt device.Buffer) error {
			return devWrap(op, k.EmbeddingBackward(dt, acc, gb, ib, lo, dl))
		})
		return []*placement.DTensor{gt}, err
	}), nil
}

// crossEntropyDev is CrossEntropy on a device: Kernels.CrossEntropyMean
// saving the rows' log-sum-exps (Float64 scratch), and
// Kernels.CrossEntropyMeanBackward. The mean over the global rows and the
// backward's scale (the incoming gradient over the rows) are computed on
// the device as the host path computes them, so neither direction waits
// for the device.
func crossEntropyDev(t *Tape, d device.Device, spec *placement.Spec, logits *Value, targets *Indices) (*Value, error) {
	const op = "CrossEntropy"
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	ls := logits.Spec()
	n, v := ceRows(ls)
	xb := bufOf(logits.data)
	if xb.Len() != len(targets.data)*v {
		return nil, fmt.Errorf("autograd: %s: internal: logits block %v for %d local targets", op, logits.data.LocalShape(), len(targets.data))
	}
	tb, err := devIDs(t, d, targets.data)
	if err != nil {
		return nil, err
	}
	var lse device.Buffer
	if t.records(logits) {
		if lse, err = devBlock(t.scratch(), d, comm.Float64, len(targets.data)); err != nil {
			return nil, err
		}
	}
	out, err := devResult(t.result(), d, spec, func(o device.Buffer) error {
		return devWrap(op, k.CrossEntropyMean(o, lse, xb, tb, v, n))
	})
	if err != nil {
		return nil, err
	}
	return t.record(op, out, []*Value{logits}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, s, err := crossEntropyGradSpec(ctx, t, spec, ls, g)
		if err != nil {
			return nil, err
		}
		gb := bufOf(g)
		if gb.Len() != 1 {
			return nil, fmt.Errorf("autograd: %s: internal: scalar gradient block of %d", op, gb.Len())
		}
		gx, err := devResult(t.scratch(), d, s, func(dx device.Buffer) error {
			return devWrap(op, k.CrossEntropyMeanBackward(dx, xb, tb, lse, gb, v, n))
		})
		return []*placement.DTensor{gx}, err
	}), nil
}

// attentionDev is the fused CausalAttention on a device:
// Kernels.Attention, keeping the probabilities (scratch) for the
// backward, and Kernels.AttentionBackward; or, where the device offers
// device.FlashAttention for the shape, its fused kernels, keeping each
// row's log-sum-exp instead (Batch·T, not Batch·T·T). A selective
// checkpoint's kept result and saved buffer are reused as on the host.
func attentionDev(t *Tape, d device.Device, spec *placement.Spec, q, k, v *Value) (*Value, error) {
	const op = "CausalAttention"
	kk, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	qb, kb, vb := bufOf(q.data), bufOf(k.data), bufOf(v.data)
	lq, lv := q.data.LocalShape(), v.data.LocalShape()
	r := len(lq)
	shape := device.AttnShape{Batch: prod(lq[:r-2]), T: lq[r-2], DH: lq[r-1], DV: lv[r-1],
		Scale: float32(1 / math.Sqrt(float64(q.Spec().Shape()[r-1])))}
	if qb.Len() != shape.Batch*shape.T*shape.DH || kb.Len() != qb.Len() || vb.Len() != shape.Batch*shape.T*shape.DV {
		return nil, fmt.Errorf("autograd: %s: internal: local blocks %v, %v and %v", op, lq, k.data.LocalShape(), lv)
	}
	flash, _ := kk.(device.FlashAttention)
	if flash != nil && !flash.FlashFits(shape, qb.DType()) {
		flash = nil
	}
	// saved is what the backward reads besides q, k, v (and out): the
	// probabilities, or the fused kernels' log-sum-exps.
	nsaved := shape.Batch * shape.T * shape.T
	if flash != nil {
		nsaved = shape.Batch * shape.T
	}
	var saved device.Buffer
	var res *placement.DTensor
	kept, err := t.reuse(op, spec)
	if err != nil {
		return nil, err
	}
	if kept != nil {
		res = kept.out
		saved, _ = kept.aux.(device.Buffer)
		if ob := bufOf(res); ob == nil || saved == nil || ob.Len() != vb.Len() || saved.Len() != nsaved {
			return nil, fmt.Errorf("autograd: %s: internal: kept blocks do not fit", op)
		}
	} else {
		// Without a backward the saved buffer is a temporary, freed
		// once the kernel that writes it is queued.
		keep := t.records(q, k, v) || t.keeping(op)
		where := t.scratch()
		if !keep {
			where = alloc{}
		}
		if saved, err = devBlock(where, d, comm.Float32, nsaved); err != nil {
			return nil, err
		}
		res, err = devResult(t.result(), d, spec, func(out device.Buffer) error {
			if flash != nil {
				return devWrap(op, flash.FlashAttention(out, saved, qb, kb, vb, shape))
			}
			return devWrap(op, kk.Attention(out, saved, qb, kb, vb, shape))
		})
		if !keep {
			err = errors.Join(err, saved.Free())
			saved = nil
		}
		if err != nil {
			return nil, err
		}
	}
	sq, sk, sv := q.Spec(), k.Spec(), v.Spec()
	needQ, needK, needV := q.requiresGrad, k.requiresGrad, v.requiresGrad
	var aux any
	if saved != nil {
		aux = saved
	}
	return t.recordAux(op, res, aux, []*Value{q, k, v}, func(ctx context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
		g, err := t.alignGrad(ctx, op, g, spec)
		if err != nil {
			return nil, err
		}
		gb := bufOf(g)
		if gb.Len() != vb.Len() {
			return nil, fmt.Errorf("autograd: %s: internal: gradient block %v, result %v", op, g.LocalShape(), res.LocalShape())
		}
		pg := g.Spec().Placements()
		grads := make([]*placement.DTensor, 3)
		var bufs [3]device.Buffer
		for i, c := range []struct {
			need bool
			n    int
		}{{needQ, qb.Len()}, {needK, kb.Len()}, {needV, vb.Len()}} {
			if c.need {
				if bufs[i], err = devBlock(t.scratch(), d, comm.Float32, c.n); err != nil {
					return nil, err
				}
			}
		}
		if flash != nil {
			err = flash.FlashAttentionBackward(bufs[0], bufs[1], bufs[2], gb, bufOf(res), saved, qb, kb, vb, shape)
		} else {
			err = kk.AttentionBackward(bufs[0], bufs[1], bufs[2], gb, saved, qb, kb, vb, shape)
		}
		if err != nil {
			return nil, devWrap(op, err)
		}
		for i, s := range []*placement.Spec{sq, sk, sv} {
			if bufs[i] == nil {
				continue
			}
			gs, err := gradSpec(s, pg)
			if err != nil {
				return nil, err
			}
			if grads[i], err = placement.NewLocalOn(gs, bufs[i]); err != nil {
				return nil, err
			}
		}
		return grads, nil
	}), nil
}

// devBmm is bmmLocal on a device: one strided batched Kernels.Gemm with
// beta = 0, or a Fill when k is 0.
func devBmm(a alloc, d device.Device, spec *placement.Spec, x, y *placement.DTensor, transA, transB bool, batch, m, n, k int) (*placement.DTensor, error) {
	const op = "BatchedMatMul"
	kk, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	lda, ldb := max(1, k), max(1, n)
	if transA {
		lda = max(1, m)
	}
	if transB {
		ldb = max(1, k)
	}
	g := device.Gemm{TransA: transA, TransB: transB, M: m, N: n, K: k, A: bufOf(x), B: bufOf(y),
		LDA: lda, LDB: ldb, LDC: max(1, n), Alpha: 1, Batch: batch, StrideA: m * k, StrideB: k * n, StrideC: m * n,
		Precision: a.t.gemmPrecision(spec.DType())}
	return devResult(a, d, spec, func(c device.Buffer) error {
		switch {
		case batch == 0 || m == 0 || n == 0:
			return nil // an empty result
		case k == 0:
			return devWrap(op, kk.Fill(c, 0))
		}
		g.C = c
		return devWrap(op, kk.Gemm(g))
	})
}

// softmaxDev is Softmax or LogSoftmax on a device over any dim:
// Kernels.Softmax and SoftmaxBackward over the last, Kernels.SoftmaxDim
// and SoftmaxDimBackward (in float64, as the host) over another.
func softmaxDev(t *Tape, d device.Device, op string, x *Value, dim int, logOut bool) (*Value, error) {
	spec := x.Spec()
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	shape := x.data.LocalShape()
	outer, n, inner := splitDim(shape, dim)
	xb := bufOf(x.data)
	if outer*n*inner != xb.Len() {
		return nil, fmt.Errorf("autograd: %s: internal: local block %v of %d elements", op, shape, xb.Len())
	}
	// The host's float32 path: the row kernels over the last dim, the
	// float64 reference (Softmax64) over another.
	last := inner == 1
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error {
		if last {
			return devWrap(op, k.Softmax(y, xb, n, logOut))
		}
		return devWrap(op, k.SoftmaxDim(y, xb, outer, n, inner, logOut))
	})
	if err != nil {
		return nil, err
	}
	yb := bufOf(out)
	return devRecordUnary(t, op, x, spec, out, func(_ *placement.Spec, g, dx device.Buffer) error {
		if last {
			return k.SoftmaxBackward(dx, yb, g, n, logOut)
		}
		return k.SoftmaxDimBackward(dx, yb, g, outer, n, inner, logOut)
	})
}

// causalDev is CausalSoftmax on a device (Kernels.CausalSoftmax and
// CausalSoftmaxBackward with scale 1, as the host).
func causalDev(t *Tape, d device.Device, spec *placement.Spec, x *Value) (*Value, error) {
	const op = "CausalSoftmax"
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	sh := spec.Shape()
	tt := sh[len(sh)-1]
	xb := bufOf(x.data)
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error { return devWrap(op, k.CausalSoftmax(y, xb, tt, 1)) })
	if err != nil {
		return nil, err
	}
	yb := bufOf(out)
	return devRecordUnary(t, op, x, spec, out, func(gs *placement.Spec, g, dx device.Buffer) error {
		return k.CausalSoftmaxBackward(dx, yb, g, tt, 1)
	})
}

// pointwiseDev is a pointwise activation on a device: Kernels.Pointwise
// and PointwiseBackward, saving x or (saveOut) the result.
func pointwiseDev(t *Tape, d device.Device, op string, f device.Pointwise, spec *placement.Spec, x *Value, saveOut bool) (*Value, error) {
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	xb := bufOf(x.data)
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error { return devWrap(op, k.Pointwise(f, y, xb)) })
	if err != nil {
		return nil, err
	}
	saved := xb
	if saveOut {
		saved = bufOf(out)
	}
	return devRecordUnary(t, op, x, spec, out, func(_ *placement.Spec, g, dx device.Buffer) error {
		return k.PointwiseBackward(f, dx, saved, g)
	})
}

// dropoutDev is Dropout on a device: the mask (Kernels.DropoutMask, the
// host's draw) is scratch kept for the backward, and both directions
// multiply by it.
func dropoutDev(t *Tape, d device.Device, x *Value, off, box []int, p float64, seed, step uint64) (*Value, error) {
	const op = "Dropout"
	spec := x.Spec()
	k, err := devKernels(op, d, spec.DType())
	if err != nil {
		return nil, err
	}
	xb := bufOf(x.data)
	mask, err := devBlock(t.scratch(), d, comm.Float32, xb.Len())
	if err != nil {
		return nil, err
	}
	if err := k.DropoutMask(mask, off, box, spec.Shape(), p, seed, step); err != nil {
		return nil, devWrap(op, err)
	}
	out, err := devResult(t.result(), d, spec, func(y device.Buffer) error { return devWrap(op, k.Mul(y, xb, mask)) })
	if err != nil {
		return nil, err
	}
	return devRecordUnary(t, op, x, spec, out, func(_ *placement.Spec, g, dx device.Buffer) error {
		return k.Mul(dx, g, mask)
	})
}

// argmaxDev is Argmax's local part on a device: Kernels.ArgmaxRows into
// a temporary, copied to the host (indices live there).
func argmaxDev(d device.Device, x *placement.DTensor, n int) ([]int64, error) {
	const op = "Argmax"
	k, err := devKernels(op, d, x.Spec().DType())
	if err != nil {
		return nil, err
	}
	xb := bufOf(x)
	rows := xb.Len() / n
	b, err := d.Alloc(comm.Int64, rows)
	if err != nil {
		return nil, devWrap(op, err)
	}
	out := make([]int64, rows)
	err = k.ArgmaxRows(b, xb, n)
	if err == nil {
		err = d.CopyToHost(comm.Host(out), b)
	}
	if err = errors.Join(err, b.Free()); err != nil {
		return nil, devWrap(op, err)
	}
	return out, nil
}
