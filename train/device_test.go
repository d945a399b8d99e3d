package train

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/b7ea7098/loom"
	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/launch"
)

// deviceStepper allocates on its rank's device every step and checks that
// the rank's tape computes there.
type deviceStepper struct{ r Rank }

func (s deviceStepper) Step(context.Context) (string, error) {
	if got := autograd.NewTape(s.r.Tape...).Device(); got != s.r.Device {
		return "", fmt.Errorf("the tape's device is %s, the rank's %s", got.Name(), s.r.Device.Name())
	}
	b, err := s.r.Device.Alloc(comm.Float32, 8)
	if err != nil {
		return "", err
	}
	if err := b.Free(); err != nil {
		return "", err
	}
	return s.r.Device.Name(), nil
}

// TestRunDevice: -device gives every rank its device (the host, or
// emu:<rank>), the tape's options compute there, and Run closes an
// emulated device after the rank; unknown names fail before any rank
// starts, emu on a backend whose collectives refuse its buffers is
// refused, and so is cuda off NCCL (TestNCCLDeviceFake in package launch
// runs it on NCCL).
func TestRunDevice(t *testing.T) {
	for _, c := range []struct {
		device string
		rank0  string // rank 0's device
		devs   int    // distinct devices
	}{
		{"cpu", "host", 1},
		{"", "host", 1},
		{"emu", "emu:0", 2},
	} {
		job, err := launch.InProcess(2)
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		devs := map[string]device.Device{}
		setup := func(_ context.Context, r Rank) (Stepper[string], error) {
			mu.Lock()
			defer mu.Unlock()
			devs[r.Device.Name()] = r.Device
			return deviceStepper{r}, nil
		}
		var names []string
		progress := func(_ int, name string, _ float64) { names = append(names, name) }
		loop := Loop{Ranks: 2, Steps: 2, Every: 1, Flags: Flags{TraceSteps: 1, Device: c.device}}
		if _, err := Run(context.Background(), nil, job, loop, setup, progress); err != nil {
			t.Fatalf("-device %q: %v", c.device, err)
		}
		if len(names) != 2 || names[0] != c.rank0 || len(devs) != c.devs {
			t.Errorf("-device %q: rank 0 on %v, devices %v; want rank 0 on %s, %d devices", c.device, names, devs, c.rank0, c.devs)
		}
		for _, d := range devs {
			if d.Kind() == device.KindHost {
				continue
			}
			if _, err := d.Alloc(comm.Float32, 1); !errors.Is(err, device.ErrInvalid) {
				t.Errorf("-device %q: %s after the run: Alloc gave %v, want a closed device's ErrInvalid", c.device, d.Name(), err)
			}
		}
	}
	for _, c := range []struct {
		device string
		want   error
		msg    string
	}{
		{"gpu", loom.ErrInvalid, `-device "gpu"`},
	} {
		loop := Loop{Ranks: 1, Steps: 1, Every: 1, Flags: Flags{TraceSteps: 1, Device: c.device}}
		err := loop.Validate()
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("-device %s: %v, want %v naming %q", c.device, err, c.want, c.msg)
		}
	}
	f := Flags{Device: DeviceEmu}
	if err := f.checkJob(&launch.Job{Backend: launch.TCP}); !errors.Is(err, ErrUnsupported) {
		t.Errorf("-device emu on tcp: %v, want ErrUnsupported", err)
	}
	for _, b := range []string{launch.Local, launch.MPI} {
		if err := f.checkJob(&launch.Job{Backend: b}); err != nil {
			t.Errorf("-device emu on %s: %v", b, err)
		}
	}
	cu := Flags{Device: DeviceCUDA}
	for _, b := range []string{launch.Local, launch.MPI, launch.TCP} {
		err := cu.checkJob(&launch.Job{Backend: b})
		if !errors.Is(err, loom.ErrUnsupported) || !strings.Contains(err.Error(), "runs on the nccl backend") || !strings.Contains(err.Error(), "this is a "+b+" job") {
			t.Errorf("-device cuda on %s: %v, want ErrUnsupported naming nccl and %s", b, err, b)
		}
	}
	if err := cu.checkJob(&launch.Job{Backend: launch.NCCL}); err != nil {
		t.Errorf("-device cuda on nccl: %v", err)
	}
	job, err := launch.InProcess(1)
	if err != nil {
		t.Fatal(err)
	}
	started := false
	setup := func(context.Context, Rank) (Stepper[string], error) {
		started = true
		return nil, errors.New("unreachable")
	}
	loop := Loop{Ranks: 1, Steps: 1, Every: 1, Flags: Flags{TraceSteps: 1, Device: DeviceCUDA}}
	if _, err := Run(context.Background(), nil, job, loop, setup, nil); !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "this is a local job") || started {
		t.Errorf("-device cuda on a local job: %v (setup called: %v), want ErrUnsupported naming the local backend before any rank starts", err, started)
	}
	if _, err := cu.OpenDevice(context.Background(), 0, nil); !errors.Is(err, ErrUnsupported) {
		t.Errorf("-device cuda without launch's device: %v, want ErrUnsupported", err)
	}
	if got := f.DeviceLine(4); !strings.Contains(got, "emu:0 … emu:3") {
		t.Errorf("DeviceLine(4) = %q", got)
	}
}
