package kernels

import (
	"sync"
	"unsafe"
)

// The pure-Go GEMM follows the Goto/BLIS structure: C is cut into nc-wide
// column blocks, k into kc-deep slices; for each (jc, pc) a kc×nc panel of
// op(B) is packed into nr-wide micro-panels, then each mc×kc block of op(A)
// is packed (scaled by alpha) into mr-tall micro-panels and a macro-kernel
// runs an mr×nr register-tiled micro-kernel over the block. Packing makes the
// micro-kernel's loads unit-stride and independent of the transposes and
// leading dimensions. Blocks of rows of C are shared out to goroutines.
//
// The portable micro-kernel is 4×2, unrolled twice along k. Wider tiles
// (4×4, 4×3) measured slower: Go's amd64 backend has 16 scalar float
// registers and schedules all products of an iteration before the
// additions, so larger tiles spill accumulators to the stack. On CPUs with
// AVX2 and FMA, float32 runs a 6×16 assembly micro-kernel instead and
// float64 a 6×8 one (the BLIS Haswell shapes: twelve vector
// accumulators), with blocks sized for their panels.
const (
	mr = 4
	nr = 2
)

// float is the element type of the pure-Go GEMM.
type float interface{ ~float32 | ~float64 }

// blocking holds cache block sizes (in elements): mc×kc of A lives in L2,
// kc×nr of B in L1, kc×nc of B in L3; and the micro-kernel's tile, mr×nr,
// with vec set for the assembly kernels (6×16 float32, 6×8 float64).
type blocking struct {
	mc, kc, nc int
	mr, nr     int
	vec        bool
}

// goGEMM is the pure-Go backend's per-BLAS state: the goroutine bound, block
// sizes, and pools of packing buffers (*[]float32 and *[]float64) reused
// across calls.
type goGEMM struct {
	threads        int
	parMin         int // minimum m*n*k worth splitting across goroutines
	blk32, blk64   blocking
	pool32, pool64 sync.Pool
}

func newGoGEMM(threads int) *goGEMM {
	return &goGEMM{
		threads: max(1, threads),
		parMin:  64 * 64 * 64,
		blk32:   blocking32(),
		blk64:   blocking64(),
	}
}

// blocking64 is the float64 blocking: for the 6×8 vector kernel, the same
// bytes per block as float32's (72×256 of A, 256×8 panels of B).
func blocking64() blocking {
	if haveVec {
		return blocking{mc: 72, kc: 256, nc: 4096, mr: 6, nr: 8, vec: true}
	}
	return blocking{mc: 96, kc: 192, nc: 2048, mr: mr, nr: nr}
}

// blocking32 is the float32 blocking: for the 6×16 vector kernel, a
// 144×256 block of A (144 KiB, in a 512 KiB L2) and 256×16 micro-panels of
// B (16 KiB, in L1).
func blocking32() blocking {
	if haveVec {
		return blocking{mc: 144, kc: 256, nc: 4096, mr: 6, nr: 16, vec: true}
	}
	return blocking{mc: 128, kc: 256, nc: 4096, mr: mr, nr: nr}
}

