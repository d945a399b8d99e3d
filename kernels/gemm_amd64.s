#include "textflag.h"

// ZERO12 clears the twelve accumulators Y0-Y11.
#define ZERO12 \
	VXORPS Y0, Y0, Y0 \
	VXORPS Y1, Y1, Y1 \
	VXORPS Y2, Y2, Y2 \
	VXORPS Y3, Y3, Y3 \
	VXORPS Y4, Y4, Y4 \
	VXORPS Y5, Y5, Y5 \
	VXORPS Y6, Y6, Y6 \
	VXORPS Y7, Y7, Y7 \
	VXORPS Y8, Y8, Y8 \
	VXORPS Y9, Y9, Y9 \
	VXORPS Y10, Y10, Y10 \
	VXORPS Y11, Y11, Y11

// STORE12 adds the accumulators into the 6-row tile at DI (row stride R9
// bytes, two registers a row) with ADD and writes it back with MOV.
#define STORE12(ADD, MOV) \
	ADD (DI), Y0, Y0 \
	ADD 32(DI), Y1, Y1 \
	MOV Y0, (DI) \
	MOV Y1, 32(DI) \
	ADDQ R9, DI \
	ADD (DI), Y2, Y2 \
	ADD 32(DI), Y3, Y3 \
	MOV Y2, (DI) \
	MOV Y3, 32(DI) \
	ADDQ R9, DI \
	ADD (DI), Y4, Y4 \
	ADD 32(DI), Y5, Y5 \
	MOV Y4, (DI) \
	MOV Y5, 32(DI) \
	ADDQ R9, DI \
	ADD (DI), Y6, Y6 \
	ADD 32(DI), Y7, Y7 \
	MOV Y6, (DI) \
	MOV Y7, 32(DI) \
	ADDQ R9, DI \
	ADD (DI), Y8, Y8 \
	ADD 32(DI), Y9, Y9 \
	MOV Y8, (DI) \
	MOV Y9, 32(DI) \
	ADDQ R9, DI \
	ADD (DI), Y10, Y10 \
	ADD 32(DI), Y11, Y11 \
	MOV Y10, (DI) \
	MOV Y11, 32(DI)

// KSTEP issues one k-step on the accumulators: a row of B (two registers
// at boff bytes) in Y12 and Y13, then each of the six A values at aoff
// bytes (elements of w bytes) broadcast in turn, twelve FMAs. MOV, BCAST
// and FMA are the float32 or float64 instructions.
#define KSTEP(MOV, BCAST, FMA, w, aoff, boff) \
	MOV boff(DX), Y12 \
	MOV boff+32(DX), Y13 \
	BCAST aoff(SI), Y14 \
	FMA Y12, Y14, Y0 \
	FMA Y13, Y14, Y1 \
	BCAST aoff+w(SI), Y15 \
	FMA Y12, Y15, Y2 \
	FMA Y13, Y15, Y3 \
	BCAST aoff+2*w(SI), Y14 \
	FMA Y12, Y14, Y4 \
	FMA Y13, Y14, Y5 \
	BCAST aoff+3*w(SI), Y15 \
	FMA Y12, Y15, Y6 \
	FMA Y13, Y15, Y7 \
	BCAST aoff+4*w(SI), Y14 \
	FMA Y12, Y14, Y8 \
	FMA Y13, Y14, Y9 \
	BCAST aoff+5*w(SI), Y15 \
	FMA Y12, Y15, Y10 \
	FMA Y13, Y15, Y11

#define SSTEP(aoff, boff) KSTEP(VMOVUPS, VBROADCASTSS, VFMADD231PS, 4, aoff, boff)
#define DSTEP(aoff, boff) KSTEP(VMOVUPD, VBROADCASTSD, VFMADD231PD, 8, aoff, boff)

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
	ZERO12

loop2:
	CMPQ CX, $2
	JL   tail
	SSTEP(0, 0)
	SSTEP(24, 64)
	ADDQ $48, SI
	ADDQ $128, DX
	SUBQ $2, CX
	JMP  loop2

tail:
	TESTQ CX, CX
	JZ    store
	SSTEP(0, 0)

store:
	STORE12(VADDPS, VMOVUPS)
	VZEROUPPER
	RET

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
	ZERO12

dloop2:
	CMPQ CX, $2
	JL   dtail
	DSTEP(0, 0)
	DSTEP(48, 64)
	ADDQ $96, SI
	ADDQ $128, DX
	SUBQ $2, CX
	JMP  dloop2

dtail:
	TESTQ CX, CX
	JZ    dstore
	DSTEP(0, 0)

dstore:
	STORE12(VADDPD, VMOVUPD)
	VZEROUPPER
	RET
