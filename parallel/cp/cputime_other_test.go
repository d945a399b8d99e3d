//go:build !linux

package cp_test

import "time"

// threadCPU reports that the thread's CPU time cannot be read here: the
// benchmarks fall back to wall time.
func threadCPU() (time.Duration, bool) { return 0, false }
