package cuda

import (
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

// The device's device.MoEKernels: package moe's permute kernels
// (permute.cu, through a MoE on the compute stream), with the routing's
// row maps copied into scratch from the allocator at each call and freed
// once the kernels are queued (stream-ordered reuse), so the caller may
// plan the next routing at once.

var _ device.MoEKernels = cudaKernels{}

// moe returns the device's MoE, compiling permute.cu at the first use.
func (d *Device) moe(op string) (*MoE, error) {
	d.fnMu.Lock()
	defer d.fnMu.Unlock()
	if d.moeK != nil {
		return d.moeK, nil
	}
	m, err := NewMoE(d.ctx, WithStream(d.compute))
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", d.name, op, err)
	}
	d.moeK = m
	return m, nil
}

// int32s copies idx into a scratch Int32 buffer on the compute stream
// (pageable memory: idx has been read when it returns).
func (k cudaKernels) int32s(idx []int32) (*DeviceBuffer, error) {
	b, err := k.scratch(comm.Int32, len(idx))
	if err != nil {
		return nil, err
	}
	if err := CopyToDeviceAsync(k.d.compute, b.raw(), idx); err != nil {
		_ = b.Free() // the copy's error is the one to report
		return nil, fmt.Errorf("%s: %w", k.d.name, err)
	}
	return b, nil
}

// wrap puts the device's name before an error of the MoE's.
func (k cudaKernels) wrap(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", k.d.name, err)
}

// withRouting checks r as MoE.Upload does, copies its maps to the device
// and runs f with them, then frees them.
func (k cudaKernels) withRouting(op string, r *kernels.Routing, f func(m *MoE, dr *DeviceRouting) error) error {
	if r == nil {
		return k.invalid(op, "nil Routing")
	}
	slots, rows := len(r.SlotRow), len(r.RowSlot)
	if r.TopK < 1 || slots != r.Tokens*r.TopK || rows != r.Rows() {
		return k.invalid(op, "Routing is not planned (tokens %d, top-k %d, %d rows, %d slot map, %d row map)",
			r.Tokens, r.TopK, r.Rows(), slots, rows)
	}
	if err := firstErr(checkIndex(op+": RowSlot", r.RowSlot, slots), checkIndex(op+": SlotRow", r.SlotRow, rows)); err != nil {
		return err
	}
	m, err := k.d.moe(op)
	if err != nil {
		return err
	}
	rs, err := k.int32s(r.RowSlot)
	if err != nil {
		return err
	}
	defer func() { _ = rs.Free() }() // a live owning buffer's Free fails only on a bug
	sr, err := k.int32s(r.SlotRow)
	if err != nil {
		return err
	}
	defer func() { _ = sr.Free() }()
	return f(m, &DeviceRouting{Tokens: r.Tokens, TopK: r.TopK, Rows: rows, RowSlot: rs.raw(), SlotRow: sr.raw(), ctx: k.d.ctx})
}

// permLen checks that b holds rows rows of d.
func (k cudaKernels) permLen(op, name string, b *DeviceBuffer, rows, d int) error {
	if b != nil && b.Len() != rows*d {
		return k.invalid(op, "%s has %d elements, want %d rows of %d", name, b.Len(), rows, d)
	}
	return nil
}

// Permute is kernels.Permute by permute.cu's row gather: packed row p of
// out is token row RowSlot[p]/K of x, pad rows zero. Bit-exact.
func (k cudaKernels) Permute(out, x device.Buffer, d int, r *kernels.Routing) error {
	const op = "Permute"
	v, err := k.check(op, f32("out", out), f32("x", x))
	if err != nil {
		return err
	}
	return k.withRouting(op, r, func(m *MoE, dr *DeviceRouting) error {
		if err := firstErr(k.permLen(op, "out", v[0], dr.Rows, d), k.permLen(op, "x", v[1], dr.Tokens, d)); err != nil {
			return err
		}
		return k.wrap(m.Permute(Float32, v[0].raw(), v[1].raw(), d, dr))
	})
}

