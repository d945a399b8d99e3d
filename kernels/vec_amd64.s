#include "textflag.h"

// Vector kernels for vec_amd64.go, AVX2 + FMA. Every transcendental is
// evaluated in float64 lanes (four per register) on float32 data, so the
// float32 results are rounded once from values accurate to about 1e-11
// (exp) and 5e-10 (erfc) relative.

// CONST4 defines a 32-byte read-only constant: four copies of the float64 v.
#define CONST4(name, v) \
	DATA name<>+0(SB)/8, $v  \
	DATA name<>+8(SB)/8, $v  \
	DATA name<>+16(SB)/8, $v \
	DATA name<>+24(SB)/8, $v \
	GLOBL name<>(SB), RODATA|NOPTR, $32

// exp: x = k·ln2 + r with k = round(x·log2(e)), |r| <= ln2/2, and
// exp(r) by its Taylor polynomial of degree 10 (truncation error below
// 2e-12 relative), then 2^k added into the exponent field.
CONST4(expLo, -708.0)
CONST4(expHi, 709.0)
CONST4(expLog2e, 1.4426950408889634074)
CONST4(expLn2Hi, 6.93147180369123816490e-01)
CONST4(expLn2Lo, 1.90821492927058770002e-10)
CONST4(expC10, 2.755731922398589065e-07)
CONST4(expC9, 2.755731922398589065e-06)
CONST4(expC8, 2.4801587301587301587e-05)
CONST4(expC7, 1.9841269841269841270e-04)
CONST4(expC6, 1.3888888888888888889e-03)
CONST4(expC5, 8.3333333333333333333e-03)
CONST4(expC4, 4.1666666666666666667e-02)
CONST4(expC3, 1.6666666666666666667e-01)
CONST4(expC2, 0.5)
CONST4(one, 1.0)

// EXP4 sets X (four float64) to exp(X). X is first clamped to [-708, 709]
// (NaN passes through: MAXPD and MINPD return their second source, X, when
// either is NaN). K (with KX its low half), R, P and T are clobbered.
#define EXP4(X, K, KX, R, P, T) \
	VMOVUPD expLo<>(SB), T            \
	VMAXPD X, T, X                    \
	VMOVUPD expHi<>(SB), T            \
	VMINPD X, T, X                    \
	VMULPD expLog2e<>(SB), X, K       \
	VROUNDPD $0, K, K                 \
	VMOVAPD X, R                      \
	VFNMADD231PD expLn2Hi<>(SB), K, R \
	VFNMADD231PD expLn2Lo<>(SB), K, R \
	VMOVUPD expC10<>(SB), P           \
	VFMADD213PD expC9<>(SB), R, P     \
	VFMADD213PD expC8<>(SB), R, P     \
	VFMADD213PD expC7<>(SB), R, P     \
	VFMADD213PD expC6<>(SB), R, P     \
	VFMADD213PD expC5<>(SB), R, P     \
	VFMADD213PD expC4<>(SB), R, P     \
	VFMADD213PD expC3<>(SB), R, P     \
	VFMADD213PD expC2<>(SB), R, P     \
	VFMADD213PD one<>(SB), R, P       \
	VFMADD213PD one<>(SB), R, P       \
	VCVTPD2DQY K, KX                  \
	VPMOVSXDQ KX, K                   \
	VPSLLQ $52, K, K                  \
	VPADDQ K, P, X

