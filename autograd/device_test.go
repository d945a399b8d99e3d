package autograd_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestMixedDevices: an op given inputs on two devices fails before it
// computes, with an error that names the op and both devices and matches
// autograd.ErrInvalid, device.ErrMixed and loom.ErrInvalid.
func TestMixedDevices(t *testing.T) {
	placementtest.Run(t, []int{1}, []string{"x"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		spec, err := placement.NewSpec(m, []int{2, 3}, comm.Float32, []placement.Placement{placement.Replicate()})
		if err != nil {
			return err
		}
		host, err := placement.FromFull(spec, make([]float32, 6))
		if err != nil {
			return err
		}
		on, err := host.To(d)
		if err != nil {
			return err
		}
		tape := autograd.NewTape(autograd.WithDevice(d))
		if tape.Device() != device.Device(d) || autograd.NewTape().Device().Kind() != device.KindHost {
			t.Errorf("tape devices %s, %s", tape.Device().Name(), autograd.NewTape().Device().Name())
		}
		a, err := tape.Param("a", host)
		if err != nil {
			return err
		}
		b, err := tape.Param("b", on)
		if err != nil {
			return err
		}
		_, err = autograd.Add(a, b)
		for _, want := range []error{autograd.ErrInvalid, device.ErrMixed, loom.ErrInvalid} {
			if !errors.Is(err, want) {
				t.Errorf("Add(host, emu) = %v, want it to match %v", err, want)
			}
		}
		if err == nil || !strings.Contains(err.Error(), "Add") || !strings.Contains(err.Error(), "emu:0") || !strings.Contains(err.Error(), "host") {
			t.Errorf("Add(host, emu) = %v: want the op and both devices named", err)
		}
		return nil
	})
}
