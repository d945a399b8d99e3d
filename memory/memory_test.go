package memory_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/comm/local"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
	"github.com/b7ea7098/loom/memory"
	"github.com/b7ea7098/loom/mesh"
	"github.com/b7ea7098/loom/placement"
	"github.com/b7ea7098/loom/placement/placementtest"
)

// TestMeterPeaks: each kind keeps its own largest value, and the peak is
// the largest total of one sample, which is less than the sum of the
// kinds' maxima when they peak at different samples.
func TestMeterPeaks(t *testing.T) {
	samples := []memory.Use{
		{Params: 100, Grads: 0, Activations: 50},
		{Params: 100, Grads: 40, Activations: 10, Comm: 5},
		{Params: 100, Grads: 80, Optim: 30},
	}
	var m memory.Meter
	i := 0
	m.Add(func() memory.Use { return samples[i] })
	m.Add(func() memory.Use { return memory.Use{Optim: 1} })
	m.Add(nil) // ignored
	for i = range samples {
		if got, want := m.Sample().Total(), samples[i].Total()+1; got != want {
			t.Errorf("sample %d: total %d, want %d", i, got, want)
		}
	}
	want := memory.Report{Use: memory.Use{Params: 100, Grads: 80, Optim: 31, Activations: 50, Comm: 5}, Peak: 211}
	if got := m.Report(); got != want {
		t.Errorf("Report = %+v, want %+v", got, want)
	}
	m.Reset()
	if got := m.Report(); got != (memory.Report{}) {
		t.Errorf("after Reset: %+v", got)
	}
}

