package placement_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

var (
	R    = placement.Replicate()
	S0   = placement.Shard(0)
	S1   = placement.Shard(1)
	S2   = placement.Shard(2)
	Psum = placement.Partial(comm.Sum)
	Pavg = placement.Partial(comm.Avg)
	Pmax = placement.Partial(comm.Max)
	Pmin = placement.Partial(comm.Min)
)

// perAxis lists every single-axis placement for a tensor of rank ndim.
func perAxis(ndim int) []placement.Placement {
	out := []placement.Placement{R}
	for d := range ndim {
		out = append(out, placement.Shard(d))
	}
	return append(out, Psum, Pavg, Pmax, Pmin)
}

// validMix reports whether a placement list obeys the Partial mixing rule.
func validMix(ps []placement.Placement) bool {
	var ops []comm.ReduceOp
	for _, p := range ps {
		if p.IsPartial() && !slices.Contains(ops, p.Op()) {
			ops = append(ops, p.Op())
		}
	}
	if len(ops) <= 1 {
		return true
	}
	for _, op := range ops {
		if op == comm.Max || op == comm.Min {
			return false
		}
	}
	return true
}

// combos lists every valid placement list for n axes.
func combos(n, ndim int) [][]placement.Placement {
	var out [][]placement.Placement
	var rec func(prefix []placement.Placement)
	rec = func(prefix []placement.Placement) {
		if len(prefix) == n {
			if validMix(prefix) {
				out = append(out, slices.Clone(prefix))
			}
			return
		}
		for _, p := range perAxis(ndim) {
			rec(append(prefix, p))
		}
	}
	rec(nil)
	return out
}

// orderOpts returns WithOrder options that shuffle every multiply-sharded
// dim's axes with rng (nil rng: default order).
func orderOpts(m *mesh.Mesh, ps []placement.Placement, ndim int, rng *rand.Rand) []placement.SpecOption {
	if rng == nil {
		return nil
	}
	names := m.Names()
	var opts []placement.SpecOption
	for d := range ndim {
		var axes []string
		for a, p := range ps {
			if p.IsShard() && p.Dim() == d {
				axes = append(axes, names[a])
			}
		}
		if len(axes) > 1 {
			rng.Shuffle(len(axes), func(i, j int) { axes[i], axes[j] = axes[j], axes[i] })
			opts = append(opts, placement.WithOrder(d, axes...))
		}
	}
	return opts
}

// devices are the devices the parametrised tests run on: the host, and an
// emulated device per rank, on which the same plans run through the
// device path (Kernels.CopyBox, collectives on device buffers).
var devices = []struct {
	name string
	opts []placementtest.Option
}{
	{"host", nil},
	{"emu", []placementtest.Option{placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })}},
}

// onDevice copies a host tensor to the rank's device (itself on the
// host).
func onDevice(ctx context.Context, t *placement.DTensor) (*placement.DTensor, error) {
	return t.To(placementtest.Device(ctx))
}

// sameAsHost checks that got, computed on the rank's device, is there and
// equals want, the same computation on the host, bit for bit: the
// emulated device runs the host's arithmetic in the host's order.
func sameAsHost(ctx context.Context, got, want *placement.DTensor) error {
	d := placementtest.Device(ctx)
	if got.Device() != d {
		return fmt.Errorf("the result is on %s, want %s", got.Device().Name(), d.Name())
	}
	if d.Kind() == device.KindHost {
		return nil
	}
	if !got.Spec().Equal(want.Spec()) || !slices.Equal(got.LocalShape(), want.LocalShape()) {
		return fmt.Errorf("on %s: spec %v local shape %v, on the host %v %v", d.Name(), got.Spec(), got.LocalShape(), want.Spec(), want.LocalShape())
	}
	h, err := got.To(device.Host())
	if err != nil {
		return err
	}
	g, w := bits(h.LocalData()), bits(want.LocalData())
	if len(g) != len(w) {
		return fmt.Errorf("on %s: %d local elements, on the host %d", d.Name(), len(g), len(w))
	}
	for i := range g {
		if g[i] != w[i] {
			return fmt.Errorf("on %s: local element %d has bits %#x, on the host %#x", d.Name(), i, g[i], w[i])
		}
	}
	return nil
}

