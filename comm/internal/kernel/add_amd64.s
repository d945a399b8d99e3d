#include "textflag.h"

// ADDLOOP is the body of every vector sum here: dst[i] = a[i] + b[i] for
// i < n, n a multiple of SMALL (the elements in one 32-byte register), four
// registers at a time while BIG (four registers' worth) remain. LOAD, ADD
// and STORE are the instructions for the element type, STORE a streaming
// store (then FENCE is SFENCE) or an ordinary one (FENCE is empty). Labels
// are local to each TEXT block, so every function can expand it.
#define ADDLOOP(LOAD, ADD, STORE, BIG, SMALL, FENCE) \
	MOVQ dst+0(FP), DI \
	MOVQ a+8(FP), SI   \
	MOVQ b+16(FP), DX  \
	MOVQ n+24(FP), CX  \
big:                   \
	CMPQ CX, $BIG      \
	JL   small         \
	LOAD (SI), Y0      \
	LOAD 32(SI), Y1    \
	LOAD 64(SI), Y2    \
	LOAD 96(SI), Y3    \
	ADD  (DX), Y0, Y0  \
	ADD  32(DX), Y1, Y1 \
	ADD  64(DX), Y2, Y2 \
	ADD  96(DX), Y3, Y3 \
	STORE Y0, (DI)     \
	STORE Y1, 32(DI)   \
	STORE Y2, 64(DI)   \
	STORE Y3, 96(DI)   \
	ADDQ $128, SI      \
	ADDQ $128, DX      \
	ADDQ $128, DI      \
	SUBQ $BIG, CX      \
	JMP  big           \
small:                 \
	CMPQ CX, $SMALL    \
	JL   done          \
	LOAD (SI), Y0      \
	ADD  (DX), Y0, Y0  \
	STORE Y0, (DI)     \
	ADDQ $32, SI       \
	ADDQ $32, DX       \
	ADDQ $32, DI       \
	SUBQ $SMALL, CX    \
	JMP  small         \
done:                  \
	FENCE              \
	VZEROUPPER         \
	RET

#define NOFENCE

// func addF32AVX2(dst, a, b *float32, n int)
// n is a multiple of 8; dst may alias a or b.
TEXT ·addF32AVX2(SB), NOSPLIT, $0-32
	ADDLOOP(VMOVUPS, VADDPS, VMOVUPS, 32, 8, NOFENCE)

// func addF64AVX2(dst, a, b *float64, n int)
// n is a multiple of 4; dst may alias a or b.
TEXT ·addF64AVX2(SB), NOSPLIT, $0-32
	ADDLOOP(VMOVUPD, VADDPD, VMOVUPD, 16, 4, NOFENCE)

// func addF32AVX2NT(dst, a, b *float32, n int)
// n is a multiple of 8; dst is 32-byte aligned; stores bypass the cache.
TEXT ·addF32AVX2NT(SB), NOSPLIT, $0-32
	ADDLOOP(VMOVUPS, VADDPS, VMOVNTPS, 32, 8, SFENCE)

// func addF64AVX2NT(dst, a, b *float64, n int)
// n is a multiple of 4; dst is 32-byte aligned; stores bypass the cache.
TEXT ·addF64AVX2NT(SB), NOSPLIT, $0-32
	ADDLOOP(VMOVUPD, VADDPD, VMOVNTPD, 16, 4, SFENCE)

// func copyAVX2NT(dst, src *byte, n int)
// Copies n bytes (a multiple of 128) with stores that bypass the cache;
// dst is 32-byte aligned.
TEXT ·copyAVX2NT(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
copyloop:
	CMPQ CX, $128
	JL   copydone
	VMOVDQU (SI), Y0
	VMOVDQU 32(SI), Y1
	VMOVDQU 64(SI), Y2
	VMOVDQU 96(SI), Y3
	VMOVNTDQ Y0, (DI)
	VMOVNTDQ Y1, 32(DI)
	VMOVNTDQ Y2, 64(DI)
	VMOVNTDQ Y3, 96(DI)
	ADDQ $128, SI
	ADDQ $128, DI
	SUBQ $128, CX
	JMP  copyloop
copydone:
	SFENCE
	VZEROUPPER
	RET