// TestMaxOverRanks: every rank gets the element-wise maximum, on 1 and 3
// ranks.
func TestMaxOverRanks(t *testing.T) {
	for _, p := range []int{1, 3} {
		t.Run(fmt.Sprint(p), func(t *testing.T) {
			err := local.Run(context.Background(), p, func(ctx context.Context, c comm.Communicator) error {
				r := int64(c.Rank())
				in := memory.Report{Use: memory.Use{Params: 10 - r, Grads: r, Optim: 7, Activations: 3 * r, Comm: 0}, Peak: 100 + r}
				got, err := memory.MaxOverRanks(ctx, c, in)
				if err != nil {
					return err
				}
				last := int64(p - 1)
				want := memory.Report{Use: memory.Use{Params: 10, Grads: last, Optim: 7, Activations: 3 * last}, Peak: 100 + last}
				if got != want {
					return fmt.Errorf("rank %d: %+v, want %+v", c.Rank(), got, want)
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestTensor counts the local block: a [5, 3] float64 tensor sharded over
// 2 ranks holds 3 and 2 rows.
func TestTensor(t *testing.T) {
	if memory.Tensor(nil) != 0 {
		t.Error("Tensor(nil) != 0")
	}
	placementtest.Run(t, []int{2}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		spec, err := placement.NewSpec(m, []int{5, 3}, comm.Float64, []placement.Placement{placement.Shard(0)})
		if err != nil {
			return err
		}
		dt, err := placement.FromFull(spec, make([]float64, 15))
		if err != nil {
			return err
		}
		if got, want := memory.Tensor(dt), int64([]int{3, 2}[m.Rank()]*3*8); got != want {
			return fmt.Errorf("rank %d: %d bytes, want %d", m.Rank(), got, want)
		}
		return nil
	})
}

// TestTensorOnDevice counts a device block as its buffer's bytes, for
// both element types and an empty shard.
func TestTensorOnDevice(t *testing.T) {
	placementtest.Run(t, []int{4}, []string{"fsdp"}, func(ctx context.Context, m *mesh.Mesh) error {
		d, err := emu.New(m.Rank())
		if err != nil {
			return err
		}
		defer d.Close()
		for _, dt := range []comm.DType{comm.Float32, comm.Float64} {
			// 3 rows of 2 over 4 ranks: rank 3's shard is empty.
			spec, err := placement.NewSpec(m, []int{3, 2}, dt, []placement.Placement{placement.Shard(0)})
			if err != nil {
				return err
			}
			full := any(make([]float32, 6))
			if dt == comm.Float64 {
				full = make([]float64, 6)
			}
			host, err := placement.FromFull(spec, full)
			if err != nil {
				return err
			}
			on, err := host.To(d)
			if err != nil {
				return err
			}
			want := int64([]int{1, 1, 1, 0}[m.Rank()] * 2 * dt.Size())
			if got := memory.Tensor(on); got != want || memory.Tensor(host) != want {
				return fmt.Errorf("rank %d, %v: device %d bytes, host %d, want %d", m.Rank(), dt, got, memory.Tensor(host), want)
			}
		}
		return nil
	})
}

// TestMeterDevice: a Meter given a device reports its allocator's
// statistics, and Reset resets the allocator's peaks; without a device,
// or with the host, it reports none.
func TestMeterDevice(t *testing.T) {
	d, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var m memory.Meter
	if m.Report().Device != nil {
		t.Fatal("a Meter without a device reported device statistics")
	}
	m.SetDevice(device.Host())
	if m.Report().Device != nil {
		t.Fatal("the host reported device statistics")
	}
	m.SetDevice(d)
	big, err := d.Alloc(comm.Float32, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	small, err := d.Alloc(comm.Float32, 100)
	if err != nil {
		t.Fatal(err)
	}
	rep := m.Report()
	if rep.Device == nil || *rep.Device != d.Memory().Stats() || rep.Device.Allocated < 4<<20 || rep.Device.DriverAllocs == 0 {
		t.Fatalf("Report().Device = %+v, want the allocator's %+v", rep.Device, d.Memory().Stats())
	}
	if err := big.Free(); err != nil {
		t.Fatal(err)
	}
	m.Reset()
	rep = m.Report()
	if rep.Device == nil || rep.Device.PeakAllocated != rep.Device.Allocated || rep.Device.PeakAllocated >= 4<<20 {
		t.Fatalf("after Reset: %+v, want the peak reset to what is allocated (%d)", rep.Device, d.Memory().Stats().Allocated)
	}
	if err := small.Free(); err != nil {
		t.Fatal(err)
	}
}

// TestMaxOverRanksDevice: device statistics are maximised field by field
// (fragmentation included), present when any rank has them, and written
// as "device" in JSON; without them there is no "device" key.
func TestMaxOverRanksDevice(t *testing.T) {
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Communicator) error {
		r := int64(c.Rank())
		in := memory.Report{Peak: 5}
		if r > 0 { // rank 0 has no device: the others' statistics still come back
			in.Device = &device.Stats{Allocated: 100 * r, Reserved: 1000 - r, PeakAllocated: 7, DriverAllocs: r, OOMs: 2 - r,
				Fragmentation: []float64{0, 0.25, 0.125}[r]}
		}
		got, err := memory.MaxOverRanks(ctx, c, in)
		if err != nil {
			return err
		}
		want := device.Stats{Allocated: 200, Reserved: 999, PeakAllocated: 7, DriverAllocs: 2, OOMs: 1, Fragmentation: 0.25}
		if got.Device == nil || *got.Device != want || got.Peak != 5 {
			return fmt.Errorf("rank %d: %+v (device %+v), want device %+v", r, got, got.Device, want)
		}
		js, err := json.Marshal(got)
		if err != nil {
			return err
		}
		if !strings.Contains(string(js), `"device":{"allocated":200,`) || !strings.Contains(string(js), `"fragmentation":0.25`) {
			return fmt.Errorf("JSON %s: want the device statistics under \"device\"", js)
		}
		none, err := memory.MaxOverRanks(ctx, c, memory.Report{Peak: r})
		if err != nil {
			return err
		}
		if js, _ := json.Marshal(none); none.Device != nil || strings.Contains(string(js), "device") {
			return fmt.Errorf("no rank with a device: %s", js)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
