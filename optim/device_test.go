package optim_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/optim"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// stepper is what the device tests need of an optimizer.
type stepper interface {
	Step() error
	Close() error
	StateBytes() int64
}

// deviceParam is one parameter of the device tests: its global shape and
// placement on a one-axis mesh.
type deviceParam struct {
	name  string
	shape []int
	place placement.Placement
}

// deviceParams are odd shapes: a sharded matrix whose rows split 3 and 2
// over two ranks, and a replicated vector of a vector width and a tail.
var deviceParams = []deviceParam{
	{"w", []int{5, 3}, placement.Shard(0)},
	{"b", []int{11}, placement.Replicate()},
}

// randomFull returns n values in [-2, 2) as dt's slice.
func randomFull(r *rand.Rand, dt comm.DType, n int) any {
	if dt == comm.Float64 {
		s := make([]float64, n)
		for i := range s {
			s[i] = r.Float64()*4 - 2
		}
		return s
	}
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.Float64()*4 - 2)
	}
	return s
}

// blockBytes returns the bytes of t's local block, copied to the host.
func blockBytes(t *placement.DTensor) ([]byte, error) {
	b, ok := t.LocalData().(device.Buffer)
	if !ok {
		return t.LocalBuffer().(*comm.HostBuffer).Bytes(), nil
	}
	h, err := comm.NewHostBuffer(b.DType(), b.Len())
	if err != nil {
		return nil, err
	}
	if err := b.Owner().CopyToHost(h, b); err != nil {
		return nil, err
	}
	return h.Bytes(), nil
}

// TestDeviceMatchesHost runs each optimizer, with and without gradient
// clipping, on the same parameters and gradients held on the host and on
// an emulated device, over two ranks: the parameters and norms must agree
// bit for bit after every step (the device runs the same CPU kernels, so
// any difference means the device path skipped or reordered work). The
// state must live on the device (the allocator grows by it at the first
// step), the allocator must make no driver allocation after the first
// step, and Close must give everything back.
func TestDeviceMatchesHost(t *testing.T) {
	const steps = 4
	cases := []struct {
		name     string
		dt       comm.DType
		normType float64 // 0: no clipping
		make     func(ps []*autograd.Value) (stepper, error)
	}{
		{"AdamW/f32/clip2", comm.Float32, 2, func(ps []*autograd.Value) (stepper, error) {
			return optim.NewAdamW(ps, optim.WithLR(0.01), optim.WithWeightDecay(0.1))
		}},
		{"AdamW/f64/clipInf", comm.Float64, math.Inf(1), func(ps []*autograd.Value) (stepper, error) {
			return optim.NewAdamW(ps, optim.WithLR(0.01))
		}},
		{"SGD/f32/nesterov/clip2", comm.Float32, 2, func(ps []*autograd.Value) (stepper, error) {
			return optim.NewSGD(ps, 0.05, optim.WithMomentum(0.9), optim.WithNesterov(), optim.WithWeightDecay(0.01))
		}},
		{"SGD/f32/dampening/maximize", comm.Float32, 0, func(ps []*autograd.Value) (stepper, error) {
			return optim.NewSGD(ps, 0.05, optim.WithMomentum(0.8), optim.WithDampening(0.3), optim.WithMaximize())
		}},
		{"SGD/f64/plain/clip1", comm.Float64, 1, func(ps []*autograd.Value) (stepper, error) {
			return optim.NewSGD(ps, 0.1, optim.WithWeightDecay(0.02))
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{2}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				return runOnBoth(ctx, m, c.dt, c.normType, steps, c.make)
			})
		})
	}
}

