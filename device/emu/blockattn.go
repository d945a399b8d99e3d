package emu

import (
	"slices"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

var _ device.BlockAttentionKernels = emuKernels{}

// own copies the shape's position slices: the caller may reuse them once
// the method has returned, before the work runs.
func own(s kernels.BlockAttnShape) kernels.BlockAttnShape {
	s.QPos, s.KPos = slices.Clone(s.QPos), slices.Clone(s.KPos)
	return s
}

// optFl is an optional fl.
func optFl(name string, b device.Buffer) arg {
	a := fl(name, b)
	a.optional = true
	return a
}

// BlockAttention runs kernels.BlockAttentionForward on Float32 or Float64
// buffers of one type, its GEMMs on the device's BLAS.
func (k emuKernels) BlockAttention(out, lse, q, kk, vv device.Buffer, s kernels.BlockAttnShape) error {
	const op = "BlockAttention"
	v, err := k.checkFloats(op, fl("out", out), fl("lse", lse), fl("q", q), fl("k", kk), fl("v", vv))
	if err != nil {
		return err
	}
	bl, err := k.d.blasOrDefault()
	if err != nil {
		return err
	}
	w := kernels.Workers(bl.Threads())
	s = own(s)
	return k.launchFloat(op, v,
		func() error {
			return kernels.BlockAttentionForward(bl, w, v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), v[3].Float32s(), v[4].Float32s(), s)
		},
		func() error {
			return kernels.BlockAttentionForward(bl, w, v[0].Float64s(), v[1].Float64s(), v[2].Float64s(), v[3].Float64s(), v[4].Float64s(), s)
		})
}

// MergeAttention runs kernels.MergeAttention.
func (k emuKernels) MergeAttention(out, lse, o2, lse2 device.Buffer, dv int) error {
	const op = "MergeAttention"
	v, err := k.checkFloats(op, fl("out", out), fl("lse", lse), fl("o2", o2), fl("lse2", lse2))
	if err != nil {
		return err
	}
	return k.launchFloat(op, v,
		func() error {
			return kernels.MergeAttention(v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), v[3].Float32s(), dv)
		},
		func() error {
			return kernels.MergeAttention(v[0].Float64s(), v[1].Float64s(), v[2].Float64s(), v[3].Float64s(), dv)
		})
}

// AttentionRowDots runs kernels.AttentionRowDots.
func (k emuKernels) AttentionRowDots(delta, dout, out device.Buffer, dv int) error {
	const op = "AttentionRowDots"
	v, err := k.checkFloats(op, fl("delta", delta), fl("dout", dout), fl("out", out))
	if err != nil {
		return err
	}
	return k.launchFloat(op, v,
		func() error { return kernels.AttentionRowDots(v[0].Float32s(), v[1].Float32s(), v[2].Float32s(), dv) },
		func() error { return kernels.AttentionRowDots(v[0].Float64s(), v[1].Float64s(), v[2].Float64s(), dv) })
}

// BlockAttentionBackward runs kernels.BlockAttentionBackward; dq, dk and
// dv may be nil.
func (k emuKernels) BlockAttentionBackward(dq, dk, dv, dout, q, kk, vv, lse, delta device.Buffer, s kernels.BlockAttnShape) error {
	const op = "BlockAttentionBackward"
	v, err := k.checkFloats(op, fl("dout", dout), optFl("dq", dq), optFl("dk", dk), optFl("dv", dv),
		fl("q", q), fl("k", kk), fl("v", vv), fl("lse", lse), fl("delta", delta))
	if err != nil {
		return err
	}
	bl, err := k.d.blasOrDefault()
	if err != nil {
		return err
	}
	w := kernels.Workers(bl.Threads())
	s = own(s)
	return k.launchFloat(op, v,
		func() error {
			return kernels.BlockAttentionBackward(bl, w, float32s(v[1]), float32s(v[2]), float32s(v[3]), v[0].Float32s(),
				v[4].Float32s(), v[5].Float32s(), v[6].Float32s(), v[7].Float32s(), v[8].Float32s(), s)
		},
		func() error {
			return kernels.BlockAttentionBackward(bl, w, float64s(v[1]), float64s(v[2]), float64s(v[3]), v[0].Float64s(),
				v[4].Float64s(), v[5].Float64s(), v[6].Float64s(), v[7].Float64s(), v[8].Float64s(), s)
		})
}
