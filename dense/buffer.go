package dense

import (
	"github.com/b7ea7098/loom/comm"
	"gorgonia.org/tensor"
)

// ToBuffer wraps the backing array of a gorgonia tensor as a comm buffer
// without copying, so that a collective reads and writes the tensor in
// place. float32, float64, int32, int64 and uint8 tensors are supported.
// A strided view, a lazily transposed or masked tensor (whose backing
// array is not its elements in order), a scalar and an empty tensor are
// errors wrapping ErrInvalid.
func ToBuffer(d *tensor.Dense) (*comm.HostBuffer, error) {
	const op = "ToBuffer"
	if _, err := check(op, d, "the tensor"); err != nil {
		return nil, err
	}
	if d.RequiresIterator() {
		return nil, invalidf(op, "the tensor is a non-contiguous view or transposed; copy it into a contiguous tensor first")
	}
	switch data := d.Data().(type) {
	case []float32:
		return comm.Host(data), nil
	case []float64:
		return comm.Host(data), nil
	case []int32:
		return comm.Host(data), nil
	case []int64:
		return comm.Host(data), nil
	case []uint8:
		return comm.Host(data), nil
	case float32, float64, int32, int64, uint8:
		return nil, invalidf(op, "the tensor is a scalar; reshape it to a vector")
	}
	return nil, invalidf(op, "tensor dtype %v has no comm dtype", d.Dtype())
}