// runOnBoth is one rank of TestDeviceMatchesHost.
func runOnBoth(ctx context.Context, m *mesh.Mesh, dt comm.DType, normType float64, steps int, mk func([]*autograd.Value) (stepper, error)) error {
	d, err := emu.New(m.Rank())
	if err != nil {
		return err
	}
	defer d.Close()
	r := rand.New(rand.NewPCG(27, 7)) // the same draws on every rank
	hostTape, devTape := autograd.NewTape(), autograd.NewTape(autograd.WithDevice(d))
	var (
		specs            []*placement.Spec
		hostPs, devPs    []*autograd.Value
		devParamBuffers  []device.Buffer
		devGradBuffers   []device.Buffer
		freeDeviceGrads  = func() error { return nil }
		driverAfterFirst int64
	)
	for _, p := range deviceParams {
		spec, err := placement.NewSpec(m, p.shape, dt, []placement.Placement{p.place})
		if err != nil {
			return err
		}
		full, err := placement.FromFull(spec, randomFull(r, dt, prodInts(p.shape)))
		if err != nil {
			return err
		}
		on, err := full.To(d)
		if err != nil {
			return err
		}
		hp, err := hostTape.Param(p.name, full)
		if err != nil {
			return err
		}
		dp, err := devTape.Param(p.name, on)
		if err != nil {
			return err
		}
		specs, hostPs, devPs = append(specs, spec), append(hostPs, hp), append(devPs, dp)
		devParamBuffers = append(devParamBuffers, on.LocalData().(device.Buffer))
	}
	hostOpt, err := mk(hostPs)
	if err != nil {
		return err
	}
	devOpt, err := mk(devPs)
	if err != nil {
		return err
	}
	for step := 1; step <= steps; step++ {
		devGradBuffers = devGradBuffers[:0]
		for i, spec := range specs {
			g, err := placement.FromFull(spec, randomFull(r, dt, prodInts(spec.Shape())))
			if err != nil {
				return err
			}
			on, err := g.To(d)
			if err != nil {
				return err
			}
			if err := hostPs[i].SetGrad(g); err != nil {
				return err
			}
			if err := devPs[i].SetGrad(on); err != nil {
				return err
			}
			devGradBuffers = append(devGradBuffers, on.LocalData().(device.Buffer))
		}
		freeDeviceGrads = func() error {
			var errs []error
			for i, b := range devGradBuffers {
				errs = append(errs, devPs[i].SetGrad(nil), b.Free())
			}
			return errors.Join(errs...)
		}
		before := d.Memory().Stats()
		if normType != 0 {
			hn, err := optim.ClipGradNorm(ctx, hostPs, 0.5, optim.WithNormType(normType))
			if err != nil {
				return fmt.Errorf("host clip: %w", err)
			}
			dn, err := optim.ClipGradNorm(ctx, devPs, 0.5, optim.WithNormType(normType))
			if err != nil {
				return fmt.Errorf("device clip: %w", err)
			}
			if math.Float64bits(hn) != math.Float64bits(dn) {
				return fmt.Errorf("step %d: norm %v on the host, %v on the device", step, hn, dn)
			}
		}
		if err := hostOpt.Step(); err != nil {
			return fmt.Errorf("host step %d: %w", step, err)
		}
		if err := devOpt.Step(); err != nil {
			return fmt.Errorf("device step %d: %w", step, err)
		}
		if err := d.Synchronize(); err != nil {
			return err
		}
		after := d.Memory().Stats()
		if hb, db := hostOpt.StateBytes(), devOpt.StateBytes(); hb != db {
			return fmt.Errorf("step %d: state of %d bytes on the host, %d on the device", step, hb, db)
		}
		grew := after.Allocated - before.Allocated
		switch {
		case step == 1 && grew < devOpt.StateBytes():
			return fmt.Errorf("step 1: the device allocator grew by %d bytes for %d bytes of optimizer state: the state is not on the device", grew, devOpt.StateBytes())
		case step > 1 && grew != 0:
			return fmt.Errorf("step %d: the device allocator grew by %d bytes", step, grew)
		case step == 1:
			driverAfterFirst = after.DriverAllocs
		case after.DriverAllocs != driverAfterFirst:
			return fmt.Errorf("step %d: %d driver allocations, %d after the first step", step, after.DriverAllocs, driverAfterFirst)
		}
		for i := range hostPs {
			for _, pair := range [][2]*placement.DTensor{{hostPs[i].Data(), devPs[i].Data()}, {hostPs[i].Grad(), devPs[i].Grad()}} {
				hb, err := blockBytes(pair[0])
				if err != nil {
					return err
				}
				db, err := blockBytes(pair[1])
				if err != nil {
					return err
				}
				if !bytes.Equal(hb, db) {
					return fmt.Errorf("step %d: %q differs between the host and the device (data or gradient)", step, hostPs[i].Name())
				}
			}
		}
		if err := freeDeviceGrads(); err != nil {
			return err
		}
	}
	if err := devOpt.Close(); err != nil {
		return err
	}
	if err := devOpt.Close(); err != nil {
		return fmt.Errorf("second Close: %w", err)
	}
	if n := devOpt.StateBytes(); n != 0 {
		return fmt.Errorf("StateBytes after Close = %d", n)
	}
	if err := devOpt.Step(); !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), "closed") {
		return fmt.Errorf("Step after Close: %v", err)
	}
	for _, b := range devParamBuffers {
		if err := b.Free(); err != nil {
			return err
		}
	}
	if err := d.Synchronize(); err != nil {
		return err
	}
	if s := d.Memory().Stats(); s.Allocated != 0 {
		return fmt.Errorf("%d bytes still allocated after Close and freeing the parameters: the optimizer leaked device memory", s.Allocated)
	}
	return nil
}

