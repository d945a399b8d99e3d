package device_test

import (
	"errors"
	"fmt"

	"github.com/b7ea7098/loom/device"
)

// hostRaw stands in for a driver: 64 MiB of made-up addresses.
type hostRaw struct{ used, next int64 }

func (r *hostRaw) Malloc(n int64) (uintptr, error) {
	if r.used+n > 64<<20 {
		return 0, fmt.Errorf("hostRaw: %w", device.ErrOutOfMemory)
	}
	r.used += n
	r.next += n
	return uintptr(1<<32 + r.next - n), nil
}

func (r *hostRaw) Free(uintptr) error           { return nil }
func (r *hostRaw) MemInfo() (free, total int64) { return 64<<20 - r.used, 64 << 20 }

// stream is a stream whose work is always done.
type stream struct{}

func (*stream) Owner() device.Device         { return nil }
func (*stream) WaitEvent(device.Event) error { return nil }
func (*stream) Synchronize() error           { return nil }
func (*stream) Query() (bool, error)         { return true, nil }

func ExampleAllocator() {
	a, err := device.NewAllocator("emu:0", &hostRaw{}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	compute := &stream{}
	for step := 1; step <= 3; step++ {
		act, _ := a.Alloc(3<<20, compute) // an activation, 3 MiB
		tmp, _ := a.Alloc(100<<10, compute)
		_ = a.Free(tmp)
		_ = a.Free(act)
		st := a.Stats()
		fmt.Printf("step %d: %d driver allocations, %d MiB reserved\n", step, st.DriverAllocs, st.Reserved>>20)
	}
	_, err = a.Alloc(100<<20, compute)
	fmt.Println(errors.Is(err, device.ErrOutOfMemory))
	if _, err := a.Alloc(40<<20, compute); err == nil {
		fmt.Println("40 MiB: ok")
	}
	// Output:
	// step 1: 2 driver allocations, 22 MiB reserved
	// step 2: 2 driver allocations, 22 MiB reserved
	// step 3: 2 driver allocations, 22 MiB reserved
	// true
	// 40 MiB: ok
}
