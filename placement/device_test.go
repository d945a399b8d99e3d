package placement_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestToAndNewLocalOn: a block moves to an emulated device and back
// unchanged (empty shards included), NewLocalOn wraps a device buffer and
// checks it, and a host buffer becomes a host block.
func TestToAndNewLocalOn(t *testing.T) {
	placementtest.Run(t, []int{4}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(m.Rank())
		if err != nil {
			return err
		}
		defer d.Close()
		// 3 rows of 2 over 4 ranks: rank 3's shard is empty.
		spec64, err := placement.NewSpec(m, []int{3, 2}, comm.Float64, []placement.Placement{S0})
		if err != nil {
			return err
		}
		host64, err := placement.FromFull(spec64, []float64{1, 2, 3, 4, 5, 6})
		if err != nil {
			return err
		}
		on64, err := host64.To(d)
		if err != nil {
			return err
		}
		back64, err := on64.To(nil)
		if err != nil || !slices.Equal(back64.LocalData().([]float64), host64.LocalData().([]float64)) {
			return fmt.Errorf("float64 round trip: %v, %v", back64, err)
		}
		spec, err := placement.NewSpec(m, []int{3, 2}, comm.Float32, []placement.Placement{S0})
		if err != nil {
			return err
		}
		full := []float32{1, 2, 3, 4, 5, 6}
		host, err := placement.FromFull(spec, full)
		if err != nil {
			return err
		}
		on, err := host.To(d)
		if err != nil {
			return err
		}
		if on.Device() != device.Device(d) || host.Device().Kind() != device.KindHost {
			return fmt.Errorf("devices %s and %s", on.Device().Name(), host.Device().Name())
		}
		if b, ok := on.LocalData().(device.Buffer); !ok || b.Len() != len(host.LocalData().([]float32)) {
			return fmt.Errorf("device block %T", on.LocalData())
		}
		if same, _ := on.To(d); same != on {
			return fmt.Errorf("To its own device copied")
		}
		back, err := on.To(device.Host())
		if err != nil {
			return err
		}
		if !slices.Equal(back.LocalData().([]float32), host.LocalData().([]float32)) {
			return fmt.Errorf("round trip: %v, want %v", back.LocalData(), host.LocalData())
		}

		n := len(host.LocalData().([]float32))
		b, err := d.Alloc(comm.Float32, n)
		if err != nil {
			return err
		}
		wrapped, err := placement.NewLocalOn(spec, b)
		if err != nil || wrapped.LocalBuffer() != comm.Buffer(b) {
			return fmt.Errorf("NewLocalOn: %v", err)
		}
		long, err := d.Alloc(comm.Float32, n+1)
		if err != nil {
			return err
		}
		if _, err := placement.NewLocalOn(spec, long); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "elements") {
			return fmt.Errorf("wrong length: %v", err)
		}
		wide, err := d.Alloc(comm.Float64, n)
		if err != nil {
			return err
		}
		if _, err := placement.NewLocalOn(spec, wide); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "float64") {
			return fmt.Errorf("wrong dtype: %v", err)
		}
		hb, err := device.Host().Alloc(comm.Float32, n)
		if err != nil {
			return err
		}
		onHost, err := placement.NewLocalOn(spec, hb)
		if err != nil {
			return err
		}
		if _, ok := onHost.LocalData().([]float32); !ok {
			return fmt.Errorf("a host buffer gave %T, want []float32", onHost.LocalData())
		}
		if _, err := placement.FromFull(spec, b); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), "To(device.Host())") {
			return fmt.Errorf("FromFull of a device buffer: %v", err)
		}
		return nil
	})
}

