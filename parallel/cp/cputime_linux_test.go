package cp_test

import (
	"syscall"
	"time"
	"unsafe"
)

// clockThreadCPU is Linux's CLOCK_THREAD_CPUTIME_ID: the calling thread's
// CPU time, to the nanosecond (getrusage's counts whole scheduler ticks).
const clockThreadCPU = 3

// threadCPU returns the CPU time the calling OS thread has used, and
// whether it could be read. The caller locks its goroutine to the thread.
func threadCPU() (time.Duration, bool) {
	var ts syscall.Timespec
	if _, _, e := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPU, uintptr(unsafe.Pointer(&ts)), 0); e != 0 {
		return 0, false
	}
	return time.Duration(ts.Nano()), true
}
