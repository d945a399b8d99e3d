package moe

import (
	"context"
	"fmt"
	"time"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// The layer on a device (package doc, "Devices"). Every step runs as on
// the host, in the same order on the same values, with the device's
// kernels in place of package kernels' (Kernels for the experts' GEMMs,
// GELU and sums, MoEKernels for the permutes), so the emulated device
// gives the host's results bit for bit. The router's logits cross to the
// host and its gates (K values a token) and two loss scalars come back
// (router.go); the rows' intermediate buffers are the tape's device
// scratch, not the Workspace (host memory), since the device's caching
// allocator already reuses them from step to step. Device ops are
// float32, as autograd's.

// ErrUnsupported marks a well-formed request the package has no form for:
// tokens on a device without MoE kernels (device.MoEKernels), or of a
// dtype other than float32 on a device. It matches loom.ErrUnsupported.
var ErrUnsupported = loom.NewSentinel("moe: unsupported", loom.ErrUnsupported)

// onDevice is the device side of a Handle: nil on the host.
type onDevice struct {
	d  device.Device
	k  device.Kernels
	mk device.MoEKernels
}

// deviceOf returns the device side for data dt of op, nil for host data.
func deviceOf(op string, dt *placement.DTensor) (*onDevice, error) {
	d := dt.Device()
	if d.Kind() == device.KindHost {
		return nil, nil
	}
	if t := dt.Spec().DType(); t != comm.Float32 {
		return nil, fmt.Errorf("%s: %w: %v tokens on %s: the device path is float32", op, ErrUnsupported, t, d.Name())
	}
	k := d.Kernels()
	mk, ok := k.(device.MoEKernels)
	if k == nil || !ok {
		return nil, fmt.Errorf("%s: %w: %s has no MoE kernels (device.MoEKernels)", op, ErrUnsupported, d.Name())
	}
	return &onDevice{d: d, k: k, mk: mk}, nil
}

// bufOf returns dt's local block as a buffer of dev's device.
func (dev *onDevice) bufOf(dt *placement.DTensor, what string) (device.Buffer, error) {
	b, ok := dt.LocalData().(device.Buffer)
	if !ok {
		return nil, fmt.Errorf("%w: %s: local block is %T, want a buffer of %s", ErrInvalid, what, dt.LocalData(), dev.d.Name())
	}
	if err := device.Same("moe: "+what, dev.d, b.Owner()); err != nil {
		return nil, err
	}
	return b, nil
}

// scratch and result are the tape's device buffers of n float32 values.
func (h *Handle) scratch(n int) (device.Buffer, error) {
	return autograd.ScratchBuffer(h.tape, h.dev.d, comm.Float32, n)
}

func (h *Handle) result(n int) (device.Buffer, error) {
	return autograd.ResultBuffer(h.tape, h.dev.d, comm.Float32, n)
}

// rowsBuf is rowsBlock on the device.
func (h *Handle) rowsBuf(n int, grad bool) (device.Buffer, error) {
	if grad {
		return h.scratch(n)
	}
	return h.result(n)
}

// rows returns rows [at, at+n) of width w of b.
func rows(b device.Buffer, at, n, w int) device.Buffer {
	return b.Slice(at*w, (at+n)*w).(device.Buffer)
}

// exchangeDev is exchangeRows on device buffers: the all-to-all-v ordered
// after the compute that wrote send, and the compute after it that reads
// recv.
func (h *Handle) exchangeDev(ctx context.Context, send, recv device.Buffer, sendRows, recvRows []int, w int, phase *Timings) error {
	if h.ranks == 1 {
		return nil
	}
	start := time.Now()
	defer func() { phase.PayloadExchange += time.Since(start) }()
	sc, rc := make([]int, h.ranks), make([]int, h.ranks)
	for q := range h.ranks {
		sc[q], rc[q] = sendRows[q]*w, recvRows[q]*w
	}
	if err := device.BeforeCollective(h.c, h.dev.d); err != nil {
		return fmt.Errorf("payload all-to-all-v over axis %q: %w", h.axis, err)
	}
	work, err := comm.AllToAllVAsync(ctx, h.c, send, recv, sc, rc)
	if err == nil {
		err = device.AfterCollective(ctx, work, h.dev.d)
	}
	if err != nil {
		return fmt.Errorf("payload all-to-all-v over axis %q: %w", h.axis, err)
	}
	return nil
}

// splitExchangeDev is splitExchange on device buffers.
func (h *Handle) splitExchangeDev(ctx context.Context, packed, routed device.Buffer, w int, toExperts bool, phase *Timings) error {
	p, l := h.ranks, h.local
	planRows, peerRows := make([]int, p), make([]int, p)
	at, from := 0, 0
	for j := range l {
		for q := range p {
			planRows[q] = h.planRows(q*l + j)
			peerRows[q] = h.chunks[q*l+j]
		}
		np, nr := sum(planRows), sum(peerRows)
		ps, rs := rows(packed, at, np, w), rows(routed, from, nr, w)
		var err error
		if toExperts {
			err = h.exchangeDev(ctx, ps, rs, planRows, peerRows, w, phase)
		} else {
			err = h.exchangeDev(ctx, rs, ps, peerRows, planRows, w, phase)
		}
		if err != nil {
			return fmt.Errorf("local expert %d: %w", j, err)
		}
		at, from = at+np, from+nr
	}
	return nil
}

// toExpertsDev is toExperts on the device.
func (h *Handle) toExpertsDev(ctx context.Context, packed device.Buffer, w int, grad bool, phase *Timings) (device.Buffer, error) {
	if h.ranks == 1 {
		return packed, nil
	}
	out, err := h.rowsBuf(sum(h.recv)*w, grad)
	if err != nil {
		return nil, err
	}
	if h.split {
		return out, h.splitExchangeDev(ctx, packed, out, w, true, phase)
	}
	recvd, err := h.scratch(sum(h.recv) * w)
	if err != nil {
		return nil, err
	}
	if err := h.exchangeDev(ctx, packed, recvd, h.send, h.recv, w, phase); err != nil {
		return nil, err
	}
	start := time.Now()
	if err := h.dev.mk.GroupByExpert(out, recvd, w, h.chunks, h.ranks, h.local); err != nil {
		return nil, err
	}
	phase.Permute += time.Since(start)
	return out, nil
}

// toTokensDev is toTokens on the device: the packed rows are always the
// tape's scratch.
func (h *Handle) toTokensDev(ctx context.Context, routed device.Buffer, w int, phase *Timings) (device.Buffer, error) {
	if h.ranks == 1 {
		return routed, nil
	}
	packed, err := h.scratch(h.plan.Rows() * w)
	if err != nil {
		return nil, err
	}
	if h.split {
		return packed, h.splitExchangeDev(ctx, packed, routed, w, false, phase)
	}
	start := time.Now()
	byRank, err := h.scratch(routed.Len())
	if err != nil {
		return nil, err
	}
	if err := h.dev.mk.GroupByRank(byRank, routed, w, h.chunks, h.ranks, h.local); err != nil {
		return nil, err
	}
	phase.Combine += time.Since(start)
	if err := h.exchangeDev(ctx, byRank, packed, h.recv, h.send, w, phase); err != nil {
		return nil, err
	}
	return packed, nil
}

// dispatchDev is dispatchAs on the device.
func (h *Handle) dispatchDev(ctx context.Context, x *placement.DTensor) (*placement.DTensor, error) {
	xb, err := h.dev.bufOf(x, "Dispatch")
	if err != nil {
		return nil, err
	}
	st := &h.stats.Forward
	start := time.Now()
	var packed device.Buffer
	if h.ranks == 1 {
		packed, err = h.result(h.plan.Rows() * h.d) // the result itself
	} else {
		packed, err = h.scratch(h.plan.Rows() * h.d)
	}
	if err != nil {
		return nil, err
	}
	if err := h.dev.mk.Permute(packed, xb, h.d, &h.plan); err != nil {
		return nil, err
	}
	st.Permute += time.Since(start)
	out, err := h.toExpertsDev(ctx, packed, h.d, false, st)
	if err != nil {
		return nil, err
	}
	return placement.NewLocalOn(h.routed, out)
}

// unpermuteDev is unpermuteAs on the device; keep, when not nil, gets the
// packed rows received.
func (h *Handle) unpermuteDev(ctx context.Context, y *placement.DTensor, gates device.Buffer, w int, spec *placement.Spec, grad bool, phase *Timings, local *time.Duration, keep *device.Buffer) (*placement.DTensor, error) {
	yb, err := h.dev.bufOf(y, "Combine")
	if err != nil {
		return nil, err
	}
	if err := h.wait(ctx, phase); err != nil {
		return nil, err
	}
	packed, err := h.toTokensDev(ctx, yb, w, phase)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	out, err := h.rowsBuf(h.n*w, grad)
	if err != nil {
		return nil, err
	}
	if err := h.dev.mk.Unpermute(out, packed, gates, w, &h.plan); err != nil {
		return nil, err
	}
	*local += time.Since(start)
	if keep != nil {
		*keep = packed
	}
	return placement.NewLocalOn(spec, out)
}

// combineDev is combineAs on the device.
func combineDev(ctx context.Context, cs *combineState) (*placement.DTensor, error) {
	h := cs.h
	var gates device.Buffer
	if cs.gates != nil {
		var err error
		if gates, err = h.dev.bufOf(cs.gates.Data(), "Combine gates"); err != nil {
			return nil, err
		}
	}
	var packed device.Buffer
	var keep *device.Buffer
	if cs.gates != nil && cs.gates.RequiresGrad() {
		keep = &packed
	}
	out, err := h.unpermuteDev(ctx, cs.y.Data(), gates, cs.width, cs.outSpec, false, &h.stats.Forward, &h.stats.Forward.Combine, keep)
	if err != nil {
		return nil, err
	}
	if keep != nil {
		cs.packed = packed
	}
	return out, nil
}

// combineBackwardDev is combineBackwardAs on the device.
func combineBackwardDev(ctx context.Context, cs *combineState, g *placement.DTensor) ([]*placement.DTensor, error) {
	h := cs.h
	places, err := h.gradPlaces(g, cs.outSpec, "the combined tokens")
	if err != nil {
		return nil, err
	}
	gd, err := h.dev.bufOf(g, "Combine backward")
	if err != nil {
		return nil, err
	}
	if err := h.wait(ctx, &h.stats.Backward); err != nil {
		return nil, err
	}
	var gates, dgates, packed device.Buffer
	if cs.gates != nil {
		if gates, err = h.dev.bufOf(cs.gates.Data(), "Combine gates"); err != nil {
			return nil, err
		}
		if cs.gates.RequiresGrad() {
			if dgates, err = h.scratch(h.n * h.k); err != nil {
				return nil, err
			}
			packed, _ = cs.packed.(device.Buffer)
		}
	}
	st := &h.stats.Backward
	start := time.Now()
	rowsGrad := cs.y.RequiresGrad()
	var dpacked device.Buffer
	if rowsGrad {
		if dpacked, err = h.scratch(h.plan.Rows() * cs.width); err != nil {
			return nil, err
		}
	}
	if rowsGrad || dgates != nil {
		if err := h.dev.mk.UnpermuteBackward(dpacked, dgates, gd, packed, gates, cs.width, &h.plan); err != nil {
			return nil, err
		}
	}
	st.Combine += time.Since(start)
	var dy device.Buffer
	if rowsGrad {
		if dy, err = h.toExpertsDev(ctx, dpacked, cs.width, true, st); err != nil {
			return nil, err
		}
	}
	return combineGradsDev(cs, places, dy, dgates)
}

// combineGradsDev is combineGrads for device buffers.
func combineGradsDev(cs *combineState, places []placement.Placement, dy, dgates device.Buffer) ([]*placement.DTensor, error) {
	var wrapGates func(*placement.Spec) (*placement.DTensor, error)
	if dgates != nil {
		wrapGates = func(s *placement.Spec) (*placement.DTensor, error) { return placement.NewLocalOn(s, dgates) }
	}
	return layoutCombineGrads(cs, places, func(s *placement.Spec) (*placement.DTensor, error) { return placement.NewLocalOn(s, dy) }, wrapGates)
}

// forwardDev is Experts.Forward on the device: the host's GEMMs, GELU and
// sums, expert by expert, through the device's Kernels on slices of the
// device buffers.
func (x *Experts) forwardDev(ctx context.Context, rows *autograd.Value, h *Handle, dev *onDevice) (*autograd.Value, error) {
	const op = "moe: Experts.Forward"
	run := &expertRun{x: x, h: h, rows: rows}
	out, err := autograd.Custom("moe.Experts", []*autograd.Value{rows, x.W1, x.B1, x.W2, x.B2},
		func() (*placement.DTensor, error) {
			start := time.Now()
			defer func() { h.stats.Forward.Experts += time.Since(start) }()
			return expertsForwardDev(run, dev)
		},
		func(_ context.Context, g *placement.DTensor) ([]*placement.DTensor, error) {
			start := time.Now()
			defer func() { h.stats.Backward.Experts += time.Since(start) }()
			return expertsBackwardDev(run, dev, g)
		})
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	return out, nil
}

// expertBufs returns the device blocks of the rows and the parameters.
func expertBufs(r *expertRun, dev *onDevice) (xs, w1, b1, w2, b2 device.Buffer, err error) {
	get := func(v *autograd.Value, what string) device.Buffer {
		if err != nil {
			return nil
		}
		var b device.Buffer
		b, err = dev.bufOf(v.Data(), what)
		return b
	}
	xs = get(r.rows, "Experts rows")
	w1 = get(r.x.W1, "Experts W1")
	b1 = get(r.x.B1, "Experts b1")
	w2 = get(r.x.W2, "Experts W2")
	b2 = get(r.x.B2, "Experts b2")
	return
}

// gemmDev queues c = op(a)·op(b) (row-major) on the device, as gemm: in
// bfloat16 when r's tape autocasts.
func gemmDev(r *expertRun, k device.Kernels, ta, tb bool, m, n, kk int, a device.Buffer, lda int, b device.Buffer, ldb int, c device.Buffer, ldc int) error {
	p := device.GemmF32
	if r.rows.Tape().Autocast() && a.DType() == comm.Float32 {
		p = device.GemmBF16
	}
	return k.Gemm(device.Gemm{TransA: ta, TransB: tb, M: m, N: n, K: kk, A: a, LDA: lda, B: b, LDB: ldb, C: c, LDC: ldc, Alpha: 1, Precision: p})
}

func expertsForwardDev(r *expertRun, dev *onDevice) (*placement.DTensor, error) {
	xs, w1, b1, w2, b2, err := expertBufs(r, dev)
	if err != nil {
		return nil, err
	}
	k := dev.k
	hd, d := r.x.hd, r.x.d
	total := xs.Len() / max(d, 1)
	h := r.h
	act, err := h.scratch(total * hd)
	if err != nil {
		return nil, err
	}
	deriv, err := h.scratch(total * hd)
	if err != nil {
		return nil, err
	}
	out, err := h.result(total * d)
	if err != nil {
		return nil, err
	}
	// b2 is added row by row after the second GEMM, as the host does
	// (out + b2, one rounding), from rows of b2 made by FillRows.
	bias, err := h.scratch(slicesMax(h.expertRows) * d)
	if err != nil {
		return nil, err
	}
	off := 0
	for l, c := range h.expertRows {
		if c == 0 {
			continue
		}
		expert := h.rank*h.local + l
		xl, al, dl, ol := rows(xs, off, c, d), rows(act, off, c, hd), rows(deriv, off, c, hd), rows(out, off, c, d)
		w1l, w2l := rows(w1, l, 1, hd*d), rows(w2, l, 1, d*hd)
		b1l, b2l := rows(b1, l, 1, hd), rows(b2, l, 1, d)
		// u = x·W1ᵀ, h = GELU(u + b1), o = h·W2ᵀ + b2.
		if err := gemmDev(r, k, false, true, c, hd, d, xl, d, w1l, d, al, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := k.BiasGELU(al, dl, al, b1l, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := gemmDev(r, k, false, true, c, d, hd, al, hd, w2l, hd, ol, d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		bl := rows(bias, 0, c, d)
		if err := k.FillRows(bl, b2l); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := k.Add(ol, ol, bl); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		off += c
	}
	r.act, r.deriv = act, deriv
	return placement.NewLocalOn(h.routed, out)
}

func slicesMax(v []int) int {
	m := 0
	for _, x := range v {
		m = max(m, x)
	}
	return m
}

func expertsBackwardDev(r *expertRun, dev *onDevice, g *placement.DTensor) ([]*placement.DTensor, error) {
	h, x := r.h, r.x
	places, err := h.gradPlaces(g, h.routed, "the experts' output")
	if err != nil {
		return nil, err
	}
	xs, w1, _, w2, _, err := expertBufs(r, dev)
	if err != nil {
		return nil, err
	}
	gd, err := dev.bufOf(g, "Experts backward")
	if err != nil {
		return nil, err
	}
	act, _ := r.act.(device.Buffer)
	deriv, _ := r.deriv.(device.Buffer)
	if act == nil || deriv == nil {
		return nil, fmt.Errorf("%w: Experts backward: no saved activations on %s", ErrInvalid, dev.d.Name())
	}
	k := dev.k
	hd, d, l := x.hd, x.d, h.local
	grads := make([]device.Buffer, 5)
	for i, n := range []int{xs.Len(), l * hd * d, l * hd, l * d * hd, l * d} {
		if grads[i], err = h.scratch(n); err != nil {
			return nil, err
		}
	}
	dx, dw1, db1, dw2, db2 := grads[0], grads[1], grads[2], grads[3], grads[4]
	du, err := h.scratch(slicesMax(h.expertRows) * hd)
	if err != nil {
		return nil, err
	}
	off := 0
	for j, c := range h.expertRows {
		dw1j, db1j, dw2j, db2j := rows(dw1, j, 1, hd*d), rows(db1, j, 1, hd), rows(dw2, j, 1, d*hd), rows(db2, j, 1, d)
		if c == 0 { // an expert without rows: zero gradients
			for _, b := range []device.Buffer{dw1j, db1j, dw2j, db2j} {
				if err := k.Fill(b, 0); err != nil {
					return nil, err
				}
			}
			continue
		}
		xl, gl := rows(xs, off, c, d), rows(gd, off, c, d)
		al, dl := rows(act, off, c, hd), rows(deriv, off, c, hd)
		w1l, w2l := rows(w1, j, 1, hd*d), rows(w2, j, 1, d*hd)
		duj := rows(du, 0, c, hd)
		expert := h.rank*l + j
		// dW2 = gᵀ·h, db2 = Σ_rows g, dh = g·W2, du = dh ⊙ GELU'(u),
		// db1 = Σ_rows du, dW1 = duᵀ·x, dx = du·W1.
		if err := gemmDev(r, k, true, false, d, hd, c, gl, d, al, hd, dw2j, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := k.ColumnSums(db2j, gl, d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := gemmDev(r, k, false, false, c, hd, d, gl, d, w2l, hd, duj, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := k.BiasGELUBackward(duj, db1j, duj, dl, hd); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := gemmDev(r, k, true, false, hd, d, c, duj, hd, xl, d, dw1j, d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		if err := gemmDev(r, k, false, false, c, d, hd, duj, hd, w1l, d, rows(dx, off, c, d), d); err != nil {
			return nil, fmt.Errorf("expert %d: %w", expert, err)
		}
		off += c
	}
	dxSpec, err := gradSpec(h.routed, d, places)
	if err != nil {
		return nil, err
	}
	pp := x.paramGradPlaces(h, places)
	out := make([]*placement.DTensor, 5)
	if out[0], err = placement.NewLocalOn(dxSpec, dx); err != nil {
		return nil, err
	}
	for i, v := range []*autograd.Value{x.W1, x.B1, x.W2, x.B2} {
		spec, err := placement.NewSpec(h.xs.Mesh(), v.Spec().Shape(), x.dtype, pp)
		if err != nil {
			return nil, err
		}
		if out[i+1], err = placement.NewLocalOn(spec, grads[i+1]); err != nil {
			return nil, err
		}
	}
	return out, nil
}
