package gpt_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/models/gpt"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestNewOnDevice: New on a tape whose device is emulated places every
// parameter's block there, holding the values the host build holds, bit
// for bit.
func TestNewOnDevice(t *testing.T) {
	cfg := gpt.FromReference(small())
	placementtest.Run(t, []int{1}, []string{"dp"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(0)
		if err != nil {
			return err
		}
		defer d.Close()
		host, err := gpt.New(autograd.NewTape(), m, cfg, gpt.WithSeed(3))
		if err != nil {
			return err
		}
		on, err := gpt.New(autograd.NewTape(autograd.WithDevice(d)), m, cfg, gpt.WithSeed(3))
		if err != nil {
			return err
		}
		hp, dp := host.Params(), on.Params()
		if len(hp) != len(dp) || len(dp) == 0 {
			return fmt.Errorf("%d parameters on the device, %d on the host", len(dp), len(hp))
		}
		for i, p := range dp {
			if p.Data().Device() != d {
				return fmt.Errorf("%s is on %s, want %s", p.Name(), p.Data().Device().Name(), d.Name())
			}
			back, err := p.Data().To(device.Host())
			if err != nil {
				return err
			}
			got, want := back.LocalData().([]float32), hp[i].Data().LocalData().([]float32)
			for j := range want {
				if math.Float32bits(got[j]) != math.Float32bits(want[j]) {
					return fmt.Errorf("%s[%d] = %v on the device, %v on the host", p.Name(), j, got[j], want[j])
				}
			}
		}
		return nil
	})
}
