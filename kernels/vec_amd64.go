//go:build amd64

package kernels

import "golang.org/x/sys/cpu"

// haveVec reports whether the AVX2+FMA kernels of vec_amd64.s can run on
// this CPU. It is set once when the package is initialised.
var haveVec = cpu.X86.HasAVX2 && cpu.X86.HasFMA

//go:noescape
func expShiftStoreAVX2(dst, src *float32, n int, shift float64) float64

//go:noescape
func expShiftSumAVX2(src *float32, n int, shift float64) float64

//go:noescape
func maxAVX2(src *float32, n int) float32

//go:noescape
func geluAVX2(y, d, x *float32, n int)

//go:noescape
func addF32AVX2(dst, a, b *float32, n int)

//go:noescape
func mulF32AVX2(dst, a, b *float32, n int)

//go:noescape
func colSumAVX2(acc *float64, x *float32, rows, n int)

//go:noescape
func lnStatsAVX2(x *float32, n int, k float64) (s1, s2 float64)

//go:noescape
func lnAffineAVX2(y, x, w, b *float32, n int, a, c float64)

//go:noescape
func lnBackAVX2(dwa, dba *float64, gp, x, w *float32, n int, mu, rs float64) (m1, m2 float64)

//go:noescape
func lnDxAVX2(dx, gp, x, w *float32, n int, mu, rs, m1, m2 float64)

//go:noescape
func dotAVX2(a, b *float32, n int) float64

//go:noescape
func softBackAVX2(dx, y, dy *float32, n int, s, scale float64)

//go:noescape
func gemm4x16AVX2(c *float32, ldc int, a *float32, sai, sap int, b *float32, ldb int, k int, alpha float32)

//go:noescape
func transpose8x8AVX2(dst *float32, ldd int, src *float32, lds int)

//go:noescape
func adamwAVX2(p, grad, m, v *float32, n int, c *[8]float32)

//go:noescape
func scaleF32AVX2(dst, x *float32, n int, c float32)

//go:noescape
func scaleDotF32AVX2(dst, x, y *float32, n int, c float32, store bool) float64

//go:noescape
func axpyF32AVX2(dst, x *float32, n int, c float32)

//go:noescape
func pairF32AVX2(dst, x, y *float32, n int, a, b float32, set bool)

// sgemm6x16AVX2 adds a packed 6×kc panel of A times a packed kc×16 panel
// of B into the 6×16 tile at c (row stride ldc elements); gemm_amd64.s.
//
//go:noescape
func sgemm6x16AVX2(kc int, a, b, c *float32, ldc int)

// dgemm6x8AVX2 adds a packed 6×kc panel of A times a packed kc×8 panel of
// B into the 6×8 tile at c (row stride ldc elements); gemm_amd64.s.
//
//go:noescape
func dgemm6x8AVX2(kc int, a, b, c *float64, ldc int)
