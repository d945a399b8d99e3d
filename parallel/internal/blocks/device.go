package blocks

import (
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

// Orders returns the placement.WithOrder options that keep the order of
// every dim of s sharded over several mesh axes, with axes appended to
// dim's order (innermost: FSDP's shard axes inside a tensor-parallel
// one); dim < 0 appends nothing. A layout change made with them (Spec.With)
// keeps the shards' nesting.
func Orders(s *placement.Spec, dim int, axes ...string) []placement.SpecOption {
	var opts []placement.SpecOption
	for d := range s.Shape() {
		o := s.Order(d)
		if d == dim {
			o = append(o, axes...)
		}
		if len(o) > 1 {
			opts = append(opts, placement.WithOrder(d, o...))
		}
	}
	return opts
}