func getBuf[T float](p *sync.Pool, n int) *[]T {
	if v, ok := p.Get().(*[]T); ok && cap(*v) >= n {
		*v = (*v)[:n]
		return v
	}
	s := make([]T, n)
	return &s
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// gemmGo computes C = alpha*op(A)*op(B) + beta*C on validated arguments with
// m, n > 0.
func gemmGo[T float](g *goGEMM, pool *sync.Pool, blk blocking, transA, transB bool, m, n, k int, alpha T, a []T, lda int, b []T, ldb int, beta T, c []T, ldc int) {
	if beta != 1 {
		for i := range m {
			row := c[i*ldc : i*ldc+n]
			if beta == 0 {
				clear(row) // overwrite, like BLAS: NaN or Inf in C must not leak through
			} else {
				for j := range row {
					row[j] *= beta
				}
			}
		}
	}
	if alpha == 0 || k == 0 {
		return
	}

	workers := g.threads
	if float64(m)*float64(n)*float64(k) < float64(g.parMin) || m < 2*blk.mr {
		workers = 1
	}
	kc := min(blk.kc, k)
	nc := min(blk.nc, n)
	mc := min(blk.mc, m)
	nBlocks := ceilDiv(m, mc)
	if workers > 1 {
		// Make the number of row blocks a multiple of the worker count, so
		// that the static split is balanced.
		nBlocks = ceilDiv(nBlocks, workers) * workers
		mc = ceilDiv(ceilDiv(m, nBlocks), blk.mr) * blk.mr
		nBlocks = ceilDiv(m, mc)
		workers = min(workers, nBlocks)
	}

	bbuf := getBuf[T](pool, ceilDiv(nc, blk.nr)*blk.nr*kc)
	defer pool.Put(bbuf)
	abufs := make([]*[]T, workers)
	for w := range abufs {
		abufs[w] = getBuf[T](pool, ceilDiv(mc, blk.mr)*blk.mr*kc)
	}
	defer func() {
		for _, p := range abufs {
			pool.Put(p)
		}
	}()

	for jc := 0; jc < n; jc += nc {
		ncb := min(nc, n-jc)
		for pc := 0; pc < k; pc += kc {
			kcb := min(kc, k-pc)
			bp := *bbuf
			parallelRange(workers, ceilDiv(ncb, blk.nr), func(_, lo, hi int) {
				packB(bp, blk.nr, transB, b, ldb, pc, kcb, jc, ncb, lo, hi)
			})
			parallelRange(workers, nBlocks, func(w, lo, hi int) {
				ap := *abufs[w]
				for ib := lo; ib < hi; ib++ {
					ic := ib * mc
					mcb := min(mc, m-ic)
					packA(ap, blk.mr, transA, a, lda, ic, mcb, pc, kcb, alpha)
					macroKernel(blk, mcb, ncb, kcb, ap, bp, c[ic*ldc+jc:], ldc)
				}
			})
		}
	}
}

// parallelRange splits [0, n) into up to workers contiguous parts and runs
// f on each, the first on the calling goroutine. w is the part's index.
func parallelRange(workers, n int, f func(w, lo, hi int)) {
	workers = min(workers, n)
	if workers <= 1 {
		f(0, 0, n)
		return
	}
	var wg sync.WaitGroup
	for w := 1; w < workers; w++ {
		lo, hi := w*n/workers, (w+1)*n/workers
		wg.Go(func() { f(w, lo, hi) })
	}
	f(0, 0, n/workers)
	wg.Wait()
}

// packA packs alpha*op(A)[ic:ic+mcb, pc:pc+kcb] into dst as mr-tall
// micro-panels: panel r holds, for each p, the mr values of rows
// r*mr..r*mr+mr-1 in column p; rows past mcb are zero.
func packA[T float](dst []T, mr int, transA bool, a []T, lda, ic, mcb, pc, kcb int, alpha T) {
	if transA && mr == 6 {
		// The vector kernel's panels from rows of A: read each row of A
		// once, left to right, writing its 6-value pieces into the panels.
		full := mcb / 6
		for p := range kcb {
			row := a[(pc+p)*lda+ic:][:mcb:mcb]
			for r := range full {
				src := row[r*6:][:6:6]
				d := dst[(r*kcb+p)*6:][:6:6]
				d[0], d[1], d[2] = alpha*src[0], alpha*src[1], alpha*src[2]
				d[3], d[4], d[5] = alpha*src[3], alpha*src[4], alpha*src[5]
			}
		}
		if full*6 == mcb {
			return
		}
		ic, mcb = ic+full*6, mcb-full*6 // the partial panel, below
		dst = dst[full*6*kcb:]
	}
	for r := 0; r*mr < mcb; r++ {
		pan := dst[r*mr*kcb : (r+1)*mr*kcb]
		rows := min(mr, mcb-r*mr)
		i0 := ic + r*mr
		if rows < mr {
			clear(pan)
		}
		if !transA && rows == 6 && mr == 6 { // the vector kernel's panels, unrolled
			r0 := a[i0*lda+pc:][:kcb:kcb]
			r1 := a[(i0+1)*lda+pc:][:kcb:kcb]
			r2 := a[(i0+2)*lda+pc:][:kcb:kcb]
			r3 := a[(i0+3)*lda+pc:][:kcb:kcb]
			r4 := a[(i0+4)*lda+pc:][:kcb:kcb]
			r5 := a[(i0+5)*lda+pc:][:kcb:kcb]
			for p := range kcb {
				d := pan[p*6:][:6:6]
				d[0], d[1], d[2] = alpha*r0[p], alpha*r1[p], alpha*r2[p]
				d[3], d[4], d[5] = alpha*r3[p], alpha*r4[p], alpha*r5[p]
			}
			continue
		}
		if !transA {
			for ii := range rows {
				src := a[(i0+ii)*lda+pc : (i0+ii)*lda+pc+kcb]
				for p, v := range src {
					pan[p*mr+ii] = alpha * v
				}
			}
			continue
		}
		// op(A)[i][p] = A[p][i]: row p of A holds the mr values contiguously.
		for p := range kcb {
			src := a[(pc+p)*lda+i0 : (pc+p)*lda+i0+rows]
			d := pan[p*mr : p*mr+rows]
			for ii, v := range src {
				d[ii] = alpha * v
			}
		}
	}
}

// packB packs micro-panels lo..hi-1 of op(B)[pc:pc+kcb, jc:jc+ncb] into dst:
// panel q holds, for each p, the nr values of columns q*nr..q*nr+nr-1 in row
// p; columns past ncb are zero.
func packB[T float](dst []T, nr int, transB bool, b []T, ldb, pc, kcb, jc, ncb, lo, hi int) {
	if !transB && nr*int(unsafe.Sizeof(T(0))) == 64 {
		// The vector kernels' panels (16 float32 or 8 float64): read each
		// row of B once, left to right, in typed 64-byte moves; the last
		// panel may be partial.
		full := min(hi, ncb/nr)
		if full > lo {
			d, src := dst[lo*nr*kcb:], b[pc*ldb+jc+lo*nr:]
			if nr == 16 {
				packRows16(asFloat32(d), asFloat32(src), ldb, kcb, full-lo)
			} else {
				packRows8(asFloat64(d), asFloat64(src), ldb, kcb, full-lo)
			}
		}
		lo = max(lo, full)
	}
	for q := lo; q < hi; q++ {
		pan := dst[q*nr*kcb : (q+1)*nr*kcb]
		cols := min(nr, ncb-q*nr)
		j0 := jc + q*nr
		if cols < nr {
			clear(pan)
		}
		if !transB {
			for p := range kcb {
				src := b[(pc+p)*ldb+j0 : (pc+p)*ldb+j0+cols]
				d := pan[p*nr : p*nr+cols]
				copy(d, src)
			}
			continue
		}
		// op(B)[p][j] = B[j][p]: row j of B holds column j of op(B).
		for jj := range cols {
			src := b[(j0+jj)*ldb+pc : (j0+jj)*ldb+pc+kcb]
			for p, v := range src {
				pan[p*nr+jj] = v
			}
		}
	}
}

// macroKernel adds the packed mcb×kcb block times the packed kcb×ncb panel
// into C (c starts at the block's top-left element), one blk.mr×blk.nr
// tile at a time; partial tiles at the edges go through a scratch tile.
func macroKernel[T float](blk blocking, mcb, ncb, kcb int, ap, bp []T, c []T, ldc int) {
	mr, nr := blk.mr, blk.nr
	var tmp [6 * 16]T
	for jr := 0; jr < ncb; jr += nr {
		nrb := min(nr, ncb-jr)
		bpan := bp[jr*kcb : (jr+nr)*kcb]
		for ir := 0; ir < mcb; ir += mr {
			mrb := min(mr, mcb-ir)
			apan := ap[ir*kcb : (ir+mr)*kcb]
			if mrb == mr && nrb == nr {
				tile(blk, kcb, apan, bpan, c[ir*ldc+jr:], ldc)
				continue
			}
			clear(tmp[:])
			tile(blk, kcb, apan, bpan, tmp[:], nr)
			for i := range mrb {
				row := c[(ir+i)*ldc+jr : (ir+i)*ldc+jr+nrb]
				for j := range row {
					row[j] += tmp[i*nr+j]
				}
			}
		}
	}
}

// tile adds one packed mr×kc A panel times one packed kc×nr B panel into
// the tile of c with row stride ldc, on blk's micro-kernel.
func tile[T float](blk blocking, kc int, a, b, c []T, ldc int) {
	if blk.vec {
		// The slices hold whole panels and a whole tile (checked here);
		// T is float32 or float64, as its size says.
		_, _, _ = a[6*kc-1], b[blk.nr*kc-1], c[5*ldc+blk.nr-1]
		if unsafe.Sizeof(T(0)) == 4 {
			sgemm6x16AVX2(kc, (*float32)(unsafe.Pointer(&a[0])), (*float32)(unsafe.Pointer(&b[0])), (*float32)(unsafe.Pointer(&c[0])), ldc)
		} else {
			dgemm6x8AVX2(kc, (*float64)(unsafe.Pointer(&a[0])), (*float64)(unsafe.Pointer(&b[0])), (*float64)(unsafe.Pointer(&c[0])), ldc)
		}
		return
	}
	microKernel(kc, a, b, c, ldc)
}

// microKernel adds the product of an mr×kc packed A panel and a kc×nr packed
// B panel into the mr×nr tile of c with row stride ldc. Each iteration takes
// two k-steps through fixed-length sub-slices, so the element loads carry no
// bounds checks (one slice check per iteration remains).
func microKernel[T float](kc int, a, b, c []T, ldc int) {
	var c00, c01, c10, c11, c20, c21, c30, c31 T
	a = a[:kc*mr]
	b = b[:kc*nr]
	i, j := 0, 0
	for ; i+2*mr <= len(a) && j+2*nr <= len(b); i, j = i+2*mr, j+2*nr {
		aa := a[i : i+2*mr : i+2*mr]
		bb := b[j : j+2*nr : j+2*nr]
		b0, b1 := bb[0], bb[1]
		c00 += aa[0] * b0
		c01 += aa[0] * b1
		c10 += aa[1] * b0
		c11 += aa[1] * b1
		c20 += aa[2] * b0
		c21 += aa[2] * b1
		c30 += aa[3] * b0
		c31 += aa[3] * b1
		b0, b1 = bb[2], bb[3]
		c00 += aa[4] * b0
		c01 += aa[4] * b1
		c10 += aa[5] * b0
		c11 += aa[5] * b1
		c20 += aa[6] * b0
		c21 += aa[6] * b1
		c30 += aa[7] * b0
		c31 += aa[7] * b1
	}
	if i+mr <= len(a) && j+nr <= len(b) { // odd kc: one k-step left
		aa := a[i : i+mr : i+mr]
		bb := b[j : j+nr : j+nr]
		b0, b1 := bb[0], bb[1]
		c00 += aa[0] * b0
		c01 += aa[0] * b1
		c10 += aa[1] * b0
		c11 += aa[1] * b1
		c20 += aa[2] * b0
		c21 += aa[2] * b1
		c30 += aa[3] * b0
		c31 += aa[3] * b1
	}
	r := c[0:nr:nr]
	r[0] += c00
	r[1] += c01
	r = c[ldc : ldc+nr : ldc+nr]
	r[0] += c10
	r[1] += c11
	r = c[2*ldc : 2*ldc+nr : 2*ldc+nr]
	r[0] += c20
	r[1] += c21
	r = c[3*ldc : 3*ldc+nr : 3*ldc+nr]
	r[0] += c30
	r[1] += c31
}

// packRows16 packs panels 16-wide column blocks of rows rows of src (row
// stride ld) into dst: panel q holds, for each row p, the 16 values
// src[p·ld + 16q :][:16], and panels follow each other.
func packRows16(dst, src []float32, ld, rows, panels int) {
	for p := range rows {
		row := src[p*ld:]
		for q := range panels {
			*(*[16]float32)(dst[(q*rows+p)*16:]) = *(*[16]float32)(row[q*16:])
		}
	}
}

// packRows8 is packRows16 for 8-wide float64 panels.
func packRows8(dst, src []float64, ld, rows, panels int) {
	for p := range rows {
		row := src[p*ld:]
		for q := range panels {
			*(*[8]float64)(dst[(q*rows+p)*8:]) = *(*[8]float64)(row[q*8:])
		}
	}
}

// asFloat64 views s as []float64; T must be 8 bytes wide.
func asFloat64[T float](s []T) []float64 {
	return unsafe.Slice((*float64)(unsafe.Pointer(unsafe.SliceData(s))), len(s))
}

// asFloat32 views s as []float32; T must be 4 bytes wide (float32 or a
// type based on it).
func asFloat32[T float](s []T) []float32 {
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(s))), len(s))
}
