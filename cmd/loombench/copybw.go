package main

import (
	"slices"
	"time"
)

// copyBandwidth measures the machine's single-stream memory-copy bandwidth,
// the ceiling for in-process transfers: payload bytes per second of copying
// size bytes between two buffers, the median of reps copies after one
// untimed copy that faults the pages in.
func copyBandwidth(size, reps int) float64 {
	src, dst := make([]byte, size), make([]byte, size)
	if size == 0 || reps < 1 {
		return 0
	}
	// Fill src with non-zero data by doubling, which is fast.
	for i := range min(size, 4096) {
		src[i] = byte(i*7 + 1)
	}
	for n := 4096; n < size; n *= 2 {
		copy(src[n:], src[:n])
	}
	copy(dst, src)
	times := make([]time.Duration, reps)
	for i := range times {
		t0 := time.Now()
		copy(dst, src)
		times[i] = time.Since(t0)
	}
	slices.Sort(times)
	med := times[reps/2]
	if med <= 0 {
		return 0
	}
	return float64(size) / med.Seconds()
}