// func expShiftStoreAVX2(dst, src *float32, n int, shift float64) float64
// dst[i] = float32(exp(float64(src[i]) - shift)) for i < n (a multiple of
// 4); returns the sum of the unrounded values. dst may alias src.
TEXT ·expShiftStoreAVX2(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSD shift+24(FP), Y5
	VXORPD Y6, Y6, Y6

storeloop:
	CMPQ CX, $4
	JL   storedone
	VCVTPS2PD (SI), Y0
	VSUBPD Y5, Y0, Y0
	EXP4(Y0, Y1, X1, Y2, Y3, Y4)
	VADDPD Y0, Y6, Y6
	VCVTPD2PSY Y0, X0
	VMOVUPS X0, (DI)
	ADDQ $16, SI
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  storeloop

storedone:
	VEXTRACTF128 $1, Y6, X7
	VADDPD X7, X6, X6
	VUNPCKHPD X6, X6, X7
	VADDSD X7, X6, X6
	VZEROUPPER
	MOVSD X6, ret+32(FP)
	RET

// func expShiftSumAVX2(src *float32, n int, shift float64) float64
// Returns the sum of exp(float64(src[i]) - shift) for i < n (a multiple
// of 4).
TEXT ·expShiftSumAVX2(SB), NOSPLIT, $0-32
	MOVQ src+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD shift+16(FP), Y5
	VXORPD Y6, Y6, Y6

sumloop:
	CMPQ CX, $4
	JL   sumdone
	VCVTPS2PD (SI), Y0
	VSUBPD Y5, Y0, Y0
	EXP4(Y0, Y1, X1, Y2, Y3, Y4)
	VADDPD Y0, Y6, Y6
	ADDQ $16, SI
	SUBQ $4, CX
	JMP  sumloop

sumdone:
	VEXTRACTF128 $1, Y6, X7
	VADDPD X7, X6, X6
	VUNPCKHPD X6, X6, X7
	VADDSD X7, X6, X6
	VZEROUPPER
	MOVSD X6, ret+24(FP)
	RET

// func maxAVX2(src *float32, n int) float32
// Returns the largest of src[0..n), n a positive multiple of 8. NaN
// elements may or may not be returned.
TEXT ·maxAVX2(SB), NOSPLIT, $0-20
	MOVQ src+0(FP), SI
	MOVQ n+8(FP), CX
	VMOVUPS (SI), Y0
	ADDQ $32, SI
	SUBQ $8, CX

maxloop:
	CMPQ CX, $8
	JL   maxdone
	VMAXPS (SI), Y0, Y0
	ADDQ $32, SI
	SUBQ $8, CX
	JMP  maxloop

maxdone:
	VEXTRACTF128 $1, Y0, X1
	VMAXPS X1, X0, X0
	VPERMILPS $0x4E, X0, X1
	VMAXPS X1, X0, X0
	VPERMILPS $0xB1, X0, X1
	VMAXPS X1, X0, X0
	VZEROUPPER
	MOVSS X0, ret+16(FP)
	RET

// GELU: Φ(x) = erfc(-x/√2)/2. With z = |x|/√2, erfc(z) = exp(-z²)·t·P(u)
// for t = 1/(1 + 0.305·z) and u = a·t + b mapping t ∈ [1/4.05, 1] (z ∈
// [0, 10]) onto [-1, 1]; P is a degree-10 least-squares fit of
// erfc(z)·exp(z²)/t with relative error below 3.5e-10 on z ∈ [0, 10]
// (z > 10 uses u = -1; erfc(10) < 3e-45 is below float32's range anyway).
// Then Φ = erfc/2 for x < 0 and 1 - erfc/2 otherwise, y = x·Φ and
// GELU'(x) = Φ + x·exp(-x²/2)/√(2π).
CONST4(absMask, 0x7fffffffffffffff)
CONST4(signMask, 0x8000000000000000)
CONST4(invSqrt2, 0.70710678118654752440)
CONST4(invSqrt2Pi, 0.39894228040143267794)
CONST4(half, 0.5)
CONST4(negOne, -1.0)
CONST4(erfcP, 0.305)
CONST4(erfcUA, 2.6557377049180326)
CONST4(erfcUB, -1.6557377049180328)
CONST4(erfc0, 0.4130630612261188)
CONST4(erfc1, 0.30312138336367489)
CONST4(erfc2, 0.17465095801509289)
CONST4(erfc3, 0.077929657601408978)
CONST4(erfc4, 0.025690880361566103)
CONST4(erfc5, 0.0054547286912523555)
CONST4(erfc6, 0.00032678196385378905)
CONST4(erfc7, -0.00019621271726104786)
CONST4(erfc8, -4.91025229970057e-05)
CONST4(erfc9, 4.9329194508199515e-06)
CONST4(erfc10, 2.9314456170132588e-06)

// func geluAVX2(y, d, x *float32, n int)
// y[i] = GELU(x[i]) and, when d is not nil, d[i] = GELU'(x[i]), for i < n
// (a multiple of 4). y and d may alias x. The loop is bound by the FMA
// pipes (about 33 multiplies and FMAs per four elements), not by its
// dependency chains: interleaving two groups measured no faster.
TEXT ·geluAVX2(SB), NOSPLIT, $0-32
	MOVQ y+0(FP), DI
	MOVQ d+8(FP), DX
	MOVQ x+16(FP), SI
	MOVQ n+24(FP), CX
	VXORPD Y15, Y15, Y15

geluloop:
	CMPQ CX, $4
	JL   geludone
	VCVTPS2PD (SI), Y0           // x
	VANDPD absMask<>(SB), Y0, Y1 // |x|
	VMULPD invSqrt2<>(SB), Y1, Y1 // z
	VMULPD Y1, Y1, Y2
	VXORPD signMask<>(SB), Y2, Y2 // -z²
	EXP4(Y2, Y3, X3, Y4, Y5, Y6)  // Y2 = exp(-z²)
	VMOVUPD one<>(SB), Y7
	VMULPD erfcP<>(SB), Y1, Y3
	VADDPD Y7, Y3, Y3
	VDIVPD Y3, Y7, Y3
	VMULPD erfcUA<>(SB), Y3, Y4
	VADDPD erfcUB<>(SB), Y4, Y4
	VMOVUPD negOne<>(SB), Y6
	VMAXPD Y4, Y6, Y4
	VMOVUPD erfc10<>(SB), Y5
	VFMADD213PD erfc9<>(SB), Y4, Y5
	VFMADD213PD erfc8<>(SB), Y4, Y5
	VFMADD213PD erfc7<>(SB), Y4, Y5
	VFMADD213PD erfc6<>(SB), Y4, Y5
	VFMADD213PD erfc5<>(SB), Y4, Y5
	VFMADD213PD erfc4<>(SB), Y4, Y5
	VFMADD213PD erfc3<>(SB), Y4, Y5
	VFMADD213PD erfc2<>(SB), Y4, Y5
	VFMADD213PD erfc1<>(SB), Y4, Y5
	VFMADD213PD erfc0<>(SB), Y4, Y5
	VMULPD Y3, Y5, Y5
	VMULPD Y2, Y5, Y5
	VMULPD half<>(SB), Y5, Y5
	VSUBPD Y5, Y7, Y6            // 1 - h
	VCMPPD $1, Y15, Y0, Y8       // x < 0
	VANDPD Y8, Y5, Y5
	VANDNPD Y6, Y8, Y6
	VORPD Y5, Y6, Y6             // Φ
	VMULPD Y6, Y0, Y4            // y = x·Φ
	VCVTPD2PSY Y4, X4
	VMOVUPS X4, (DI)
	TESTQ DX, DX
	JZ    gelunext
	VMULPD invSqrt2Pi<>(SB), Y2, Y2 // φ(x)
	VFMADD231PD Y2, Y0, Y6          // Φ + x·φ
	VCVTPD2PSY Y6, X6
	VMOVUPS X6, (DX)
	ADDQ $16, DX

gelunext:
	ADDQ $16, SI
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  geluloop

geludone:
	VZEROUPPER
	RET

// func addF32AVX2(dst, a, b *float32, n int)
// dst[i] = a[i] + b[i] for i < n (a multiple of 8); dst may alias a or b.
TEXT ·addF32AVX2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX

addloop:
	CMPQ CX, $8
	JL   adddone
	VMOVUPS (SI), Y0
	VADDPS (DX), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  addloop

adddone:
	VZEROUPPER
	RET

// func mulF32AVX2(dst, a, b *float32, n int)
// dst[i] = a[i] * b[i] for i < n (a multiple of 8); dst may alias a or b.
TEXT ·mulF32AVX2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ n+24(FP), CX

mulloop:
	CMPQ CX, $8
	JL   muldone
	VMOVUPS (SI), Y0
	VMULPS (DX), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  mulloop

muldone:
	VZEROUPPER
	RET

// func colSumAVX2(acc *float64, x *float32, rows, n int)
// acc[j] += Σ_r x[r·n + j] for j < n (a multiple of 4), in float64.
TEXT ·colSumAVX2(SB), NOSPLIT, $0-32
	MOVQ acc+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ rows+16(FP), BX
	MOVQ n+24(FP), R8

colrow:
	TESTQ BX, BX
	JZ    coldone
	MOVQ DI, R9
	MOVQ R8, CX

colloop:
	CMPQ CX, $4
	JL   colnext
	VCVTPS2PD (SI), Y0
	VADDPD (R9), Y0, Y0
	VMOVUPD Y0, (R9)
	ADDQ $16, SI
	ADDQ $32, R9
	SUBQ $4, CX
	JMP  colloop

colnext:
	DECQ BX
	JMP  colrow

coldone:
	VZEROUPPER
	RET

// HSUM4(Y, X, T, TX) sums the four float64 of Y into the low lane of X.
#define HSUM4(Y, X, T, TX) \
	VEXTRACTF128 $1, Y, TX \
	VADDPD TX, X, X        \
	VUNPCKHPD X, X, TX     \
	VADDSD TX, X, X

// func lnStatsAVX2(x *float32, n int, k float64) (s1, s2 float64)
// s1 = Σ (x[i] − k), s2 = Σ (x[i] − k)² for i < n (a multiple of 4).
TEXT ·lnStatsAVX2(SB), NOSPLIT, $0-40
	MOVQ x+0(FP), SI
	MOVQ n+8(FP), CX
	VBROADCASTSD k+16(FP), Y5
	VXORPD Y6, Y6, Y6
	VXORPD Y7, Y7, Y7

statloop:
	CMPQ CX, $4
	JL   statdone
	VCVTPS2PD (SI), Y0
	VSUBPD Y5, Y0, Y0
	VADDPD Y0, Y6, Y6
	VFMADD231PD Y0, Y0, Y7
	ADDQ $16, SI
	SUBQ $4, CX
	JMP  statloop

statdone:
	HSUM4(Y6, X6, Y1, X1)
	HSUM4(Y7, X7, Y1, X1)
	VZEROUPPER
	MOVSD X6, s1+24(FP)
	MOVSD X7, s2+32(FP)
	RET

// func lnAffineAVX2(y, x, w, b *float32, n int, a, c float64)
// y[i] = float32((x[i]·a + c)·w[i] + b[i]) for i < n (a multiple of 4).
TEXT ·lnAffineAVX2(SB), NOSPLIT, $0-56
	MOVQ y+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ w+16(FP), R8
	MOVQ b+24(FP), R9
	MOVQ n+32(FP), CX
	VBROADCASTSD a+40(FP), Y5
	VBROADCASTSD c+48(FP), Y6

affloop:
	CMPQ CX, $4
	JL   affdone
	VCVTPS2PD (SI), Y0
	VFMADD213PD Y6, Y5, Y0 // x·a + c
	VCVTPS2PD (R8), Y1
	VCVTPS2PD (R9), Y2
	VFMADD213PD Y2, Y1, Y0 // ·w + b
	VCVTPD2PSY Y0, X0
	VMOVUPS X0, (DI)
	ADDQ $16, SI
	ADDQ $16, R8
	ADDQ $16, R9
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  affloop

affdone:
	VZEROUPPER
	RET

// func lnBackAVX2(dwa, dba *float64, gp, x, w *float32, n int, mu, rs float64) (m1, m2 float64)
// With x̂ = (x − mu)·rs and h = g·w over i < n (a multiple of 4):
// dwa[i] += g·x̂ and dba[i] += g (either pointer may be nil: skipped),
// m1 = Σ h and m2 = Σ h·x̂.
TEXT ·lnBackAVX2(SB), NOSPLIT, $0-80
	MOVQ dwa+0(FP), DI
	MOVQ dba+8(FP), DX
	MOVQ gp+16(FP), SI
	MOVQ x+24(FP), R8
	MOVQ w+32(FP), R9
	MOVQ n+40(FP), CX
	VBROADCASTSD mu+48(FP), Y5
	VBROADCASTSD rs+56(FP), Y6
	VXORPD Y7, Y7, Y7
	VXORPD Y8, Y8, Y8

backloop:
	CMPQ CX, $4
	JL   backdone
	VCVTPS2PD (SI), Y0     // g
	VCVTPS2PD (R8), Y1
	VSUBPD Y5, Y1, Y1
	VMULPD Y6, Y1, Y1      // x̂
	TESTQ DI, DI
	JZ    backnodw
	VMOVUPD (DI), Y2
	VFMADD231PD Y1, Y0, Y2 // dwa += g·x̂
	VMOVUPD Y2, (DI)
	ADDQ $32, DI

backnodw:
	TESTQ DX, DX
	JZ    backnodb
	VADDPD (DX), Y0, Y3    // dba += g
	VMOVUPD Y3, (DX)
	ADDQ $32, DX

backnodb:
	VCVTPS2PD (R9), Y2
	VMULPD Y2, Y0, Y0      // h = g·w
	VADDPD Y0, Y7, Y7
	VFMADD231PD Y1, Y0, Y8 // m2 += h·x̂
	ADDQ $16, SI
	ADDQ $16, R8
	ADDQ $16, R9
	SUBQ $4, CX
	JMP  backloop

backdone:
	HSUM4(Y7, X7, Y1, X1)
	HSUM4(Y8, X8, Y1, X1)
	VZEROUPPER
	MOVSD X7, m1+64(FP)
	MOVSD X8, m2+72(FP)
	RET

// func lnDxAVX2(dx, gp, x, w *float32, n int, mu, rs, m1, m2 float64)
// dx[i] = float32(rs·(g·w − m1 − x̂·m2)) with x̂ = (x − mu)·rs, i < n (a
// multiple of 4). dx may alias g.
TEXT ·lnDxAVX2(SB), NOSPLIT, $0-72
	MOVQ dx+0(FP), DI
	MOVQ gp+8(FP), SI
	MOVQ x+16(FP), R8
	MOVQ w+24(FP), R9
	MOVQ n+32(FP), CX
	VBROADCASTSD mu+40(FP), Y5
	VBROADCASTSD rs+48(FP), Y6
	VBROADCASTSD m1+56(FP), Y7
	VBROADCASTSD m2+64(FP), Y8

dxloop:
	CMPQ CX, $4
	JL   dxdone
	VCVTPS2PD (SI), Y0
	VCVTPS2PD (R9), Y2
	VMULPD Y2, Y0, Y0      // h
	VSUBPD Y7, Y0, Y0      // h − m1
	VCVTPS2PD (R8), Y1
	VSUBPD Y5, Y1, Y1
	VMULPD Y6, Y1, Y1      // x̂
	VFNMADD231PD Y8, Y1, Y0 // − x̂·m2
	VMULPD Y6, Y0, Y0
	VCVTPD2PSY Y0, X0
	VMOVUPS X0, (DI)
	ADDQ $16, SI
	ADDQ $16, R8
	ADDQ $16, R9
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  dxloop

dxdone:
	VZEROUPPER
	RET

// func dotAVX2(a, b *float32, n int) float64
// Σ a[i]·b[i] over i < n (a multiple of 4), in float64.
TEXT ·dotAVX2(SB), NOSPLIT, $0-32
	MOVQ a+0(FP), SI
	MOVQ b+8(FP), DX
	MOVQ n+16(FP), CX
	VXORPD Y6, Y6, Y6

dotloop:
	CMPQ CX, $4
	JL   dotdone
	VCVTPS2PD (SI), Y0
	VCVTPS2PD (DX), Y1
	VFMADD231PD Y1, Y0, Y6
	ADDQ $16, SI
	ADDQ $16, DX
	SUBQ $4, CX
	JMP  dotloop

dotdone:
	HSUM4(Y6, X6, Y1, X1)
	VZEROUPPER
	MOVSD X6, ret+24(FP)
	RET

// func softBackAVX2(dx, y, dy *float32, n int, s, scale float64)
// dx[i] = float32(scale·y[i]·(dy[i] − s)) for i < n (a multiple of 4);
// dx may alias dy.
TEXT ·softBackAVX2(SB), NOSPLIT, $0-48
	MOVQ dx+0(FP), DI
	MOVQ y+8(FP), SI
	MOVQ dy+16(FP), DX
	MOVQ n+24(FP), CX
	VBROADCASTSD s+32(FP), Y5
	VBROADCASTSD scale+40(FP), Y6

sbloop:
	CMPQ CX, $4
	JL   sbdone
	VCVTPS2PD (DX), Y0
	VSUBPD Y5, Y0, Y0
	VCVTPS2PD (SI), Y1
	VMULPD Y6, Y1, Y1
	VMULPD Y1, Y0, Y0
	VCVTPD2PSY Y0, X0
	VMOVUPS X0, (DI)
	ADDQ $16, SI
	ADDQ $16, DX
	ADDQ $16, DI
	SUBQ $4, CX
	JMP  sbloop

sbdone:
	VZEROUPPER
	RET

// func gemm4x16AVX2(c *float32, ldc int, a *float32, sai, sap int, b *float32, ldb int, k int, alpha float32)
// C[i][j] = alpha·Σ_{p<k} A(i,p)·B[p][j] for i < 4, j < 16, with A(i,p) =
// a[i·sai + p·sap], B[p][j] = b[p·ldb + j] and C[i][j] = c[i·ldc + j]
// (strides in elements). Eight accumulators of 8 float32 hold the 4×16
// block; each k-step loads one row of B (two registers), broadcasts the
// four A values and issues eight FMAs. The sums are rounded to float32
// before the multiply by alpha, as when scaling a stored product.
TEXT ·gemm4x16AVX2(SB), NOSPLIT, $0-68
	MOVQ c+0(FP), DI
	MOVQ ldc+8(FP), R9
	SHLQ $2, R9
	MOVQ a+16(FP), SI
	MOVQ sai+24(FP), R8
	SHLQ $2, R8
	MOVQ sap+32(FP), R10
	SHLQ $2, R10
	MOVQ b+40(FP), DX
	MOVQ ldb+48(FP), R12
	SHLQ $2, R12
	MOVQ k+56(FP), CX
	LEAQ (SI)(R8*2), R11
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

gemmloop:
	TESTQ CX, CX
	JZ    gemmdone
	VMOVUPS (DX), Y8
	VMOVUPS 32(DX), Y9
	VBROADCASTSS (SI), Y10
	VFMADD231PS Y8, Y10, Y0
	VFMADD231PS Y9, Y10, Y1
	VBROADCASTSS (SI)(R8*1), Y11
	VFMADD231PS Y8, Y11, Y2
	VFMADD231PS Y9, Y11, Y3
	VBROADCASTSS (R11), Y12
	VFMADD231PS Y8, Y12, Y4
	VFMADD231PS Y9, Y12, Y5
	VBROADCASTSS (R11)(R8*1), Y13
	VFMADD231PS Y8, Y13, Y6
	VFMADD231PS Y9, Y13, Y7
	ADDQ R10, SI
	ADDQ R10, R11
	ADDQ R12, DX
	DECQ CX
	JMP  gemmloop

gemmdone:
	VBROADCASTSS alpha+64(FP), Y15
	VMULPS Y15, Y0, Y0
	VMULPS Y15, Y1, Y1
	VMULPS Y15, Y2, Y2
	VMULPS Y15, Y3, Y3
	VMULPS Y15, Y4, Y4
	VMULPS Y15, Y5, Y5
	VMULPS Y15, Y6, Y6
	VMULPS Y15, Y7, Y7
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	ADDQ R9, DI
	VMOVUPS Y2, (DI)
	VMOVUPS Y3, 32(DI)
	ADDQ R9, DI
	VMOVUPS Y4, (DI)
	VMOVUPS Y5, 32(DI)
	ADDQ R9, DI
	VMOVUPS Y6, (DI)
	VMOVUPS Y7, 32(DI)
	VZEROUPPER
	RET

// func transpose8x8AVX2(dst *float32, ldd int, src *float32, lds int)
// dst[j·ldd + i] = src[i·lds + j] for i, j < 8 (strides in elements).
TEXT ·transpose8x8AVX2(SB), NOSPLIT, $0-32
	MOVQ dst+0(FP), DI
	MOVQ ldd+8(FP), R8
	SHLQ $2, R8
	MOVQ src+16(FP), SI
	MOVQ lds+24(FP), R9
	SHLQ $2, R9
	VMOVUPS (SI), Y0
	ADDQ R9, SI
	VMOVUPS (SI), Y1
	ADDQ R9, SI
	VMOVUPS (SI), Y2
	ADDQ R9, SI
	VMOVUPS (SI), Y3
	ADDQ R9, SI
	VMOVUPS (SI), Y4
	ADDQ R9, SI
	VMOVUPS (SI), Y5
	ADDQ R9, SI
	VMOVUPS (SI), Y6
	ADDQ R9, SI
	VMOVUPS (SI), Y7
	VUNPCKLPS Y1, Y0, Y8
	VUNPCKHPS Y1, Y0, Y9
	VUNPCKLPS Y3, Y2, Y10
	VUNPCKHPS Y3, Y2, Y11
	VUNPCKLPS Y5, Y4, Y12
	VUNPCKHPS Y5, Y4, Y13
	VUNPCKLPS Y7, Y6, Y14
	VUNPCKHPS Y7, Y6, Y15
	VSHUFPS $0x44, Y10, Y8, Y0
	VSHUFPS $0xEE, Y10, Y8, Y1
	VSHUFPS $0x44, Y11, Y9, Y2
	VSHUFPS $0xEE, Y11, Y9, Y3
	VSHUFPS $0x44, Y14, Y12, Y4
	VSHUFPS $0xEE, Y14, Y12, Y5
	VSHUFPS $0x44, Y15, Y13, Y6
	VSHUFPS $0xEE, Y15, Y13, Y7
	VPERM2F128 $0x20, Y4, Y0, Y8
	VPERM2F128 $0x20, Y5, Y1, Y9
	VPERM2F128 $0x20, Y6, Y2, Y10
	VPERM2F128 $0x20, Y7, Y3, Y11
	VPERM2F128 $0x31, Y4, Y0, Y12
	VPERM2F128 $0x31, Y5, Y1, Y13
	VPERM2F128 $0x31, Y6, Y2, Y14
	VPERM2F128 $0x31, Y7, Y3, Y15
	VMOVUPS Y8, (DI)
	ADDQ R8, DI
	VMOVUPS Y9, (DI)
	ADDQ R8, DI
	VMOVUPS Y10, (DI)
	ADDQ R8, DI
	VMOVUPS Y11, (DI)
	ADDQ R8, DI
	VMOVUPS Y12, (DI)
	ADDQ R8, DI
	VMOVUPS Y13, (DI)
	ADDQ R8, DI
	VMOVUPS Y14, (DI)
	ADDQ R8, DI
	VMOVUPS Y15, (DI)
	VZEROUPPER
	RET

// func adamwAVX2(p, grad, m, v *float32, n int, c *[8]float32)
// One AdamW update of n elements (a multiple of 8), the operations of
// adamwGo in its order, eight lanes at a time: no FMA, so every product
// and sum is rounded to float32 as there. c: decay, β1, 1−β1, β2, 1−β2,
// sqrt(bc2), step, ε.
TEXT ·adamwAVX2(SB), NOSPLIT, $0-48
	MOVQ p+0(FP), DI
	MOVQ grad+8(FP), SI
	MOVQ m+16(FP), DX
	MOVQ v+24(FP), R8
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), AX
	VBROADCASTSS 0(AX), Y8   // decay
	VBROADCASTSS 4(AX), Y9   // β1
	VBROADCASTSS 8(AX), Y10  // 1 − β1
	VBROADCASTSS 12(AX), Y11 // β2
	VBROADCASTSS 16(AX), Y12 // 1 − β2
	VBROADCASTSS 20(AX), Y13 // sqrt(bc2)
	VBROADCASTSS 24(AX), Y14 // step
	VBROADCASTSS 28(AX), Y15 // ε