// TestDeviceConstructors: every way in and out of a DTensor on an
// emulated device per rank: FromFull, FromRoot and FromLocal with
// WithDevice, FromLocal of a device buffer (copied on the device), Full
// back to the host, and the errors that name the device; with empty
// shards and a tensor with no elements.
func TestDeviceConstructors(t *testing.T) {
	onEmu := placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })
	placementtest.Run(t, []int{2, 2}, []string{"a", "b"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		on := placement.WithDevice(d)
		for _, tc := range []struct {
			shape  []int
			places []placement.Placement
		}{
			{[]int{3, 5}, []placement.Placement{S0, S1}}, // uneven, and rank (1, 1) holds 1 row
			{[]int{1, 3}, []placement.Placement{S0, Psum}},
			{[]int{4, 0}, []placement.Placement{S0, S1}},
			{[]int{2, 3}, []placement.Placement{R, R}},
			{nil, []placement.Placement{R, Psum}},
		} {
			for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
				spec, err := placement.NewSpec(m, tc.shape, dt, tc.places)
				if err != nil {
					return err
				}
				full := placementtest.Random(tc.shape, dt, 3)
				ref, err := placement.FromFull(spec, full)
				if err != nil {
					return err
				}
				what := fmt.Sprint(tc.shape, dt, tc.places)
				check := func(how string, x *placement.DTensor) error {
					if x.Device() != d {
						return fmt.Errorf("%s %s: on %s, want %s", what, how, x.Device().Name(), d.Name())
					}
					if err := sameAsHost(ctx, x, ref); err != nil {
						return fmt.Errorf("%s %s: %w", what, how, err)
					}
					got, err := x.Full(ctx)
					if err != nil {
						return fmt.Errorf("%s %s: Full: %w", what, how, err)
					}
					want, err := ref.Full(ctx)
					if err != nil {
						return err
					}
					if fmt.Sprintf("%T", got) != fmt.Sprintf("%T", want) || !slices.Equal(bits(got), bits(want)) || got == nil {
						return fmt.Errorf("%s %s: Full = %v, want %v", what, how, got, want)
					}
					return nil
				}
				x, err := placement.FromFull(spec, full, on)
				if err != nil {
					return err
				}
				if err := check("FromFull", x); err != nil {
					return err
				}
				var root any
				if m.Rank() == 2 {
					root = full
				}
				r, err := placement.FromRoot(ctx, spec, root, 2, on)
				if err != nil {
					return err
				}
				if err := check("FromRoot", r); err != nil {
					return err
				}
				l, err := placement.FromLocal(ctx, spec, x.LocalData(), true)
				if err != nil {
					return err
				}
				if l.LocalData() == x.LocalData() {
					return fmt.Errorf("%s: FromLocal of a device buffer did not copy it", what)
				}
				if err := check("FromLocal(device buffer)", l); err != nil {
					return err
				}
				h, err := placement.FromLocal(ctx, spec, ref.LocalData(), false, on)
				if err != nil {
					return err
				}
				if err := check("FromLocal(host, OnDevice)", h); err != nil {
					return err
				}
			}
		}

		spec, err := placement.NewSpec(m, []int{4, 3}, comm.Float32, []placement.Placement{S0, R})
		if err != nil {
			return err
		}
		long, err := d.Alloc(comm.Float32, 7)
		if err != nil {
			return err
		}
		if _, err := placement.FromLocal(ctx, spec, long, false); !errors.Is(err, placement.ErrInvalid) || !strings.Contains(err.Error(), d.Name()) {
			return fmt.Errorf("FromLocal of a long buffer: %v", err)
		}
		if _, err := placement.FromFull(spec, make([]float32, 12), nil); !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("a nil option: %v", err)
		}
		var root any = long
		if _, err := placement.FromRoot(ctx, spec, root, 0, on); !errors.Is(err, placement.ErrInvalid) {
			return fmt.Errorf("FromRoot of a device buffer: %v", err)
		}
		return long.Free()
	}, onEmu)
}