// Unpermute is kernels.Unpermute by permute.cu: token row t of out is the
// gate-weighted sum of its live slots' packed rows in slot order; gates
// may be nil (weights 1).
func (k cudaKernels) Unpermute(out, packed, gates device.Buffer, d int, r *kernels.Routing) error {
	const op = "Unpermute"
	v, err := k.check(op, f32("out", out), f32("packed", packed), optF32("gates", gates))
	if err != nil {
		return err
	}
	return k.withRouting(op, r, func(m *MoE, dr *DeviceRouting) error {
		if err := firstErr(k.permLen(op, "out", v[0], dr.Tokens, d), k.permLen(op, "packed", v[1], dr.Rows, d),
			k.permLen(op, "gates", v[2], dr.Tokens*dr.TopK, 1)); err != nil {
			return err
		}
		return k.wrap(m.Unpermute(Float32, v[0].raw(), v[1].raw(), v[2].raw(), d, dr))
	})
}

// UnpermuteBackward is kernels.UnpermuteBackward by permute.cu: dpacked
// (or nil) gets the gate-scaled rows of dout, dgates (or nil) the dot
// products, in double, of packed's rows with dout's.
func (k cudaKernels) UnpermuteBackward(dpacked, dgates, dout, packed, gates device.Buffer, d int, r *kernels.Routing) error {
	const op = "UnpermuteBackward"
	v, err := k.check(op, optF32("dpacked", dpacked), optF32("dgates", dgates), f32("dout", dout), optF32("packed", packed), optF32("gates", gates))
	if err != nil {
		return err
	}
	if v[1] != nil && v[3] == nil {
		return k.invalid(op, "dgates without packed")
	}
	return k.withRouting(op, r, func(m *MoE, dr *DeviceRouting) error {
		slots := dr.Tokens * dr.TopK
		if err := firstErr(k.permLen(op, "dout", v[2], dr.Tokens, d), k.permLen(op, "dpacked", v[0], dr.Rows, d),
			k.permLen(op, "dgates", v[1], slots, 1), k.permLen(op, "gates", v[4], slots, 1)); err != nil {
			return err
		}
		if v[1] != nil {
			if err := k.permLen(op, "packed", v[3], dr.Rows, d); err != nil {
				return err
			}
		}
		return k.wrap(m.UnpermuteBackward(Float32, v[0].raw(), v[1].raw(), v[2].raw(), v[3].raw(), v[4].raw(), d, dr))
	})
}

// GroupByExpert is kernels.GroupByExpert: a row gather by GroupIndex's
// map. Bit-exact.
func (k cudaKernels) GroupByExpert(dst, src device.Buffer, d int, counts []int, ranks, local int) error {
	return k.group("GroupByExpert", dst, src, d, counts, ranks, local, true)
}

// GroupByRank is kernels.GroupByRank, GroupByExpert's inverse.
func (k cudaKernels) GroupByRank(dst, src device.Buffer, d int, counts []int, ranks, local int) error {
	return k.group("GroupByRank", dst, src, d, counts, ranks, local, false)
}

// group regroups the rows of src into dst by GroupIndex's map and
// MoE.Gather.
func (k cudaKernels) group(op string, dst, src device.Buffer, d int, counts []int, ranks, local int, toExpert bool) error {
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	if d < 0 {
		return k.invalid(op, "negative row width %d", d)
	}
	idx, err := GroupIndex(counts, ranks, local, toExpert)
	if err != nil {
		return fmt.Errorf("%s: %s: %w", k.d.name, op, err)
	}
	if err := firstErr(k.permLen(op, "src", v[1], len(idx), d), k.permLen(op, "dst", v[0], len(idx), d)); err != nil {
		return err
	}
	m, err := k.d.moe(op)
	if err != nil {
		return err
	}
	b, err := k.int32s(idx)
	if err != nil {
		return err
	}
	defer func() { _ = b.Free() }() // a live owning buffer's Free fails only on a bug
	rm := &RowMap{Rows: len(idx), SrcRows: len(idx), Idx: b.raw(), ctx: k.d.ctx}
	return k.wrap(m.Gather(v[0].raw(), v[1].raw(), 4*d, rm))
}
