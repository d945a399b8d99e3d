package optim

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/comm"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Parameters on devices. A parameter whose local block is a device.Buffer
// (placement.DTensor.Device is not the host) is updated by its device's
// Kernels, on the device's compute stream, from a gradient on the same
// device; its optimizer state is allocated there too, at its first
// update, and freed by the optimizer's Close. Host parameters keep their
// []float32/[]float64 code.

// deviceBlock returns t's local block when it lives on a device other
// than the host, and nil for a host block.
func deviceBlock(t *placement.DTensor) device.Buffer {
	b, _ := t.LocalData().(device.Buffer)
	return b
}

// checkBlock checks that a local block holds float32 or float64 elements,
// on the host or on a device with Kernels.
func checkBlock(data any) error {
	switch d := data.(type) {
	case []float32, []float64:
		return nil
	case device.Buffer:
		if dt := d.DType(); dt != comm.Float32 && dt != comm.Float64 {
			return fmt.Errorf("a %v block on %s; want float32 or float64", dt, d.Device())
		}
		if d.Owner() == nil || d.Owner().Kernels() == nil {
			return fmt.Errorf("a block on %s, a device without kernels", d.Device())
		}
		return nil
	}
	return fmt.Errorf("a block of %T; want float32 or float64", data)
}

// stateBytes is the size in bytes of a piece of optimizer state or a
// local block: a []float32, a []float64 or a device.Buffer (0 for nil).
func stateBytes(s any) int64 {
	switch d := s.(type) {
	case []float32:
		return 4 * int64(len(d))
	case []float64:
		return 8 * int64(len(d))
	case device.Buffer:
		return int64(d.Len()) * int64(d.DType().Size())
	}
	return 0
}

// stateDevice is the device that holds a piece of optimizer state: the
// host for a slice.
func stateDevice(s any) device.Device {
	if b, ok := s.(device.Buffer); ok {
		return b.Owner()
	}
	return device.Host()
}

// newState returns optimizer state shaped like the local block p: a
// zeroed slice for a host block, a buffer of p's device otherwise,
// zeroed when zero is set (SGD's momentum buffer is written whole by its
// first step, so it needs no fill).
func newState(p *placement.DTensor, zero bool) (any, error) {
	switch d := p.LocalData().(type) {
	case []float32:
		return make([]float32, len(d)), nil
	case []float64:
		return make([]float64, len(d)), nil
	}
	pb := deviceBlock(p)
	dev := pb.Owner()
	b, err := dev.Alloc(pb.DType(), pb.Len())
	if err != nil {
		return nil, err
	}
	if zero {
		if err := dev.Kernels().Fill(b, 0); err != nil {
			return nil, errors.Join(err, b.Free())
		}
	}
	return b, nil
}

// freeState gives a piece of optimizer state back to its device's
// allocator (host slices are the garbage collector's).
func freeState(s any) error {
	if b, ok := s.(device.Buffer); ok {
		return b.Free()
	}
	return nil
}

// errClosed is Step's error after Close.
func errClosed(op string) error {
	return fmt.Errorf("optim: %s: %w: the optimizer was closed", op, ErrInvalid)
}
