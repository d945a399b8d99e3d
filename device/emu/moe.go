package emu

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/kernels"
)

var _ device.MoEKernels = emuKernels{}

// plan copies r for work that runs later: the caller may plan the next
// dispatch into r as soon as the method returns. Its kernels run with the
// device's thread budget (results do not depend on it).
func (k emuKernels) plan(op string, r *kernels.Routing) (*kernels.Routing, error) {
	if r == nil {
		return nil, fmt.Errorf("%s: %s: %w: nil routing plan", k.d.name, op, device.ErrInvalid)
	}
	w, err := k.workers()
	if err != nil {
		return nil, err
	}
	return &kernels.Routing{
		Tokens: r.Tokens, TopK: r.TopK, Experts: r.Experts, Capacity: r.Capacity,
		Counts: slices.Clone(r.Counts), Routed: slices.Clone(r.Routed), Offsets: slices.Clone(r.Offsets),
		RowSlot: slices.Clone(r.RowSlot), SlotRow: slices.Clone(r.SlotRow),
		Unrouted: r.Unrouted, Dropped: r.Dropped, Padded: r.Padded, Workers: w,
	}, nil
}

// Permute runs kernels.Permute.
func (k emuKernels) Permute(out, x device.Buffer, d int, r *kernels.Routing) error {
	const op = "Permute"
	v, err := k.check(op, f32("out", out), f32("x", x))
	if err != nil {
		return err
	}
	p, err := k.plan(op, r)
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error { return kernels.Permute(v[0].Float32s(), v[1].Float32s(), d, p) })
}

// Unpermute runs kernels.Unpermute.
func (k emuKernels) Unpermute(out, packed, gates device.Buffer, d int, r *kernels.Routing) error {
	const op = "Unpermute"
	v, err := k.check(op, f32("out", out), f32("packed", packed), optF32("gates", gates))
	if err != nil {
		return err
	}
	p, err := k.plan(op, r)
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		return kernels.Unpermute(v[0].Float32s(), v[1].Float32s(), float32s(v[2]), d, p)
	})
}

// UnpermuteBackward runs kernels.UnpermuteBackward.
func (k emuKernels) UnpermuteBackward(dpacked, dgates, dout, packed, gates device.Buffer, d int, r *kernels.Routing) error {
	const op = "UnpermuteBackward"
	v, err := k.check(op, optF32("dpacked", dpacked), optF32("dgates", dgates), f32("dout", dout), optF32("packed", packed), optF32("gates", gates))
	if err != nil {
		return err
	}
	p, err := k.plan(op, r)
	if err != nil {
		return err
	}
	return k.d.compute.launch(op, func() error {
		return kernels.UnpermuteBackward(float32s(v[0]), float32s(v[1]), v[2].Float32s(), float32s(v[3]), float32s(v[4]), d, p)
	})
}

// GroupByExpert runs kernels.GroupByExpert.
func (k emuKernels) GroupByExpert(dst, src device.Buffer, d int, counts []int, ranks, local int) error {
	return k.group("GroupByExpert", kernels.GroupByExpert[float32], dst, src, d, counts, ranks, local)
}

// GroupByRank runs kernels.GroupByRank.
func (k emuKernels) GroupByRank(dst, src device.Buffer, d int, counts []int, ranks, local int) error {
	return k.group("GroupByRank", kernels.GroupByRank[float32], dst, src, d, counts, ranks, local)
}

// group queues f, GroupByExpert or GroupByRank, on a copy of counts.
func (k emuKernels) group(op string, f func(dst, src []float32, d int, counts []int, ranks, local int) error,
	dst, src device.Buffer, d int, counts []int, ranks, local int) error {
	v, err := k.check(op, f32("dst", dst), f32("src", src))
	if err != nil {
		return err
	}
	c := slices.Clone(counts)
	return k.d.compute.launch(op, func() error { return f(v[0].Float32s(), v[1].Float32s(), d, c, ranks, local) })
}
