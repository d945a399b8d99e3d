#include "textflag.h"

// KSTEP issues one k-step: row boff of the B panel (bytes) in Y12 and Y13,
// the six A values at aoff (bytes) broadcast in turn, twelve FMAs.
#define KSTEP(aoff, boff) \
	VMOVUPS boff(DX), Y12 \
	VMOVUPS boff+32(DX), Y13 \
	VBROADCASTSS aoff(SI), Y14 \
	VFMADD231PS Y12, Y14, Y0 \
	VFMADD231PS Y13, Y14, Y1 \
	VBROADCASTSS aoff+4(SI), Y15 \
	VFMADD231PS Y12, Y15, Y2 \
	VFMADD231PS Y13, Y15, Y3 \
	VBROADCASTSS aoff+8(SI), Y14 \
	VFMADD231PS Y12, Y14, Y4 \
	VFMADD231PS Y13, Y14, Y5 \
	VBROADCASTSS aoff+12(SI), Y15 \
	VFMADD231PS Y12, Y15, Y6 \
	VFMADD231PS Y13, Y15, Y7 \
	VBROADCASTSS aoff+16(SI), Y14 \
	VFMADD231PS Y12, Y14, Y8 \
	VFMADD231PS Y13, Y14, Y9 \
	VBROADCASTSS aoff+20(SI), Y15 \
	VFMADD231PS Y12, Y15, Y10 \
	VFMADD231PS Y13, Y15, Y11

// func sgemm6x16AVX2(kc int, a, b, c *float32, ldc int)
// C[i][j] += Σ_{p<kc} a[p·6 + i]·b[p·16 + j] for i < 6, j < 16, where a
// and b are packed micro-panels (6 values of A and 16 of B per k-step)
// and C[i][j] = c[i·ldc + j] (ldc in elements). Twelve accumulators of 8
// float32 hold the 6×16 tile; each k-step loads one row of B (two
// registers), broadcasts the six A values and issues twelve FMAs. The loop
// is unrolled twice; the products are summed in k order, one FMA each.
TEXT ·sgemm6x16AVX2(SB), NOSPLIT, $0-40
	MOVQ kc+0(FP), CX
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ c+24(FP), DI
	MOVQ ldc+32(FP), R9
	SHLQ $2, R9
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	VXORPS Y8, Y8, Y8
	VXORPS Y9, Y9, Y9
	VXORPS Y10, Y10, Y10
	VXORPS Y11, Y11, Y11

loop2:
	CMPQ CX, $2
	JL   tail
	KSTEP(0, 0)
	KSTEP(24, 64)
	ADDQ $48, SI
	ADDQ $128, DX
	SUBQ $2, CX
	JMP  loop2

tail:
	TESTQ CX, CX
	JZ    store
	KSTEP(0, 0)

store:
	VADDPS (DI), Y0, Y0
	VADDPS 32(DI), Y1, Y1
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	ADDQ R9, DI
	VADDPS (DI), Y2, Y2
	VADDPS 32(DI), Y3, Y3
	VMOVUPS Y2, (DI)
	VMOVUPS Y3, 32(DI)
	ADDQ R9, DI
	VADDPS (DI), Y4, Y4
	VADDPS 32(DI), Y5, Y5
	VMOVUPS Y4, (DI)
	VMOVUPS Y5, 32(DI)
	ADDQ R9, DI
	VADDPS (DI), Y6, Y6
	VADDPS 32(DI), Y7, Y7
	VMOVUPS Y6, (DI)
	VMOVUPS Y7, 32(DI)
	ADDQ R9, DI
	VADDPS (DI), Y8, Y8
	VADDPS 32(DI), Y9, Y9
	VMOVUPS Y8, (DI)
	VMOVUPS Y9, 32(DI)
	ADDQ R9, DI
	VADDPS (DI), Y10, Y10
	VADDPS 32(DI), Y11, Y11
	VMOVUPS Y10, (DI)
	VMOVUPS Y11, 32(DI)
	VZEROUPPER
	RET