// TestDeviceExecute: Execute on a device allocates its result on the
// device, never returns its input unless WithReuseInput (then a reduction
// runs in place, in the input's buffer), leaves nothing allocated but its
// result, and Inner and ExtremumGrad refuse tensors on two devices.
func TestDeviceExecute(t *testing.T) {
	onEmu := placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })
	placementtest.Run(t, []int{3}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		var p placement.Planner
		src, _ := placement.NewSpec(m, []int{5, 2}, comm.Float64, []placement.Placement{Psum})
		dst, _ := src.With([]placement.Placement{R})
		full := placementtest.Random([]int{5, 2}, comm.Float64, 9)
		hx, err := placementtest.Distribute(src, full, 10)
		if err != nil {
			return err
		}
		x, err := hx.To(d)
		if err != nil {
			return err
		}
		before := d.Memory().Stats().Allocated
		pl, err := p.Plan(src, dst)
		if err != nil {
			return err
		}
		y, err := p.Execute(ctx, pl, x, nil)
		if err != nil {
			return err
		}
		if y.LocalData() == x.LocalData() {
			return fmt.Errorf("Execute without ReuseInput returned its input's buffer")
		}
		if grew := d.Memory().Stats().Allocated - before; grew != 512 { // one 80-byte block, rounded
			return fmt.Errorf("Execute left %d bytes allocated, want the result's 512", grew)
		}
		if err := placementtest.CheckFull(ctx, y, full, 1e-12); err != nil {
			return err
		}
		z, err := p.Execute(ctx, pl, x, nil, placement.WithReuseInput())
		if err != nil {
			return err
		}
		if z.LocalData() != x.LocalData() {
			return fmt.Errorf("Execute with ReuseInput of P(sum) -> R did not all-reduce in place")
		}
		hy, err := y.To(device.Host())
		if err != nil {
			return err
		}
		if err := sameAsHost(ctx, z, hy); err != nil {
			return err
		}
		// R -> P(sum) keeps rank 0's block as it is: still a copy.
		ps, _ := src.With([]placement.Placement{Psum})
		w, err := p.Redistribute(ctx, y, ps)
		if err != nil {
			return err
		}
		if w.LocalData() == y.LocalData() {
			return fmt.Errorf("R -> P(sum) returned its input's buffer on rank %d", m.Rank())
		}
		if _, err := placement.Inner(ctx, y, hx); !errors.Is(err, device.ErrMixed) || !strings.Contains(err.Error(), d.Name()) {
			return fmt.Errorf("Inner on two devices: %v", err)
		}
		mspec, _ := src.With([]placement.Placement{Pmax})
		xm, err := placement.FromFull(mspec, full, placement.WithDevice(d))
		if err != nil {
			return err
		}
		ym, err := p.Redistribute(ctx, xm, dst)
		if err != nil {
			return err
		}
		if _, err := p.ExtremumGrad(ctx, xm, ym, hy); !errors.Is(err, device.ErrMixed) || !strings.Contains(err.Error(), d.Name()) {
			return fmt.Errorf("ExtremumGrad on two devices: %v", err)
		}
		return nil
	}, onEmu)
}

// TestDeviceExtremumGradErrorFrees: ExtremumGrad on a device lays the
// gradient out like x in a device block of its own; when a later step
// fails (here copying x's block, which was freed) that block goes back
// to the allocator: the device holds after the error exactly what it held
// before the call.
func TestDeviceExtremumGradErrorFrees(t *testing.T) {
	onEmu := placementtest.WithDevice(func(r int) (device.Device, error) { return emu.New(r) })
	placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d := placementtest.Device(ctx)
		var p placement.Planner
		full := placementtest.Random([]int{4, 3}, comm.Float32, 5)
		mspec, _ := placement.NewSpec(m, []int{4, 3}, comm.Float32, []placement.Placement{Pmax})
		rspec, _ := mspec.With([]placement.Placement{R})
		x, err := placement.FromFull(mspec, full, placement.WithDevice(d))
		if err != nil {
			return err
		}
		y, err := p.Redistribute(ctx, x, rspec)
		if err != nil {
			return err
		}
		g, err := placement.FromFull(rspec, full, placement.WithDevice(d))
		if err != nil {
			return err
		}
		if err := x.LocalData().(device.Buffer).Free(); err != nil {
			return err
		}
		if err := d.Synchronize(); err != nil {
			return err
		}
		before := d.Memory().Stats().Allocated
		if _, err := p.ExtremumGrad(ctx, x, y, g); !errors.Is(err, device.ErrInvalid) || !strings.Contains(err.Error(), "copying x's block") {
			return fmt.Errorf("ExtremumGrad with x's block freed: %v, want the copy's error", err)
		}
		if err := d.Synchronize(); err != nil {
			return err
		}
		if after := d.Memory().Stats().Allocated; after != before {
			return fmt.Errorf("after the failed ExtremumGrad %s holds %d bytes, %d before it", d.Name(), after, before)
		}
		return nil
	}, onEmu)
}