adamwloop:
	CMPQ CX, $8
	JL   adamwdone
	VMOVUPS (SI), Y1          // g
	VMULPS  (DI), Y8, Y0      // p·decay
	VMULPS  (DX), Y9, Y2      // m·β1
	VMULPS  Y1, Y10, Y3       // (1−β1)·g
	VADDPS  Y3, Y2, Y2        // m
	VMULPS  (R8), Y11, Y4     // v·β2
	VMULPS  Y1, Y12, Y5       // (1−β2)·g
	VMULPS  Y1, Y5, Y5        // ((1−β2)·g)·g
	VADDPS  Y5, Y4, Y4        // v
	VSQRTPS Y4, Y6            // sqrt(v)
	VDIVPS  Y13, Y6, Y6       // sqrt(v)/sqrt(bc2)
	VADDPS  Y15, Y6, Y6       // den
	VMULPS  Y2, Y14, Y7       // step·m
	VDIVPS  Y6, Y7, Y7        // step·m/den
	VADDPS  Y7, Y0, Y0        // p
	VMOVUPS Y0, (DI)
	VMOVUPS Y2, (DX)
	VMOVUPS Y4, (R8)
	ADDQ $32, DI
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, R8
	SUBQ $8, CX
	JMP  adamwloop

adamwdone:
	VZEROUPPER
	RET