// TestDeviceRejects: gradients on two devices given to ClipGradNorm are
// an error matching device.ErrMixed and optim.ErrInvalid that changes
// nothing (a gradient on another device than its parameter is refused
// earlier, by SetGrad).
func TestDeviceRejects(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		spec, err := placement.NewSpec(m, []int{3}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		hostT, err := placement.FromFull(spec, []float32{1, 2, 3})
		if err != nil {
			return err
		}
		devT, err := hostT.To(d)
		if err != nil {
			return err
		}
		tape := autograd.NewTape()
		onDev, err := tape.Param("onDev", devT)
		if err != nil {
			return err
		}
		onHost, err := tape.Param("onHost", hostT)
		if err != nil {
			return err
		}
		hostGrad, err := placement.FromFull(spec, []float32{1, 1, 1})
		if err != nil {
			return err
		}
		devGrad, err := hostGrad.To(d)
		if err != nil {
			return err
		}
		// A gradient on another device than its parameter cannot be
		// installed (autograd's SetGrad refuses it), so an optimizer
		// never meets one; gradients on two devices reach ClipGradNorm.
		if err := onDev.SetGrad(hostGrad); !errors.Is(err, device.ErrMixed) {
			return fmt.Errorf("SetGrad(host gradient) for a parameter on emu:0 = %v, want device.ErrMixed", err)
		}
		mixed := func(what string, err error) error {
			if !errors.Is(err, device.ErrMixed) || !errors.Is(err, optim.ErrInvalid) || !strings.Contains(err.Error(), "emu:0") || !strings.Contains(err.Error(), "host") {
				return fmt.Errorf("%s: %v; want device.ErrMixed and optim.ErrInvalid naming both devices", what, err)
			}
			return nil
		}
		if err := onHost.SetGrad(hostGrad); err != nil {
			return err
		}
		if err := onDev.SetGrad(devGrad); err != nil {
			return err
		}
		_, err = optim.ClipGradNorm(ctx, []*autograd.Value{onHost, onDev}, 1e-3)
		if err := mixed("ClipGradNorm", err); err != nil {
			return err
		}
		for _, v := range []*autograd.Value{onHost, onDev} {
			got, err := blockBytes(v.Grad())
			if err != nil {
				return err
			}
			if want := comm.Host([]float32{1, 1, 1}).Bytes(); !bytes.Equal(got, want) {
				return fmt.Errorf("a rejected ClipGradNorm changed the gradient of %q", v.Name())
			}
		}
		return nil
	})
}

// TestDeviceStateOutOfMemory: when a device cannot hold the optimizer
// state, Step fails with the allocator's *device.OOMError, frees the
// state it made for earlier parameters, and changes no parameter.
func TestDeviceStateOutOfMemory(t *testing.T) {
	// Blocks of 0.75 MiB: a parameter and its gradient fill one 2 MiB
	// segment each; the first parameters' state fits the cap, the last
	// one's needs a segment past it.
	const n = 3 << 16 // float32s: 0.75 MiB
	cases := []struct {
		name   string
		params int
		memory int64
		make   func(ps []*autograd.Value) (stepper, error)
	}{
		{"AdamW", 2, 6 << 20, func(ps []*autograd.Value) (stepper, error) { return optim.NewAdamW(ps) }},
		{"SGD", 3, 8 << 20, func(ps []*autograd.Value) (stepper, error) { return optim.NewSGD(ps, 0.1, optim.WithMomentum(0.9)) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
				d, err := emu.New(0, emu.WithMemory(c.memory))
				if err != nil {
					return err
				}
				defer d.Close()
				spec, err := placement.NewSpec(m, []int{n}, comm.Float32, []placement.Placement{placement.Replicate()})
				if err != nil {
					return err
				}
				init := make([]float32, n)
				for i := range init {
					init[i] = float32(i%7) - 3
				}
				tape := autograd.NewTape(autograd.WithDevice(d))
				var ps []*autograd.Value
				for i := range c.params {
					host, err := placement.FromFull(spec, init)
					if err != nil {
						return err
					}
					p, err := host.To(d)
					if err != nil {
						return err
					}
					g, err := host.To(d)
					if err != nil {
						return err
					}
					v, err := tape.Param(fmt.Sprintf("p%d", i), p)
					if err != nil {
						return err
					}
					if err := v.SetGrad(g); err != nil {
						return err
					}
					ps = append(ps, v)
				}
				before := d.Memory().Stats().Allocated
				o, err := c.make(ps)
				if err != nil {
					return err
				}
				err = o.Step()
				var oom *device.OOMError
				if !errors.As(err, &oom) || !errors.Is(err, device.ErrOutOfMemory) {
					return fmt.Errorf("Step = %v, want a *device.OOMError", err)
				}
				if got := d.Memory().Stats().Allocated; got != before {
					return fmt.Errorf("after the failed Step %d bytes are allocated, %d before: the state made for earlier parameters was not freed", got, before)
				}
				want := comm.Host(init).Bytes()
				for _, v := range ps {
					got, err := blockBytes(v.Data())
					if err != nil {
						return err
					}
					if !bytes.Equal(got, want) {
						return fmt.Errorf("the failed Step changed %q", v.Name())
					}
				}
				return o.Close()
			})
		})
	}
}
