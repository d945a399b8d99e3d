package blocks

import (
	"fmt"
	"slices"

	"github.com/b7ea7098/loom/autograd"
	"github.com/b7ea7098/loom/device"
	"github.com/b7ea7098/loom/placement"
)

// Parameters on devices. A module's parameters live on its tape's device
// (autograd.WithDevice; the host by default): the constructors compute the
// initial value on the host and copy it there once, and the parallel
// styles, DDP and FSDP keep every block they make (shards, buckets,
// gathered copies) on the parameters' device, freeing what they replace.

// FreeLocal frees dt's local block when it is a device buffer (the host's
// slices are the garbage collector's); nil does nothing.
func FreeLocal(dt *placement.DTensor) error {
	if dt == nil {
		return nil
	}
	if b, ok := dt.LocalData().(device.Buffer); ok {
		return b.Free()
	}
	return nil
}

// ParamsDevice returns the device that holds every parameter's block (the
// host for an empty list), or an error wrapping device.ErrMixed that names
// op, two of the devices and the parameter on the second; callers wrap it
// in their package's ErrInvalid.
func ParamsDevice(op string, params []*autograd.Value) (device.Device, error) {
	var d device.Device
	for _, p := range params {
		pd := p.Data().Device()
		if d == nil {
			d = pd
			continue
		}
		if err := device.Same(op, d, pd); err != nil {
			return nil, fmt.Errorf("%w (parameter %q)", err, p.Name())
		}
	}
	if d == nil {
		d = device.Host()
	}
	return d, nil
}

// OnHost reports whether d is the host (nil counts as the host).
func OnHost(d device.Device) bool { return d == nil || d.Kind() == device.KindHost }

// Prod returns the number of elements of shape s (1 for a scalar).
func Prod(s []int) int {
	n := 1
	for _, v := range s {
		n *= v
	}
	return n
}

// Describe describes each parameter as the ranks of a data-parallel group
// must agree on it: "w [2 3] float64", its name, global shape and dtype,
// with its local shape appended when another mesh axis shards it.
func Describe(params []*autograd.Value) []string {
	out := make([]string, len(params))
	for i, p := range params {
		s := p.Spec()
		out[i] = fmt.Sprintf("%s %v %v", p.Name(), s.Shape(), s.DType())
		if local := s.LocalShape(); !slices.Equal(local, s.Shape()) {
			out[i] += fmt.Sprintf(" local %v", local)
		}
	}
	return out
}
