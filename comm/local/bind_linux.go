package local

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// usableCPUs lists the CPUs the calling thread may run on, in order.
func usableCPUs() ([]int, error) {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return nil, fmt.Errorf("sched_getaffinity: %w", err)
	}
	n := set.Count()
	cpus := make([]int, 0, n)
	for c := 0; len(cpus) < n; c++ {
		if set.IsSet(c) {
			cpus = append(cpus, c)
		}
	}
	return cpus, nil
}

// bindThread locks the calling goroutine to its OS thread and restricts
// that thread to cpus. The returned func undoes both. If the old mask
// cannot be restored it leaves the goroutine locked, so that the thread
// ends with the goroutine instead of serving others with a narrowed mask.
func bindThread(cpus []int) (unbind func(), err error) {
	runtime.LockOSThread()
	var old, set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("sched_getaffinity: %w", err)
	}
	for _, c := range cpus {
		set.Set(c)
	}
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("sched_setaffinity %v: %w", cpus, err)
	}
	return func() {
		if unix.SchedSetaffinity(0, &old) == nil {
			runtime.UnlockOSThread()
		}
	}, nil
}
