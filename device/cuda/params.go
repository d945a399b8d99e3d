package cuda

import (
	"fmt"
	"math"
	"unsafe"
)

// DevicePtr is a device address (CUdeviceptr).
type DevicePtr uint64

// Buffer is a device allocation: its address and size in bytes. The zero
// Buffer is the null pointer, which kernels with optional arguments take
// for "absent".
type Buffer struct {
	// Ptr is the device address (0 for the null pointer).
	Ptr DevicePtr
	// Bytes is the allocation's size in bytes.
	Bytes int
}

// Dim3 is a grid or block shape; zero components count as 1.
type Dim3 struct {
	// X, Y and Z are the extents (blocks or threads) in each dimension.
	X, Y, Z uint32
}

func (d Dim3) norm() Dim3 {
	return Dim3{max(d.X, 1), max(d.Y, 1), max(d.Z, 1)}
}

// maxKernelArgs bounds the arguments of one launch; CUDA allows 4 KiB (32
// KiB from Volta with CUDA 12.1) of parameters, far more than any kernel
// here takes.
const maxKernelArgs = 64

// kernelArgs is the kernelParams array of one cuLaunchKernel call: one
// 8-byte slot per argument value, and one pointer per argument to its slot.
// cuLaunchKernel reads each argument's size from the kernel's signature,
// so a 4-byte argument occupies the first 4 bytes of its slot.
type kernelArgs struct {
	vals []uint64
	ptrs []unsafe.Pointer
}

// packArgs converts launch arguments into slots. It accepts int32, uint32,
// int64, uint64, float32, float64, DevicePtr and Buffer (its Ptr), and
// returns an error naming the first argument of any other type.
func packArgs(args []any) (*kernelArgs, error) {
	if len(args) > maxKernelArgs {
		return nil, fmt.Errorf("%w: %d kernel arguments, at most %d", ErrInvalid, len(args), maxKernelArgs)
	}
	k := &kernelArgs{vals: make([]uint64, len(args)), ptrs: make([]unsafe.Pointer, len(args))}
	for i, a := range args {
		slot := unsafe.Pointer(&k.vals[i])
		k.ptrs[i] = slot
		switch v := a.(type) {
		case int32:
			*(*int32)(slot) = v
		case uint32:
			*(*uint32)(slot) = v
		case int64:
			*(*int64)(slot) = v
		case uint64:
			*(*uint64)(slot) = v
		case float32:
			*(*uint32)(slot) = math.Float32bits(v)
		case float64:
			*(*uint64)(slot) = math.Float64bits(v)
		case DevicePtr:
			*(*uint64)(slot) = uint64(v)
		case Buffer:
			*(*uint64)(slot) = uint64(v.Ptr)
		case int:
			return nil, fmt.Errorf("%w: kernel argument %d is an int (%d): pass int32 for a C int or int64 for a long long", ErrInvalid, i, v)
		default:
			return nil, fmt.Errorf("%w: kernel argument %d has unsupported type %T: want int32, uint32, int64, uint64, float32, float64, DevicePtr or Buffer", ErrInvalid, i, a)
		}
	}
	return k, nil
}
