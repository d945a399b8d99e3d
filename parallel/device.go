package parallel

import (
	"fmt"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Parameters on devices. A module's parameters live on its tape's device
// (autograd.WithDevice; the host by default): the constructors compute the
// initial value on the host and copy it there once, and the parallel
// styles, DDP and FSDP keep every block they make (shards, buckets,
// gathered copies) on the parameters' device, freeing what they replace.

// freeLocal frees dt's local block when it is a device buffer (the host's
// slices are the garbage collector's); nil does nothing.
func freeLocal(dt *placement.DTensor) error {
	if dt == nil {
		return nil
	}
	if b, ok := dt.LocalData().(device.Buffer); ok {
		return b.Free()
	}
	return nil
}

// paramsDevice returns the device that holds every parameter's block, or
// an error wrapping ErrInvalid and device.ErrMixed that names op, two of
// the devices and the parameter on the second.
func paramsDevice(op string, params []*autograd.Value) (device.Device, error) {
	var d device.Device
	for _, p := range params {
		pd := p.Data().Device()
		if d == nil {
			d = pd
			continue
		}
		if err := device.Same(op, d, pd); err != nil {
			return nil, fmt.Errorf("%w: %w (parameter %q)", ErrInvalid, err, p.Name())
		}
	}
	if d == nil {
		d = device.Host()
	}
	return d, nil
}

// onHost reports whether d is the host (nil counts as the host).
func onHost(d device.Device) bool { return d == nil || d.Kind() == device.KindHost }
