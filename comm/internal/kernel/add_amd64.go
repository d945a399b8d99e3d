package kernel

import "golang.org/x/sys/cpu"

//go:noescape
func addF32AVX2(dst, a, b *float32, n int)

//go:noescape
func addF64AVX2(dst, a, b *float64, n int)

var hasAVX2 = cpu.X86.HasAVX2

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
