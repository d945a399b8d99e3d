//go:build !amd64

package kernels

// haveVec is false: the vector kernels are written for amd64 only, and
// the portable loops of vec.go serve.
const haveVec = false

func expShiftStoreAVX2(dst, src *float32, n int, shift float64) float64 { panic("unreachable") }
func expShiftSumAVX2(src *float32, n int, shift float64) float64        { panic("unreachable") }
func maxAVX2(src *float32, n int) float32                               { panic("unreachable") }
func geluAVX2(y, d, x *float32, n int)                                  { panic("unreachable") }
func addF32AVX2(dst, a, b *float32, n int)                              { panic("unreachable") }
func mulF32AVX2(dst, a, b *float32, n int)                              { panic("unreachable") }
func colSumAVX2(acc *float64, x *float32, rows, n int)                  { panic("unreachable") }
func lnStatsAVX2(x *float32, n int, k float64) (s1, s2 float64)         { panic("unreachable") }
func lnAffineAVX2(y, x, w, b *float32, n int, a, c float64)             { panic("unreachable") }
func lnBackAVX2(dwa, dba *float64, gp, x, w *float32, n int, mu, rs float64) (m1, m2 float64) {
	panic("unreachable")
}
func lnDxAVX2(dx, gp, x, w *float32, n int, mu, rs, m1, m2 float64) { panic("unreachable") }
func dotAVX2(a, b *float32, n int) float64                          { panic("unreachable") }
func softBackAVX2(dx, y, dy *float32, n int, s, scale float64)      { panic("unreachable") }
func gemm4x16AVX2(c *float32, ldc int, a *float32, sai, sap int, b *float32, ldb int, k int, alpha float32) {
	panic("unreachable")
}
func transpose8x8AVX2(dst *float32, ldd int, src *float32, lds int) { panic("unreachable") }
func adamwAVX2(p, grad, m, v *float32, n int, c *[8]float32)        { panic("unreachable") }
func scaleF32AVX2(dst, x *float32, n int, c float32)                { panic("unreachable") }
func scaleDotF32AVX2(dst, x, y *float32, n int, c float32, store bool) float64 {
	panic("unreachable")
}
func axpyF32AVX2(dst, x *float32, n int, c float32)                 { panic("unreachable") }
func pairF32AVX2(dst, x, y *float32, n int, a, b float32, set bool) { panic("unreachable") }

func sgemm6x16AVX2(kc int, a, b, c *float32, ldc int) { panic("unreachable") }

func dgemm6x8AVX2(kc int, a, b, c *float64, ldc int) { panic("unreachable") }