// bits are a []float32's or []float64's bit patterns.
func bits(d any) []uint64 {
	var out []uint64
	switch d := d.(type) {
	case []float32:
		for _, v := range d {
			out = append(out, uint64(math.Float32bits(v)))
		}
	case []float64:
		for _, v := range d {
			out = append(out, math.Float64bits(v))
		}
	}
	return out
}

// roundTrip distributes x by src on the rank's device, redistributes to
// dst and checks the full tensor, and on a device that the local result
// is the host's bit for bit; it returns a description on failure.
func roundTrip(ctx context.Context, p *placement.Planner, src, dst *placement.Spec, seed uint64, tol float64) error {
	x := placementtest.Random(src.Shape(), src.DType(), seed)
	hdt, err := placementtest.Distribute(src, x, seed+1)
	if err != nil {
		return fmt.Errorf("distribute %v: %w", src, err)
	}
	dt, err := onDevice(ctx, hdt)
	if err != nil {
		return err
	}
	if err := placementtest.CheckFull(ctx, dt, x, tol); err != nil {
		return fmt.Errorf("source %v: Full: %w", src, err)
	}
	out, err := p.Redistribute(ctx, dt, dst)
	if err != nil {
		return fmt.Errorf("%v -> %v: %w", src, dst, err)
	}
	if dt != hdt {
		hout, err := p.Redistribute(ctx, hdt, dst)
		if err != nil {
			return fmt.Errorf("%v -> %v on the host: %w", src, dst, err)
		}
		if err := sameAsHost(ctx, out, hout); err != nil {
			return fmt.Errorf("%v -> %v: %w", src, dst, err)
		}
	}
	if !out.Spec().Equal(dst) {
		return fmt.Errorf("%v -> %v: result spec %v", src, dst, out.Spec())
	}
	if want := dst.LocalShape(); !slices.Equal(out.LocalShape(), want) {
		return fmt.Errorf("%v -> %v: local shape %v, want %v", src, dst, out.LocalShape(), want)
	}
	if !slices.ContainsFunc(dst.Placements(), placement.Placement.IsPartial) {
		// Independent of Full: the local block must be x sliced by layout math.
		ref, err := placement.FromFull(dst, x)
		if err != nil {
			return err
		}
		if err := sameLocal(out, ref, tol); err != nil {
			pl, _ := p.Plan(src, dst)
			return fmt.Errorf("%v -> %v: local block: %w\n%v", src, dst, err, pl)
		}
	}
	if err := placementtest.CheckFull(ctx, out, x, tol); err != nil {
		pl, _ := p.Plan(src, dst)
		return fmt.Errorf("%v -> %v: %w\n%v", src, dst, err, pl)
	}
	return nil
}

func names(n int) []string { return []string{"a", "b", "c", "d"}[:n] }

// sameLocal compares two DTensors' local blocks (copied to the host).
func sameLocal(a, b *placement.DTensor, tol float64) error {
	if !slices.Equal(a.LocalShape(), b.LocalShape()) {
		return fmt.Errorf("local shape %v, want %v", a.LocalShape(), b.LocalShape())
	}
	ha, err := a.To(device.Host())
	if err != nil {
		return err
	}
	hb, err := b.To(device.Host())
	if err != nil {
		return err
	}
	av, bv := f64(ha.LocalData()), f64(hb.LocalData())
	if len(av) != len(bv) {
		return fmt.Errorf("%d local elements, want %d", len(av), len(bv))
	}
	for i := range av {
		if math.Abs(av[i]-bv[i]) > tol*math.Max(1, math.Abs(bv[i])) {
			return fmt.Errorf("local element %d is %g, want %g", i, av[i], bv[i])
		}
	}
	return nil
}

func f64(d any) []float64 {
	switch d := d.(type) {
	case []float32:
		out := make([]float64, len(d))
		for i, v := range d {
			out[i] = float64(v)
		}
		return out
	case []float64:
		return d
	}
	return nil
}

// runDevices is placementtest.Run once per entry of devices, each a
// subtest named after it.
func runDevices(t *testing.T, shape []int, names []string, fn func(ctx context.Context, m *mesh.Mesh) error) {
	t.Helper()
	for _, d := range devices {
		t.Run(d.name, func(t *testing.T) { placementtest.Run(t, shape, names, fn, d.opts...) })
	}
}
