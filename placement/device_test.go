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