// DKSTEP is KSTEP in float64: a row of 8 values of B, six A values.
#define DKSTEP(aoff, boff) \
	VMOVUPD boff(DX), Y12 \
	VMOVUPD boff+32(DX), Y13 \
	VBROADCASTSD aoff(SI), Y14 \
	VFMADD231PD Y12, Y14, Y0 \
	VFMADD231PD Y13, Y14, Y1 \
	VBROADCASTSD aoff+8(SI), Y15 \
	VFMADD231PD Y12, Y15, Y2 \
	VFMADD231PD Y13, Y15, Y3 \
	VBROADCASTSD aoff+16(SI), Y14 \
	VFMADD231PD Y12, Y14, Y4 \
	VFMADD231PD Y13, Y14, Y5 \
	VBROADCASTSD aoff+24(SI), Y15 \
	VFMADD231PD Y12, Y15, Y6 \
	VFMADD231PD Y13, Y15, Y7 \
	VBROADCASTSD aoff+32(SI), Y14 \
	VFMADD231PD Y12, Y14, Y8 \
	VFMADD231PD Y13, Y14, Y9 \
	VBROADCASTSD aoff+40(SI), Y15 \
	VFMADD231PD Y12, Y15, Y10 \
	VFMADD231PD Y13, Y15, Y11

// func dgemm6x8AVX2(kc int, a, b, c *float64, ldc int)
// sgemm6x16AVX2 in float64: C[i][j] += Σ_{p<kc} a[p·6 + i]·b[p·8 + j] for
// i < 6, j < 8, twelve accumulators of 4 float64.
TEXT ·dgemm6x8AVX2(SB), NOSPLIT, $0-40
	MOVQ kc+0(FP), CX
	MOVQ a+8(FP), SI
	MOVQ b+16(FP), DX
	MOVQ c+24(FP), DI
	MOVQ ldc+32(FP), R9
	SHLQ $3, R9
	VXORPD Y0, Y0, Y0
	VXORPD Y1, Y1, Y1
	VXORPD Y2, Y2, Y2
	VXORPD Y3, Y3, Y3
	VXORPD Y4, Y4, Y4
	VXORPD Y5, Y5, Y5
	VXORPD Y6, Y6, Y6
	VXORPD Y7, Y7, Y7
	VXORPD Y8, Y8, Y8
	VXORPD Y9, Y9, Y9
	VXORPD Y10, Y10, Y10
	VXORPD Y11, Y11, Y11

dloop2:
	CMPQ CX, $2
	JL   dtail
	DKSTEP(0, 0)
	DKSTEP(48, 64)
	ADDQ $96, SI
	ADDQ $128, DX
	SUBQ $2, CX
	JMP  dloop2

dtail:
	TESTQ CX, CX
	JZ    dstore
	DKSTEP(0, 0)

dstore:
	VADDPD (DI), Y0, Y0
	VADDPD 32(DI), Y1, Y1
	VMOVUPD Y0, (DI)
	VMOVUPD Y1, 32(DI)
	ADDQ R9, DI
	VADDPD (DI), Y2, Y2
	VADDPD 32(DI), Y3, Y3
	VMOVUPD Y2, (DI)
	VMOVUPD Y3, 32(DI)
	ADDQ R9, DI
	VADDPD (DI), Y4, Y4
	VADDPD 32(DI), Y5, Y5
	VMOVUPD Y4, (DI)
	VMOVUPD Y5, 32(DI)
	ADDQ R9, DI
	VADDPD (DI), Y6, Y6
	VADDPD 32(DI), Y7, Y7
	VMOVUPD Y6, (DI)
	VMOVUPD Y7, 32(DI)
	ADDQ R9, DI
	VADDPD (DI), Y8, Y8
	VADDPD 32(DI), Y9, Y9
	VMOVUPD Y8, (DI)
	VMOVUPD Y9, 32(DI)
	ADDQ R9, DI
	VADDPD (DI), Y10, Y10
	VADDPD 32(DI), Y11, Y11
	VMOVUPD Y10, (DI)
	VMOVUPD Y11, 32(DI)
	VZEROUPPER
	RET
