package cp

import (
	"errors"
	"strings"
	"testing"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/device/emu"
)

// plainKernels hides every optional op set of a device's kernels.
type plainKernels struct{ device.Kernels }

// plainDevice is a device whose kernels lack BlockAttentionKernels (as a
// device without the kernels would).
type plainDevice struct{ device.Device }

func (d plainDevice) Kernels() device.Kernels { return plainKernels{d.Device.Kernels()} }

// TestDeviceWithoutBlockAttention: a device whose kernels lack block
// attention is refused with ErrUnsupported naming the device and the ops.
func TestDeviceWithoutBlockAttention(t *testing.T) {
	d, err := emu.New(0)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := newDevOps(d, nil, comm.Float32); err != nil {
		t.Fatalf("emu: %v", err)
	}
	_, err = newDevOps(plainDevice{d}, nil, comm.Float32)
	if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), d.Name()) || !strings.Contains(err.Error(), "BlockAttentionBackward") {
		t.Fatalf("device without block attention: %v, want ErrUnsupported naming %s and the ops", err, d.Name())
	}
}