// func scaleF32AVX2(dst, x *float32, n int, c float32)
// dst[i] = c·x[i] for i < n (a multiple of 8).
TEXT ·scaleF32AVX2(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSS c+24(FP), Y2

scaleloop:
	CMPQ CX, $8
	JL   scaledone
	VMULPS (SI), Y2, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  scaleloop

scaledone:
	VZEROUPPER
	RET

// func axpyF32AVX2(dst, x *float32, n int, c float32)
// dst[i] += c·x[i] for i < n (a multiple of 8): a product then a sum, each
// rounded (no FMA), as the portable loop.
TEXT ·axpyF32AVX2(SB), NOSPLIT, $0-28
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSS c+24(FP), Y2

axpyloop:
	CMPQ CX, $8
	JL   axpydone
	VMULPS (SI), Y2, Y0
	VADDPS (DI), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  axpyloop

axpydone:
	VZEROUPPER
	RET

// func pairF32AVX2(dst, x, y *float32, n int, a, b float32, set bool)
// dst[i] = a·x[i] + b·y[i] (set) or dst[i] += (a·x[i] + b·y[i]) for i < n
// (a multiple of 8), every product and sum rounded as in the portable loop.
TEXT ·pairF32AVX2(SB), NOSPLIT, $0-41
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ y+16(FP), DX
	MOVQ n+24(FP), CX
	VBROADCASTSS a+32(FP), Y2
	VBROADCASTSS b+36(FP), Y3
	MOVBLZX set+40(FP), AX
	TESTQ AX, AX
	JZ    pairaddloop

pairsetloop:
	CMPQ CX, $8
	JL   pairdone
	VMULPS (SI), Y2, Y0
	VMULPS (DX), Y3, Y1
	VADDPS Y1, Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  pairsetloop

pairaddloop:
	CMPQ CX, $8
	JL   pairdone
	VMULPS (SI), Y2, Y0
	VMULPS (DX), Y3, Y1
	VADDPS Y1, Y0, Y0
	VADDPS (DI), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ $32, SI
	ADDQ $32, DX
	ADDQ $32, DI
	SUBQ $8, CX
	JMP  pairaddloop

pairdone:
	VZEROUPPER
	RET

// func scaleDotF32AVX2(dst, x, y *float32, n int, c float32, store bool) float64
// Returns Σ x[i]·y[i] for i < n (a multiple of 8), each product exact in
// float64 and summed in four float64 accumulators of four lanes (element i
// into accumulator (i/4) mod 4, the last eight of an odd number of eights
// into the first two), then (a0+a1)+(a2+a3) and the lanes pairwise; with
// store it also sets dst[i] = c·x[i] (one rounding, as scaleF32AVX2), in
// the same pass. Four chains keep the float64 adds from bounding the speed.
TEXT ·scaleDotF32AVX2(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ x+8(FP), SI
	MOVQ y+16(FP), DX
	MOVQ n+24(FP), CX
	VBROADCASTSS c+32(FP), Y7
	MOVBLZX store+36(FP), BX
	VXORPD Y4, Y4, Y4
	VXORPD Y5, Y5, Y5
	VXORPD Y6, Y6, Y6
	VXORPD Y8, Y8, Y8

sdloop16:
	CMPQ CX, $16
	JL   sdtail8
	VCVTPS2PD (SI), Y0
	VCVTPS2PD (DX), Y1
	VFMADD231PD Y1, Y0, Y4
	VCVTPS2PD 16(SI), Y0
	VCVTPS2PD 16(DX), Y1
	VFMADD231PD Y1, Y0, Y5
	VCVTPS2PD 32(SI), Y0
	VCVTPS2PD 32(DX), Y1
	VFMADD231PD Y1, Y0, Y6
	VCVTPS2PD 48(SI), Y0
	VCVTPS2PD 48(DX), Y1
	VFMADD231PD Y1, Y0, Y8
	TESTQ BX, BX
	JZ    sdnext16
	VMULPS (SI), Y7, Y2
	VMULPS 32(SI), Y7, Y3
	VMOVUPS Y2, (DI)
	VMOVUPS Y3, 32(DI)

sdnext16:
	ADDQ $64, SI
	ADDQ $64, DX
	ADDQ $64, DI
	SUBQ $16, CX
	JMP  sdloop16

sdtail8:
	CMPQ CX, $8
	JL   sddone
	VCVTPS2PD (SI), Y0
	VCVTPS2PD (DX), Y1
	VFMADD231PD Y1, Y0, Y4
	VCVTPS2PD 16(SI), Y0
	VCVTPS2PD 16(DX), Y1
	VFMADD231PD Y1, Y0, Y5
	TESTQ BX, BX
	JZ    sddone
	VMULPS (SI), Y7, Y2
	VMOVUPS Y2, (DI)

sddone:
	VADDPD Y5, Y4, Y4
	VADDPD Y8, Y6, Y6
	VADDPD Y6, Y4, Y4
	HSUM4(Y4, X4, Y1, X1)
	VZEROUPPER
	MOVSD X4, ret+40(FP)
	RET
