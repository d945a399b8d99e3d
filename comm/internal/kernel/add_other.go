//go:build !amd64

package kernel

import "github.com/b7ea7098/loom/comm"

func addF32(d, a, b []float32)       { combine(comm.Sum, d, a, b) }
func addF64(d, a, b []float64)       { combine(comm.Sum, d, a, b) }
func addF32Stream(d, a, b []float32) { combine(comm.Sum, d, a, b) }
func addF64Stream(d, a, b []float64) { combine(comm.Sum, d, a, b) }
func copyStream(dst, src []byte)     { copy(dst, src) }
